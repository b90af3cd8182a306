"""Launch layer, local backend: the spec's `local:` section (how a run's tasks are networked)
and the words for what a run's network turned out to be (`plan`, `check`, status.json
`network`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from orchestrator.launch.exposure import Exposure
from orchestrator.spec.base import Strict
from orchestrator.spec.model import yaml_switch


class LocalSpec(Strict):
    """The spec's `local:` section."""

    isolate_network: str = Field(
        default="auto",
        pattern="^(auto|on|off)$",
        description="auto | on | off: the tasks in a private network namespace, their TF ports "
        "out of every other user's reach (auto: where the kernel allows it; on: refuse to run "
        "without it, exit 3)",
    )
    outbound: str = Field(
        default="auto",
        pattern="^(auto|on|off)$",
        description="auto | on | off: outgoing network from the run's namespace (pasta, of the "
        "passt package; auto: where installed, else the tasks are offline, said; on: refuse to "
        "run without it, exit 3)",
    )
    reach_host_loopback: tuple[Annotated[int, Field(ge=1, le=65535)], ...] = Field(
        default=(),
        max_length=64,
        description="ports of this machine's loopback the tasks may reach from their namespace "
        "(a local MLflow, a data server); the rest of it stays out of reach: other users' "
        "unauthenticated services listen there",
    )

    _yaml_switch = field_validator("isolate_network", "outbound", mode="before")(yaml_switch)

    @field_validator("reach_host_loopback")
    @classmethod
    def _once(cls, ports: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(ports)))


ISOLATED = "this run's own network namespace only"
OPEN = "every address of this machine, by every user of it"
ONLINE_OPEN = "this machine's own network"


def isolated(outgoing: str, warn: bool = False) -> Exposure:
    """In the run's namespace; `outgoing`: what it reaches (`warn`: said on the console, offline
    where the spec did not ask for it)."""
    why = "a private network namespace: nothing outside the run connects in"
    return Exposure(True, ISOLATED, why, warn=warn, outbound=outgoing)


def open_because(why: str, warn: bool = True) -> Exposure:
    """Open to every user; `warn`: said on the console (not where the spec asked for it: off)."""
    return Exposure(False, OPEN, why, warn=warn, outbound=ONLINE_OPEN)


#: What the spec's `isolate_network: off` gives (asked for: not warned of).
OFF = open_because("the spec's local.isolate_network is off", warn=False)
