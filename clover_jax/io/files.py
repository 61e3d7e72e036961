"""Files written whole or not at all, sets of files switched together, and a full disk said in one line.

Every file the project writes for a user (checkpoints, heads, data sets, benchmark results, plots,
caches) is written under a temporary name beside its real one and renamed into place, which is
atomic on one file system: a run killed mid-write never leaves a truncated file behind a valid name,
and one that fails leaves no stray temporary either.

Files that only make sense together (draft heads with their config) are renamed in one burst after
all of them are written (`replace_together`), with a marker that says the burst is under way; a run
killed inside it leaves the marker, and readers refuse that folder (`check_whole`) rather than load
new weights under an old config. A whole folder (a dataset) is built beside its place and swapped in
(`replace_dir`), so the old one stays readable until the new one is complete.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Sequence

from clover_jax.errors import CloverError


def sha256(*paths: str | Path) -> str:
    """The sha256 of the files' bytes, one after the other, read in 4 MiB chunks (multi-GB files fit)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


# Called with (source, destination) before every rename this module makes; None in normal runs. Tests
# set it to raise at the Nth rename, which is where a kill leaves a set of files half switched.
rename_hook: Callable[[Path, Path], None] | None = None

SWITCHING = "SWITCHING"  # the marker `replace_together` leaves in a folder while it renames a set


def rename(src: str | Path, dst: str | Path) -> None:
    """`os.replace`, through `rename_hook`."""
    if rename_hook is not None:
        rename_hook(Path(src), Path(dst))
    os.replace(src, dst)


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
        rename(tmp, path)
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


@contextlib.contextmanager
def replace_together(folder: str | Path, names: Sequence[str], remove: Sequence[str] = ()) -> Iterator[dict[str, Path]]:
    """Yields {name: temporary path} for one set of files in `folder` (made if missing). When the block
    ends normally, the temporaries it wrote are renamed into place in the order of `names` (the set's
    config last: it is what readers start from), then the files in `remove` are deleted (files derived
    from the set being replaced, and members the new set lacks). The renames take microseconds, but a
    kill between two of them would mix two sets, so the marker `SWITCHING` stands in the folder while
    they run and stays behind if they do not all happen; `check_whole` refuses such a folder, and the
    next set written into it clears the marker. A block that raises leaves the old set as it was."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmps = {name: temporary_name(folder / name) for name in names}
    marker = folder / SWITCHING
    try:
        yield tmps
        mixed_before = marker.exists()  # an earlier burst was killed: the folder stays marked until one finishes
        write_text(marker, "a set of files is being renamed into place; if this stays, the set is mixed: write it again\n")
        renamed = 0
        try:
            for name in names:
                if tmps[name].exists():
                    rename(tmps[name], folder / name)
                    renamed += 1
            for name in remove:
                (folder / name).unlink(missing_ok=True)
        except BaseException:
            if not renamed and not mixed_before:  # nothing of the old set was touched: it is whole
                marker.unlink(missing_ok=True)
            raise
        marker.unlink()
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def check_whole(folder: str | Path, what: str = "files") -> None:
    """Refuse, in one line, a folder whose set of files `replace_together` did not finish switching."""
    if (Path(folder) / SWITCHING).exists():
        raise CloverError(f"{folder}: writing its {what} was interrupted between renames (it holds {SWITCHING}), "
                          "so they may come from two different runs; write them again")


def _aside(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def recover_dir(path: str | Path) -> None:
    """Finish or undo a `replace_dir` that was killed: the old folder put back if the new one never took
    its place, or removed if it had."""
    path = Path(path)
    aside = _aside(path)
    if aside.is_dir():
        if path.exists():
            shutil.rmtree(aside)
        else:
            rename(aside, path)


def replace_dir(new: str | Path, path: str | Path) -> None:
    """Put the folder `new` in `path`'s place (they must be on one file system), removing what `path`
    held. An empty or missing `path` is replaced by one rename; a full one is first moved aside
    (PATH.old), which `recover_dir` puts back if a kill falls between the two renames."""
    new, path = Path(new), Path(path)
    recover_dir(path)
    if path.is_dir() and any(path.iterdir()):
        rename(path, _aside(path))
        rename(new, path)
        shutil.rmtree(_aside(path))
    else:
        rename(new, path)  # rename(2) replaces an empty folder in one step


def free_bytes(path: str | Path) -> int:
    """Bytes free to this user on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _mb(n: int) -> str:
    n = max(n, 0) / 1e6
    return f"{n:.0f}" if n >= 10 else f"{n:.1f}"


def no_space(folder: str | Path, need: int | None = None, note: str = "") -> CloverError:
    """The one line for a full disk: 'no space left on FOLDER{note}: need about N MB, have M MB', `note`
    saying what for (" for the heads")."""
    needed = f"need about {_mb(need)} MB, " if need is not None else ""
    return CloverError(f"no space left on {folder}{note}: {needed}have {_mb(free_bytes(folder))} MB; "
                       "free some space or write elsewhere")


def check_free_space(folder: str | Path, need: int, note: str = "") -> None:
    """Refuse, before anything is written, a write of about `need` bytes that `folder` has no room for."""
    if need > free_bytes(folder):
        raise no_space(folder, need, note)


def is_no_space(error: BaseException) -> bool:
    """Whether `error` is a full disk (or quota): an OSError with ENOSPC/EDQUOT, or a library's own error
    type (safetensors') carrying the operating system's words for it."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return any(words in text for words in ("No space left on device", "StorageFull", "Disk quota exceeded"))


@contextlib.contextmanager
def space_errors(folder: str | Path, need: int | None = None, note: str = "") -> Iterator[None]:
    """Turn a full disk inside the block into `no_space`'s one line; other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if not is_no_space(e):
            raise
        raise no_space(folder, need, note) from None


def preallocate(path: str | Path) -> None:
    """Give the file at `path` real blocks for its whole length. A file made at its size by seeking
    (as a new memory map is) is sparse, and a full disk then surfaces only when a page of the map is
    written: as SIGBUS, killing the process without a word. Allocated up front, it is ENOSPC here."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def allocated_bytes(path: str | Path) -> int:
    """The bytes a file holds on disk (0 for a missing file): what rewriting it in place needs no more of."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0
