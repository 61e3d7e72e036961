"""A method's own options on train.train's command line (`--option NAME=VALUE`): each method's config
class (`registry.Method.config`) holds its own fields, which the flag sets without a flag per method;
the config refuses, by name, an option it does not have."""

from __future__ import annotations

import argparse
import dataclasses
import json

from clover_jax.training import registry


def method_options(args) -> dict:
    """The drafter options the flags set: --embed-source and --draft-vocab where the method has them, and
    every --option NAME=VALUE (which the method's config refuses by name if it lacks it)."""
    fields = {f.name for f in dataclasses.fields(registry.get(args.method).config)}
    given = {"embed_source": args.embed_source, "draft_vocab": args.draft_vocab}
    return {**{name: value for name, value in given.items() if value and name in fields}, **dict(args.option or ())}


def method_option(text: str) -> tuple[str, object]:
    """--option NAME=VALUE: VALUE read as JSON where it parses (2, 0.5, true, null, [1, 14]), a comma list
    of such values as a list (1,14,26), else as text."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE, e.g. draft_layers=2")

    def read(v: str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    parts = [read(v.strip()) for v in value.split(",")] if "," in value and not value.lstrip().startswith("[") else None
    return name.strip(), parts if parts is not None else read(value.strip())


def options_help() -> str:
    """Each method's own options (its config's fields past method and num_heads), as --option lists them."""
    rows = []
    for m in registry.names():
        names = [f.name for f in dataclasses.fields(registry.get(m).config) if f.name not in ("method", "num_heads")]
        if names:
            rows.append(f"{m}: {', '.join(names)}")
    return "; ".join(rows)
