"""Spec layer: the cluster spec as the user wrote it (YAML -> validated, frozen pydantic models)."""

from orchestrator.spec.load import load_spec, parse_spec
from orchestrator.spec.model import ClusterSpec, Role, Strategy

__all__ = ["ClusterSpec", "Role", "Strategy", "load_spec", "parse_spec"]
