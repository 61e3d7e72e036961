"""Files written whole or not at all.

Every file the project writes for a user (checkpoints, heads, data sets, benchmark results, plots,
caches) is written under a temporary name beside its real one and renamed into place, which is
atomic on one file system: a run killed mid-write never leaves a truncated file behind a valid name,
and one that fails leaves no stray temporary either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


def temporary_name(path: str | Path) -> Path:
    """Where `atomic_path` writes `path` before the rename (`NAME.tmp`, in the same folder)."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields the temporary path to write `path` to (its folder made if missing); renames it onto `path`
    when the block ends normally and removes it when the block raises (KeyboardInterrupt included)."""
    tmp = temporary_name(path)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically, in UTF-8."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def copy_file(src: str | Path, dst: str | Path) -> None:
    """Copy `src` to `dst` atomically."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
