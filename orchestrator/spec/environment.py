"""Spec layer: the `environment:` section, the job's Python environment, made by us on every host
from wheels the coordinator resolves and downloads (orchestrator/environment/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from orchestrator.spec.base import Strict, resolve_path

MAX_REQUIREMENTS = 500
Requirement = Annotated[str, Field(min_length=1, max_length=500)]


class EnvironmentSpec(Strict):
    requirements: Path | list[Requirement] = Field(
        description="a requirements file (pip's format; relative to the spec's folder) or a list of "
        "requirements, e.g. [tensorflow==2.21.0]; what the worker runtime needs is added",
    )
    python: str | None = Field(
        default=None,
        min_length=1,
        description="the interpreter on each host that makes the environment (default: the host's "
        "python; local: the one running orchestrate)",
    )
    index_url: str | None = Field(
        default=None, min_length=1, description="pip's --index-url, on this machine"
    )
    extra_index_urls: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=20)
    find_links: list[Path] = Field(
        default_factory=list,
        max_length=20,
        description="folders of wheels on this machine (pip's --find-links)",
    )
    no_index: bool = Field(default=False, description="no package index: find_links alone")
    keep: int = Field(default=3, ge=1, le=50, description="environments kept per host (the newest used)")

    _resolve_links = field_validator("find_links")(lambda value, info: [resolve_path(v, info) for v in value])

    @field_validator("requirements", mode="before")
    @classmethod
    def _requirements(cls, value: object, info: object) -> object:
        if isinstance(value, list):
            if len(value) > MAX_REQUIREMENTS:
                raise ValueError(f"at most {MAX_REQUIREMENTS} requirements")
            for item in value:
                if isinstance(item, str) and item.strip().startswith("-"):
                    raise ValueError(
                        f"{item!r}: pip's options do not go in the list (use index_url, find_links, no_index)"
                    )
            return value
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a requirements file or a list of requirements")
        path = resolve_path(Path(value), info)  # type: ignore[arg-type]
        assert path is not None
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        return path
