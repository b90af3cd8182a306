"""Spec layer: what every section of the spec is built on (model.py's models, and the sections kept
in modules of their own)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationInfo


def resolve_path(value: Path | None, info: ValidationInfo) -> Path | None:
    if value is None:
        return None
    try:
        value = value.expanduser()
    except RuntimeError:  # `~name/…` of a user this machine does not have
        raise ValueError(f"{value}: {str(value).split('/')[0]} names no user of this machine") from None
    base = (info.context or {}).get("base_dir")
    if base is not None and not value.is_absolute():
        value = Path(base) / value
    return Path(os.path.normpath(value))


class Strict(BaseModel):
    """A spec section: unknown keys are errors, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
