"""The CLI room: `orchestrate …` (commands.py)."""

from orchestrator.cli.commands import *  # noqa: F403
from orchestrator.cli.commands import __doc__ as __doc__, main as main
