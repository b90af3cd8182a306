"""Spec layer: the backends' sections of a spec (`ssh:`, `slurm:`, a plugin's), each validated by the
backend that owns it (launch/kind.py), and the hosts a backend's section places.

A top-level key named after a registered backend is that backend's section. A spec may carry
several (the same spec run with `--backend`): each is validated by its own backend; the one the
spec runs on is read with `spec.section(name)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.errors import SpecProblem
from orchestrator.launch import registry
from orchestrator.launch.kind import Kind
from orchestrator.spec.model import ClusterSpec


def split(data: Mapping[Any, Any]) -> tuple[dict[Any, Any], dict[str, Any]]:
    """The spec's own keys, and its backends' sections."""
    own = ClusterSpec.model_fields
    found = {
        k: v for k, v in data.items() if isinstance(k, str) and k not in own and registry.is_registered(k)
    }
    return {k: v for k, v in data.items() if k not in found}, found


def kind_of(data: Mapping[Any, Any]) -> Kind | None:
    """The backend a spec's data names, None where it names none that can be loaded (said by the
    checks, at `backend:`)."""
    name = data.get("backend", ClusterSpec.model_fields["backend"].default)
    if not isinstance(name, str) or not registry.is_registered(name):
        return None
    try:
        return registry.get(name)
    except registry.UnknownBackend:
        return None


def validate(
    found: Mapping[str, Any], context: Mapping[str, Any]
) -> tuple[dict[str, BaseModel], list[dict[str, Any]], list[SpecProblem]]:
    """Each section by its backend's model: the models, pydantic's errors (located under the
    section's key), and the sections no backend can take."""
    models: dict[str, BaseModel] = {}
    errors: list[dict[str, Any]] = []
    problems: list[SpecProblem] = []
    for name, value in found.items():
        try:
            model = registry.get(name).section
        except registry.UnknownBackend as exc:
            problems.append(SpecProblem((name,), str(exc)))
            continue
        if model is None:
            problems.append(SpecProblem((name,), f"backend {name} has no section of its own; remove it"))
            continue
        try:
            models[name] = model.model_validate(value, context=dict(context))
        except ValidationError as exc:
            errors += [{**err, "loc": (name, *err["loc"])} for err in exc.errors()]
    return models, errors, problems


def complete(spec: ClusterSpec, models: Mapping[str, BaseModel]) -> ClusterSpec:
    """The spec with its sections, and the hosts its backend's section stands for (if it places
    the tasks and is there: a missing one is said by the checks)."""
    spec = spec.with_sections(dict(models), None)
    kind = kind_of({"backend": spec.backend})
    if kind is None or not kind.places_tasks or spec.section(kind.name) is None:
        return spec
    return spec.with_sections(dict(models), kind.section_hosts(spec))


def missing_section(kind: Kind) -> SpecProblem:
    """`backend slurm needs a slurm: section (nodes, tasks_per_node)`."""
    model = kind.section
    required = [n for n, f in model.model_fields.items() if f.is_required()] if model is not None else []
    keys = f" ({', '.join(required)})" if required else ""
    return SpecProblem(("backend",), f"backend {kind.name} needs a {kind.name}: section{keys}")


def section_model(name: str) -> type[BaseModel] | None:
    """The model of the section at the spec's top-level key `name`, if a backend owns one."""
    if name in ClusterSpec.model_fields or not registry.is_registered(name):
        return None
    try:
        return registry.get(name).section
    except registry.UnknownBackend:
        return None


def json_schema() -> dict[str, Any]:
    """The spec's JSON Schema (`orchestrate schema`), the registered backends' sections included."""
    schema = ClusterSpec.model_json_schema()
    defs = schema.setdefault("$defs", {})
    for name in registry.names():
        model = section_model(name)
        if model is None:
            continue
        part = model.model_json_schema()
        defs.update(part.pop("$defs", {}))
        schema["properties"][name] = {
            **part,
            "description": f"backend {name}: {part.get('description', 'its settings')}",
        }
    return schema
