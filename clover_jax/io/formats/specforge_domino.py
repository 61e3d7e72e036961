"""Domino drafters as SpecForge 0.2.0 saves and loads them (`DominoDraftModel`): DFlash's format
(`formats.dflash`, which says what their config and tensors add) with their correction's keys and
tensors."""

from __future__ import annotations

from pathlib import Path

from clover_jax.io.formats.dflash import export_as, load_as, matches_variant
from clover_jax.model.llama import Llama

NAME = "domino"
METHOD = "domino"


def matches(folder: Path) -> bool:
    """A config.json naming architectures ["DominoDraftModel"]."""
    return matches_variant(folder, METHOD)


def load(folder: Path, base: Llama):
    """The Domino drafter in `folder`, as our Domino drafter for `base`."""
    return load_as(folder, base, METHOD)


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our Domino drafter as SpecForge's save_pretrained does, which `DominoDraftModel.from_pretrained` loads."""
    return export_as(drafter, base, out, METHOD, NAME)
