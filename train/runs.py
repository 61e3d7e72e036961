"""What the training commands share about a run directory: its pinned shape, resume, and metrics.

A run directory remembers the settings that fix the shapes of what it checkpoints (model or head
dimensions, method); resuming with different ones is refused with one line, rather than failing deep
inside orbax or, worse, silently training something else.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from shutil import disk_usage
from typing import Iterator

import orbax.checkpoint as ocp

from clover_jax.errors import CloverError
from clover_jax.io.files import write_text

RUN_FILE = "run.json"


def pin_run(work: Path, fields: dict) -> None:
    """Record `fields` in work/run.json on the first start; on a later start, refuse any difference."""
    path = work / RUN_FILE
    if path.is_file():
        pinned = json.loads(path.read_text())
        for key, value in fields.items():
            if key in pinned and pinned[key] != value:
                raise CloverError(f"{work} was started with {key}={pinned[key]!r}, not {value!r}; "
                                  "resume with the same settings or use another work directory")
        return
    work.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(fields, indent=2) + "\n")


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[threading.Event]:
    """Within the block, the first Ctrl-C (SIGINT) only sets the event it yields: the training loop
    finishes the step in progress, checkpoints it and stops, so no finished step is lost (a second
    Ctrl-C interrupts at once). Off the main thread, where signals cannot be caught, or where SIGINT
    is ignored (a background job, nohup), the event stays unset and SIGINT acts as before."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield stop
        return

    def request(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\ninterrupted: stopping after this step to checkpoint it (Ctrl-C again to quit now)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, request)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_due(done: int, args, started: float, interrupt: threading.Event) -> bool:
    """Whether a run stops cleanly after step `done`, short of its last: --stop-after reached, its
    --max-minutes since `started` spent, or Ctrl-C (`stop_on_interrupt`)."""
    out_of_time = args.max_minutes and time.time() - started > args.max_minutes * 60
    return bool(out_of_time or done == args.stop_after or interrupt.is_set()) and done < args.steps


def restore_latest(manager: ocp.CheckpointManager, state: dict) -> tuple[int, dict]:
    """(step, state) of the newest checkpoint, or (0, state) unchanged when there is none."""
    step = manager.latest_step()
    if step is None:
        return 0, state
    try:
        return step, manager.restore(step, args=ocp.args.StandardRestore(state))
    except ValueError as e:  # orbax: the saved tree's names or shapes differ from `state`'s
        raise CloverError(f"{manager.directory}: the checkpoint of step {step} does not fit this run's parameters "
                          f"({str(e).splitlines()[0]}); it was written by another version of clover-jax, "
                          "so start again in a new work directory") from None


NO_SPACE = ("No space left on device", "RESOURCE_EXHAUSTED")  # how orbax (tensorstore) reports a full disk


def check_checkpoint_space(work: Path, state_bytes: int, keep: int) -> None:
    """Refuse, before training, a --work-dir whose disk cannot hold the run's checkpoints: `keep` of them,
    the best one and the one being written, each `state_bytes` (the drafter and optimizer state),
    less what the run's checkpoints there (a resumed run's) take already."""
    existing = next(p for p in (work, *work.parents) if p.exists())
    held = sum(f.stat().st_size for d in ("checkpoints", "best") for f in (work / d).rglob("*") if f.is_file())
    need, free = state_bytes * (keep + 2), disk_usage(existing).free
    if free + held < need:
        mb = 1 << 20
        raise CloverError(f"no space left on {existing} for --work-dir {work}: its checkpoints need about "
                          f"{-(-need // mb)} MB ({keep} kept, the best and the one being written, "
                          f"{-(-state_bytes // mb)} MB each) and {free // mb} MB are free; free some space, "
                          "lower --keep or give another --work-dir")


class _QuietNoSpace(logging.Filter):
    """Drops orbax's report of a full disk (one traceback per array written, hundreds): `no_space_in`
    says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not any(s in text for s in NO_SPACE)


_quiet = _QuietNoSpace()


@contextlib.contextmanager
def no_space_in(work: Path, step: int | None = None, managers: tuple = ()) -> Iterator[None]:
    """Within the block, a full disk under orbax's checkpointing (its ValueError naming RESOURCE_EXHAUSTED,
    or an OSError ENOSPC) is one `CloverError` line naming --work-dir; the checkpoints saved before stay
    whole (orbax commits one by a rename; those still in flight in `managers` are let finish first).
    Orbax's own logging of it, from its writer threads, is muted from the first call on."""
    logging.getLogger("absl").addFilter(_quiet)  # a second add of the same filter is a no-op
    try:
        yield
    except (OSError, ValueError) as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT) if isinstance(e, OSError) else any(s in str(e) for s in NO_SPACE)
        if not full:
            raise
        for manager in managers:
            with contextlib.suppress(Exception):  # this one's failure is the one reported
                manager.wait_until_finished()
        at = "" if step is None else f" at step {step}"
        raise CloverError(f"no space left on {work} (--work-dir) for a checkpoint{at}; free some space there and "
                          "rerun with --resume (the checkpoints before it are whole), or give another --work-dir"
                          ) from None


class MetricsLog:
    """Append-only metrics.jsonl: one JSON object per record, flushed at once so a kill loses nothing."""

    def __init__(self, path: Path):
        self.file = path.open("a")

    def record(self, step: int, **values) -> None:
        self.file.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self.file.flush()
