"""Launch layer: from where a run's TF ports can be reached. TensorFlow's gRPC servers listen on
every address, unauthenticated, whatever TF_CONFIG says: whoever reaches a port can run
TensorFlow operations as the person training. The local backend keeps them in a network
namespace of the run's own (local/netns.py); on lab hosts, the network and its firewall must."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.states import Degraded


@dataclass(frozen=True)
class Exposure:
    """From where a run's TF ports can be reached, and why (TensorFlow's gRPC servers listen on
    every address, unauthenticated): `orchestrate plan` and `check`, status.json `network`."""

    isolated: bool  # in a network of the run's own
    reachable_from: str
    why: str
    warn: bool = False  # said once on the console when a run opens (not in status.json)
    outbound: str | None = None  # what the tasks reach outside the run ("offline: …" where nothing)
    #: Why names are not resolved in the run (this machine's resolver on its loopback, out of the
    #: run's reach, and no resolv.conf of its own to be had); None where they are as promised.
    unresolved: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "isolated": self.isolated,
            "reachable_from": self.reachable_from,
            "why": self.why,
            "outbound": self.outbound,
            "names": f"not resolved in the run: {self.unresolved}" if self.unresolved else None,
        }

    def fallbacks(self) -> list[Degraded]:
        """What of the run's network falls short of the spec's asking (said once as the run opens,
        listed in status.json's `degraded`): its TF ports open to others, its tasks offline, names
        not resolved."""
        out = []
        if self.warn and not self.isolated:
            said = f"this run's TF ports are open to every user of this machine ({self.why})"
            out.append(Degraded("network", "this machine", said, OPEN_FIX))
        elif self.warn and self.offline:
            install = (
                "install passt (`apt install passt`), or " if "install passt" in (self.outbound or "") else ""
            )
            fix = f"{install}set `local: {{outbound: off}}` to run offline knowingly"
            out.append(Degraded("outbound", "this machine", f"{OFFLINE} ({self.outbound})", fix))
        if self.unresolved and not self.offline:
            said = f"names are not resolved in this run's network namespace: {self.unresolved}"
            out.append(Degraded("names", "this machine", said, NAMES_FIX))
        return out

    @property
    def offline(self) -> bool:
        return (self.outbound or "").startswith("offline")

    @property
    def said(self) -> str:
        """`plan`'s and `check`'s lines: `network: …`, or `warning: …` where the ports are open to
        others, and a warning of its own where the tasks are offline without the spec's asking."""
        if not self.isolated:
            return f"warning: {self.line}"
        offline = f"\nwarning: {OFFLINE} ({self.outbound})" if self.warn and self.offline else ""
        names = f"\nwarning: names are not resolved in the run: {self.unresolved}" if self.unresolved else ""
        return f"network: {self.line}{offline}{names}"

    @property
    def line(self) -> str:
        out = f"; outgoing: {self.outbound}" if self.outbound else ""
        return f"TF ports reachable from {self.reachable_from} ({self.why}){out}"


#: Said where a run's tasks are in a network of their own with no way out (the console, plan, check).
OFFLINE = "this run's tasks reach no network outside it"
#: The fixes of a local run's network fallbacks.
OPEN_FIX = (
    "let unprivileged users make user namespaces (the setting named), or set "
    "`local: {isolate_network: off}` to run so knowingly"
)
NAMES_FIX = (
    "name a resolver off the loopback in /etc/resolv.conf, let unprivileged users make mount "
    "namespaces, or set `local: {isolate_network: off}` (the TF ports are then open to every user of "
    "this machine)"
)

#: What the tasks of a backend whose hosts are lab machines reach: whatever their hosts do.
HOSTS_OWN = "each host's own network"

#: The advice for backends whose tasks listen on lab hosts' addresses.
PRIVATE_NETWORK = (
    "TensorFlow listens on every address, unauthenticated: keep the hosts on a private network, "
    "or let their firewall admit the cluster's own addresses alone to the TF ports"
)
