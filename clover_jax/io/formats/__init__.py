"""Drafter checkpoints other projects write, read into (and written out of) our drafters.

A `--heads` directory without our heads.json is recognised from its files: each module here is one
published format and says whether a directory holds it (`matches`), reads it into a drafter of one of
our methods (`load`), and writes one of our drafters out in it (`export`). Recognition goes through
`FORMATS` in order, and what no module claims is one line listing what was looked for.

Each format module has:
- `NAME` (str, what --format and messages call it) and `METHOD` (our registry method it loads as);
- `matches(folder: Path) -> bool`: this directory holds this format (by its config and file names);
- `load(folder: Path, base: Llama) -> Drafter`: the drafter, checked against `base` (hidden size,
  vocabulary, layers); anything the engine does not implement is refused in one line naming it;
- `export(drafter, base: Llama, out: Path) -> Path`: the drafter written as that format's own loader
  expects (names, config keys, offsets), all files replaced together (`files.replace_together`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from clover_jax.errors import CloverError

# Module names under clover_jax.io.formats, in the order recognition tries them: the DFlash authors'
# DFlash and DFlash 2 drafters and SpecForge's DSpark and Domino (first: a one-layer one holds fc.weight
# as EAGLE-1's does), vLLM's speculators EAGLE-3, SpecForge/SGLang's and the EAGLE authors' EAGLE-3, Medusa-1 heads, EAGLE-1.
FORMATS = ("dflash", "dflash2", "specforge_dspark", "specforge_domino", "speculators_eagle3", "sglang_eagle3", "medusa1", "eagle1")


def module(name: str) -> ModuleType:
    """The format module `name` (a FORMATS entry)."""
    return importlib.import_module(f"{__name__}.{name}")


def formats() -> list[ModuleType]:
    return [module(name) for name in FORMATS]


def recognise(folder: str | Path) -> ModuleType | None:
    """The format module whose format `folder` holds, or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    return next((m for m in formats() if m.matches(folder)), None)


def load_drafter(folder: str | Path, base, method: str | None = None):
    """The drafter in `folder`, written in a published format, for `base`; `method` (when given) must be
    the one the format loads as."""
    fmt = recognise(folder)
    if fmt is None:
        raise CloverError(f"{folder}: neither our heads (heads.json) nor a drafter format we read "
                          f"({', '.join(m.NAME for m in formats())}); give a directory of one of those")
    if method is not None and fmt.METHOD != method:
        raise CloverError(f"{folder}: holds a {fmt.NAME} drafter, which runs as method={fmt.METHOD}, not {method}",
                          arguments=("method",))
    return fmt.load(Path(folder), base)


def exporter(name: str) -> ModuleType:
    """The format module a `--format` value names (its NAME), or one line listing them."""
    for m in formats():
        if m.NAME == name:
            return m
    raise CloverError(f"unknown drafter format {name!r}; choose one of {', '.join(m.NAME for m in formats())}")
