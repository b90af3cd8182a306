"""Health layer: who may speak for which task.

The run's secret never leaves the coordinator. Every task gets a credential of its own for each
attempt, `worker-1/3:<MAC>`, signed with the key of its host (its scope: the spec's host index, 0
for the local backend), which is derived from the secret. The heartbeat server takes a heartbeat
only for the task and attempt its credential names, so one task (buggy, or run by someone hostile)
cannot speak for another, nor for another attempt of itself.

A host's relay (ssh backend) gets its host's key and a credential of its own, `relay/<scope>`: it
checks its tasks' credentials itself, and the coordinator takes from it heartbeats of that host's
tasks only. A host that leaks its key exposes its own tasks, no others.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from worker.wire.http1 import RELAY, claimed, sign, task_of, verify


@dataclass(frozen=True)
class Client:
    """Whom a checked credential speaks for: a task of one attempt, or a host's relay."""

    scope: int
    task: str | None = None  # None: the relay of host `scope`
    attempt: int = -1


class Credentials:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)
        self._scopes: dict[str, int] = {}
        self._hosts: frozenset[int] = frozenset()  # the scopes a relay may speak for
        self._keys: dict[int, bytes] = {}

    def place(self, scopes: Mapping[str, int]) -> None:
        """Where each task runs (task -> host index), from the plan; again when it changes."""
        self._scopes = dict(scopes)  # replaced whole: the server thread reads it unlocked
        self._hosts = frozenset(self._scopes.values())

    def scope_of(self, task: str) -> int | None:
        return self._scopes.get(task)

    def scope_key(self, scope: int) -> bytes:
        """The key a host's credentials are signed with (its relay checks them with it)."""
        key = self._keys.get(scope)
        if key is None:
            key = hmac.new(self._secret, f"scope/{scope}".encode(), hashlib.sha256).digest()
            self._keys[scope] = key
        return key

    def task_token(self, task: str, attempt: int) -> str:
        return sign(self.scope_key(self._scopes[task]), f"{task}/{attempt}")

    def relay_token(self, scope: int) -> str:
        return sign(self.scope_key(scope), f"{RELAY}/{scope}")

    def check(self, token: bytes) -> Client | None:
        """Whom a token speaks for, if it is one of this run's credentials."""
        who = claimed(token)
        if who is None:
            return None
        named = task_of(who)
        if named is not None:
            scope = self._scopes.get(named[0])
            client = Client(scope, *named) if scope is not None else None
        else:
            kind, _, rest = who.partition("/")
            known = kind == RELAY and rest.isdigit() and len(rest) < 9 and int(rest) in self._hosts
            client = Client(int(rest)) if known else None  # (no key is made for a stranger's scope)
        if client is None or verify(self.scope_key(client.scope), token) is None:
            return None
        return client
