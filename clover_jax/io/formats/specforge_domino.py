"""Domino drafters as SpecForge 0.2.0 saves and loads them (`DominoDraftModel`): DFlash's format
(`formats.dflash`, which says what their config and tensors add) with their correction's keys and
tensors."""

from __future__ import annotations

from functools import partial

from clover_jax.io.formats.dflash import export_as, load_as, matches_variant

NAME = "domino"
METHOD = "domino"

matches = partial(matches_variant, method=METHOD)  # a config.json naming architectures ["DominoDraftModel"]
load = partial(load_as, method=METHOD)  # (folder, base) -> our Domino drafter
export = partial(export_as, method=METHOD, name=NAME)  # (drafter, base, out): written as SpecForge's save_pretrained writes one
