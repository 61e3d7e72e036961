"""DSpark drafters as SpecForge 0.2.0 saves and loads them (`DSparkDraftModel`): DFlash's format
(`formats.dflash`, which says what their config and tensors add) with their correction's keys and
tensors."""

from __future__ import annotations

from functools import partial

from clover_jax.io.formats.dflash import export_as, load_as, matches_variant

NAME = "dspark"
METHOD = "dspark"

matches = partial(matches_variant, method=METHOD)  # a config.json naming architectures ["DSparkDraftModel"]
load = partial(load_as, method=METHOD)  # (folder, base) -> our DSpark drafter
export = partial(export_as, method=METHOD, name=NAME)  # (drafter, base, out): written as SpecForge's save_pretrained writes one
