"""Launch layer, ssh backend: its section of the spec (`ssh:`), read with `section(spec)`."""

from __future__ import annotations

import enum
import os
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator

from orchestrator.spec.base import Strict, resolve_path
from orchestrator.spec.model import ClusterSpec


class HostKeyPolicy(str, enum.Enum):
    STRICT = "strict"
    ACCEPT_NEW = "accept-new"


class SshSpec(Strict):
    known_hosts: Path = Field(default=Path("~/.ssh/known_hosts"), validate_default=True)
    host_key_policy: HostKeyPolicy = HostKeyPolicy.STRICT
    connect_timeout_s: float = Field(default=10.0, gt=0)
    coordinator_address: str | None = Field(
        default=None,
        pattern=r"^[^\s:/]+(:[0-9]{1,5})?$",
        description="host[:port] of this machine that the hosts can reach; heartbeats go there directly "
        "(default: through each SSH connection, which works behind NAT)",
    )
    shared_dirs: list[str] = Field(
        default_factory=list,
        description="absolute folders the job expects every host to share (a network file system); "
        "`orchestrate check` and `up` prove it by writing on one host and reading on the others",
    )

    @field_validator("known_hosts")
    @classmethod
    def _expand(cls, value: Path, info: ValidationInfo) -> Path:
        return resolve_path(value, info) or value

    @field_validator("shared_dirs")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/") or "\0" in path:
                raise ValueError(f"{path!r}: give an absolute path, as every host mounts it")
        return [os.path.normpath(p) for p in value]


def section(spec: ClusterSpec) -> SshSpec:
    """The spec's `ssh:` section (its defaults where the spec has none)."""
    found = spec.section("ssh")
    return found if isinstance(found, SshSpec) else SshSpec()
