"""How a tool runs and fails: one `error:` line and status 2 for a user error, 130 for Ctrl-C; output
folders and plot formats checked up front; comma-separated number flags; batches.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from clover_jax.errors import CloverError


def check_output_dir(path: str | Path, flag: str) -> None:
    """Refuse, in one line, a folder that a tool could not create or write into, at the start of its run
    rather than at the end of hours of work; nothing is created, so a run that fails later leaves no
    empty folder behind."""
    out = Path(path).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise CloverError(f"{flag}: cannot create the folder {path}: {existing} is a file; pick another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CloverError(f"{flag}: cannot write into {existing}; pick a writable path")


INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C, as a shell reports one


def run_main(body: Callable[[], int]) -> int:
    """Run a tool's body; a user error prints one `error:` line on stderr and returns 2, and Ctrl-C
    one `interrupted` line (no traceback) and returns 130. What the tools write is written whole or
    not at all (`clover_jax.io.files`), so an interrupted run leaves no half-written file."""
    try:
        return body()
    except (CloverError, OSError) as e:  # OSError: a file that vanished or cannot be read mid-run
        message = " ".join(str(e).split("\n"))
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED


def check_plot_format(out: str) -> None:
    """Refuse a --plot suffix matplotlib cannot write (no suffix means PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(out).suffix[1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise CloverError(f"--plot {out}: cannot write a .{suffix} image; end the name in one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")


def batches(items: Sequence, size: int) -> list[Sequence]:
    """`items` in consecutive chunks of at most `size`."""
    if size < 1:
        raise CloverError(f"--batch-size {size} must be >= 1")
    return [items[i:i + size] for i in range(0, len(items), size)]


def numbers(text: str, flag: str, parse, what: str, example: str, least: float) -> list:
    """Comma-separated numbers of a flag, each >= least, or one error line naming the flag."""
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CloverError(f"{flag} {text!r}: expected comma-separated {what} such as {example}") from None
    if not values or any(not v >= least for v in values):
        raise CloverError(f"{flag} {text!r}: give one or more {what} >= {least:g}")
    return values
