"""DFlash 2 drafters as their authors' `dflash` package publishes them (`DFlash2DraftModel`): DFlash's
format (`formats.dflash`) with the convolutions' and the candidate selector's keys and tensors."""

from __future__ import annotations

from functools import partial

from clover_jax.io.formats.dflash import export_as, load_as, matches_variant

NAME = "dflash2"
METHOD = "dflash2"

matches = partial(matches_variant, method=METHOD)  # a config.json naming architectures ["DFlash2DraftModel"]
load = partial(load_as, method=METHOD)  # (folder, base) -> our DFlash 2 drafter
export = partial(export_as, method=METHOD, name=NAME)  # (drafter, base, out): written as the authors publish one
