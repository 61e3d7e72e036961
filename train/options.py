"""A method's own options on train.train's command line (`--option NAME=VALUE`): each method's config
class (`registry.Method.config`) holds its own fields, which the flag sets without a flag per method;
the config refuses, by name, an option it does not have. A method whose drafter names a `backbone` (the
method of a trained drafter that is its frozen part) takes that drafter's options from `--backbone`."""

from __future__ import annotations

import argparse
import dataclasses
import json

from flax import nnx

from clover_jax.errors import CloverError
from clover_jax.training import drafter_config, load_heads, registry


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


def backbone_drafter(args, base):
    """(drafter, the paths of its frozen parameters) for --backbone DIR: a fresh drafter of args.method
    with the options of DIR's drafter (of the method its class names as `backbone`) and every parameter
    that drafter has copied from it; the rest (the correction) is what trains. One line where DIR holds
    another method's drafter, or one whose parameters this one lacks or shapes otherwise."""
    method, flag = registry.get(args.method), f"--backbone {args.backbone}"
    wanted = getattr(method.drafter, "backbone", None)
    if wanted is None:
        have = [registry.title(m) for m in registry.names() if getattr(registry.get(m).drafter, "backbone", None)]
        raise CloverError(f"{flag}: {registry.title(args.method)} has no frozen backbone; drop --backbone (the "
                          f"methods with one: {', '.join(have)})")
    if args.init_from:
        raise CloverError(f"{flag} and --init-from {args.init_from} both say where the drafter starts; give one")
    frozen = load_heads(args.backbone, base)
    if frozen.hcfg.method != wanted:
        raise CloverError(f"{flag} holds a {registry.title(frozen.hcfg.method)} drafter; "
                          f"{registry.title(args.method)} trains on a trained {registry.title(wanted)} one")
    ours = {f.name for f in dataclasses.fields(method.config)}
    inherited = {f.name: getattr(frozen.hcfg, f.name) for f in dataclasses.fields(frozen.hcfg)
                 if f.name in ours and f.name != "method"}
    given = {**({"num_heads": args.num_heads} if args.num_heads else {}), **method_options(args)}
    hcfg = drafter_config(args.method, **{**inherited, **given})
    for name, value in inherited.items():
        if getattr(hcfg, name) != value:
            raise CloverError(f"{flag} fixes {name}={value!r}; drop " + ("--num-heads" if name == "num_heads" else
                                                                        f"--option {name}"))
    drafter = registry.make_drafter(hcfg, base, seed=args.seed)
    theirs = dict(nnx.to_flat_state(nnx.state(frozen, nnx.Param)))
    have = dict(nnx.to_flat_state(nnx.state(drafter, nnx.Param)))
    for path, var in theirs.items():
        if path not in have or have[path][...].shape != var[...].shape:
            name = ".".join(map(str, path))
            raise CloverError(f"{flag}: its {name} {tuple(var[...].shape)} does not fit {registry.title(args.method)}'s "
                              + (f"{tuple(have[path][...].shape)}" if path in have else "drafter (no such parameter)"))
    nnx.update(drafter, nnx.state(frozen, nnx.Param))
    return drafter, frozenset(theirs)
