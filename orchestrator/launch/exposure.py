"""Launch layer: from where a run's TF ports can be reached. TensorFlow's gRPC servers listen on
every address, unauthenticated, whatever TF_CONFIG says: whoever reaches a port can run
TensorFlow operations as the person training. The local backend keeps them in a network
namespace of the run's own (local/netns.py); on lab hosts, the network and its firewall must."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exposure:
    """From where a run's TF ports can be reached, and why (TensorFlow's gRPC servers listen on
    every address, unauthenticated): `orchestrate plan` and `check`, status.json `network`."""

    isolated: bool  # in a network of the run's own
    reachable_from: str
    why: str
    warn: bool = False  # said once on the console when a run opens (not in status.json)
    outbound: str | None = None  # what the tasks reach outside the run ("offline: …" where nothing)

    def to_json(self) -> dict[str, object]:
        return {
            "isolated": self.isolated,
            "reachable_from": self.reachable_from,
            "why": self.why,
            "outbound": self.outbound,
        }

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
        return f"network: {self.line}{offline}"

    @property
    def line(self) -> str:
        out = f"; outgoing: {self.outbound}" if self.outbound else ""
        return f"TF ports reachable from {self.reachable_from} ({self.why}){out}"


#: Said where a run's tasks are in a network of their own with no way out (the console, plan, check).
OFFLINE = "this run's tasks reach no network outside it"

#: What the tasks of a backend whose hosts are lab machines reach: whatever their hosts do.
HOSTS_OWN = "each host's own network"

#: The advice for backends whose tasks listen on lab hosts' addresses.
PRIVATE_NETWORK = (
    "TensorFlow listens on every address, unauthenticated: keep the hosts on a private network, "
    "or let their firewall admit the cluster's own addresses alone to the TF ports"
)
