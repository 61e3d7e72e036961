"""How a tool runs and fails: one `error:` line and status 2 for a user error, 130 for Ctrl-C, 141 for a
closed pipe; output folders, output files and plot formats checked up front by writing there; seed and
count flags checked as they are parsed; comma-separated number flags; batches.
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import re
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Sequence

from clover_jax.errors import CloverError

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C, as a shell reports one
CLOSED_PIPE = 141  # the exit status of a writer whose reader went (`| head`), as a shell reports SIGPIPE
SEEDS = 2 ** 32  # a JAX random key holds 32 bits of a seed: 2**32 would draw what 0 draws
# The flags not named after their argument (`Generator.generate(on_tokens=)` is --stream); any other
# argument `name_x` is the flag `--name-x`.
FLAGS = {"on_tokens": "--stream"}


def _probe(folder: Path, flag: str, path) -> None:
    """Create and remove a file in `folder`, the one test of writing there that holds everywhere:
    `os.access` says yes to root under /proc, or on a file system mounted read-only."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".clover-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CloverError(f"{flag} {path}: cannot write into {folder} ({e.strerror}); pick a writable path") from None


def check_output_dir(path: str | Path, flag: str, given: str | Path | None = None) -> None:
    """Refuse, in one line, a folder that a tool could not create or write into, at the start of its run
    rather than at the end of hours of work. A file is created and removed to find out (in the nearest
    folder that exists); nothing else is created, so a run that fails later leaves no empty folder behind.
    `given`: the flag's value when `path` is the folder of a file it names (`check_output_file`)."""
    out = Path(path).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise CloverError(f"{flag}: cannot create the folder {path}: {existing} is a file; pick another path")
    _probe(existing, flag, path if given is None else given)


def check_output_file(path: str | Path, flag: str) -> None:
    """Refuse, in one line and before any work, a file path a tool could not write at its end: a folder,
    or a file whose folder cannot be made or written into (the file is written there under a temporary
    name and renamed, `clover_jax.io.files`, so the folder's right to write is what counts)."""
    if Path(path).is_dir():
        raise CloverError(f"{flag} {path} is a folder; give a file path")
    check_output_dir(Path(path).absolute().parent, flag, path)


def seed(text: str) -> int:
    """An argparse type for --seed: a whole number in [0, 2**32), the seeds a JAX random key tells apart."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < SEEDS:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..{SEEDS - 1}, the seeds a JAX random key holds")
    return value


def check_seeds(first: int, count: int, flag: str = "--seed") -> None:
    """Refuse, before any work, a run whose `count` seeds first, first + 1, ... (its batches') would pass
    the largest seed a JAX random key holds, rather than failing at the batch that does."""
    if first + count - 1 >= SEEDS:
        raise CloverError(f"{flag} {first}: this run's {count} batches take seeds {first} to {first + count - 1}, "
                          f"past {SEEDS - 1}, the largest a JAX random key holds; give {flag} at most "
                          f"{SEEDS - count}")


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type for a whole-number flag that must be >= `least`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
        return value

    parse.__name__ = f"whole number >= {least}"  # what argparse calls the type in its messages
    return parse


class _CtrlC:
    """The SIGINT handler `run_main` installs: a KeyboardInterrupt raised where Python would only print
    "Exception ignored" and go on (a gc callback, such as JAX's over its compiled programs, or a
    `__del__`) is not raised there but delivered again a moment later, so a Ctrl-C always stops the run;
    `pressed` stays set, so a KeyboardInterrupt that some code caught still ends the run with 130."""

    RETRY_S = 0.05

    def __init__(self):
        self.pressed = False
        self.active = True
        self.timer: threading.Timer | None = None

    @staticmethod
    def unsafe(frame) -> bool:
        callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
        while frame is not None:
            if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
                return True
            frame = frame.f_back
        return False

    def again(self) -> None:
        if self.active:
            os.kill(os.getpid(), signal.SIGINT)

    def __call__(self, signum, frame):
        self.pressed = True
        if self.unsafe(frame):
            self.timer = threading.Timer(self.RETRY_S, self.again)
            self.timer.daemon = True
            self.timer.start()
            return
        raise KeyboardInterrupt

    def close(self) -> None:
        self.active = False
        if self.timer is not None:
            self.timer.cancel()


def _install_ctrl_c() -> tuple[_CtrlC | None, object]:
    """(the handler, the one it replaced); no handler off the main thread, where signals cannot be
    caught, or where SIGINT is ignored (a background job, nohup), which it stays."""
    if threading.current_thread() is not threading.main_thread():
        return None, None
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        return None, None
    handler = _CtrlC()
    signal.signal(signal.SIGINT, handler)
    return handler, before


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the file the user asked for, not its `.tmp` stand-in
    (`files.atomic_path`); a full disk says so, and where."""
    message = " ".join(str(e).split("\n"))
    name = None if e.filename is None else str(e.filename)
    if name and name.endswith(".tmp"):
        message = message.replace(name, name[: -len(".tmp")])
        name = name[: -len(".tmp")]
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        if name:
            return (f"no space left on {Path(name).absolute().parent} (writing {name}); free some space there "
                    "or write elsewhere")
        return "no space left on the disk being written to; free some space or write elsewhere"
    return message


def flag_message(e: CloverError) -> str:
    """A `CloverError`'s line as a tool's user reads it: each argument the message names
    (`e.arguments`) as its flag, `name=value` as `--name value`, `name=True` and a bare `name=` as
    `--name`; the library's messages speak of arguments (`clover_jax.errors`)."""
    message = " ".join(str(e).split("\n"))
    for name in e.arguments:
        flag = FLAGS.get(name, "--" + name.replace("_", "-"))
        # group 1: "True", "" before a value, None before a space, a mark or the end
        pattern = rf"(?<![\w.-]){re.escape(name)}=(True\b|(?=[^\s,;:)]))?"
        message = re.sub(pattern, lambda m: flag + (" " if m.group(1) == "" else ""), message)
    return message


def run_main(body: Callable[[], int]) -> int:
    """Run a tool's body; a user error prints one `error:` line on stderr and returns 2, Ctrl-C one
    `interrupted` line (no traceback) and returns 130 (`_CtrlC`: always, wherever it lands), and a
    reader gone from stdout (`| head`) ends the run quietly with 141, as a Unix tool killed by SIGPIPE.
    What the tools write is written whole or not at all (`clover_jax.io.files`), so an interrupted run
    leaves no half-written file. `exit` ends the process after it."""
    handler, before = _install_ctrl_c()
    try:
        code = body()
        if handler is not None and handler.pressed:  # a KeyboardInterrupt that something caught
            raise KeyboardInterrupt
        return code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # Nothing more can reach the reader; stdout goes to /dev/null so that the flush at exit is quiet too.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # a stdout with no file descriptor of its own (captured)
            pass
        return CLOSED_PIPE
    except CloverError as e:
        print(f"error: {flag_message(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that vanished or cannot be read mid-run, a full disk
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    finally:
        if handler is not None:
            handler.close()
            signal.signal(signal.SIGINT, before)


def exit(code: int) -> None:
    """End a tool's process with `code`. After Ctrl-C or a closed pipe it ends at once (`os._exit`, its
    output flushed first): the interpreter's teardown would otherwise free XLA's objects under work the
    interrupt left in flight, which can crash (SIGSEGV) after the `interrupted` line."""
    if code in (INTERRUPTED, CLOSED_PIPE):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


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
