"""DFlash 2 drafters as their authors' `dflash` package publishes them (`DFlash2DraftModel`): DFlash's
format (`formats.dflash`) with the convolutions' and the candidate selector's keys and tensors."""

from __future__ import annotations

from pathlib import Path

from clover_jax.drafters import registry
from clover_jax.errors import CloverError
from clover_jax.io.formats.dflash import export_as, is_dflash2, load_as
from clover_jax.io.formats.weights import read_config
from clover_jax.model.llama import Llama

NAME = "dflash2"
METHOD = "dflash2"


def matches(folder: Path) -> bool:
    """A config.json naming architectures ["DFlash2DraftModel"]."""
    return is_dflash2(read_config(folder, strict=False))


def load(folder: Path, base: Llama):
    """The DFlash 2 drafter in `folder`, as our DFlash 2 drafter for `base`."""
    return load_as(folder, base, True)


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our DFlash 2 drafter as the authors' package publishes one."""
    if drafter.hcfg.method != METHOD:
        raise CloverError(f"only DFlash 2 drafters export as {NAME}; these are {registry.title(drafter.hcfg.method)}'s")
    return export_as(drafter, base, out, True)
