"""What the lease scripts share: where the stage lives on the device, the environment every command
there runs in, jobs run side by side under a deadline, and the few files that go back in $OUT.

The device tool returns at most 8 files from $OUT, so each script keeps its many JSONs, plots and logs
in a work folder and packs them into one tar.gz (`bundle`) after every step: a call stopped at its
limit still returns what was finished.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

STAGE_ENV = "CLOVER_STAGE"
# /tmp persists while the device machine stays warm between calls (30 s after each), so the parts
# staged by earlier calls are still there for the last one.
DEFAULT_STAGE = "/tmp/clover-stage"


def stage_dir() -> Path:
    """The fixed folder the parts are unpacked into: $CLOVER_STAGE, else /tmp/clover-stage."""
    return Path(os.environ.get(STAGE_ENV) or DEFAULT_STAGE)


def stage_env(stage: Path, base: dict | None = None) -> dict:
    """The environment the tools run in on the device: the project's cache (the staged GGUF, data sets and
    converted model) in the stage, the carried gguf package on the path, JAX's persistent compilation
    cache in the stage (the benchmark has no --compile-cache flag; JAX reads this variable), no
    preallocation of the whole GPU (several processes share it while compiling)."""
    env = dict(os.environ if base is None else base)
    site = str(stage / "site")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    env["CLOVER_JAX_CACHE"] = str(stage / "cache")
    env["CLOVER_JAX_COMPILE_CACHE"] = str(stage / "cache" / "xla")
    env["JAX_COMPILATION_CACHE_DIR"] = str(stage / "cache" / "xla")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Clock:
    """Seconds since the script started, against its budget."""

    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, line: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {line}", flush=True)


def run_jobs(jobs: list[tuple[str, list[str], dict, Path]], parallel: int, deadline_s: float, clock: Clock) -> dict[str, int | None]:
    """Run (name, argv, env, log file) jobs, `parallel` at a time, in the order given; a job still running
    at `deadline_s` on the clock is killed and a job not started by then is left out (None for both).
    Returns each job's exit status."""
    status: dict[str, int | None] = {name: None for name, *_ in jobs}
    waiting = list(jobs)
    running: list[tuple[str, subprocess.Popen, object]] = []
    while waiting or running:
        while waiting and len(running) < parallel and clock.elapsed() < deadline_s:
            name, argv, env, log = waiting.pop(0)
            log.parent.mkdir(parents=True, exist_ok=True)
            f = open(log, "w")
            running.append((name, subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT), f))
        if clock.elapsed() >= deadline_s:
            for name, *_ in waiting:
                clock.say(f"{name}: not started, past the deadline")
            waiting = []
        for item in list(running):
            name, proc, f = item
            code = proc.poll()
            if code is None and clock.elapsed() >= deadline_s:
                proc.kill()
                proc.wait()
                clock.say(f"{name}: killed at the deadline")
                code = None
            elif code is None:
                continue
            else:
                status[name] = code
                clock.say(f"{name}: exit {code}" + ("" if code == 0 else f" (log: {Path(f.name).name})"))
            f.close()
            running.remove(item)
        time.sleep(0.2)
    return status


def run_one(name: str, argv: list[str], env: dict, log: Path, timeout_s: float, clock: Clock) -> int | None:
    """One job alone, its output to `log` and echoed in its last lines; killed after `timeout_s` (None)."""
    return run_jobs([(name, argv, env, log)], 1, clock.elapsed() + max(timeout_s, 1.0), clock)[name]


def tail(path: Path, lines: int = 3) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def bundle(work: Path, out: Path, name: str) -> Path:
    """Everything under `work` as OUT/NAME.tar.gz (one file back from the device), written whole or not
    at all, so an interrupted call never returns half an archive."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{name}.tar.gz"
    partial = out / f".{name}.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(work, arcname=name)
    os.replace(partial, target)
    return target


def out_dir(flag: str | None) -> Path:
    """--out, else $OUT (the device tool's folder of files to return)."""
    folder = flag or os.environ.get("OUT")
    if not folder:
        sys.exit("error: give --out DIR (on the device, $OUT is used)")
    return Path(folder)
