"""DFlash 2 drafters as their authors' `dflash` package publishes them (`DFlash2DraftModel`): DFlash's
format (`formats.dflash`) with the convolutions' and the candidate selector's keys and tensors."""

from __future__ import annotations

from pathlib import Path

from clover_jax.io.formats.dflash import export_as, load_as, matches_variant
from clover_jax.model.llama import Llama

NAME = "dflash2"
METHOD = "dflash2"


def matches(folder: Path) -> bool:
    """A config.json naming architectures ["DFlash2DraftModel"]."""
    return matches_variant(folder, METHOD)


def load(folder: Path, base: Llama):
    """The DFlash 2 drafter in `folder`, as our DFlash 2 drafter for `base`."""
    return load_as(folder, base, METHOD)


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our DFlash 2 drafter as the authors' package publishes one."""
    return export_as(drafter, base, out, METHOD, NAME)
