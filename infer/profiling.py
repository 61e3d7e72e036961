"""`--profile`: trace one generation with jax.profiler and rank its operations by time per step, each
named by its result shape and the JAX operation it came from (read from the compiled program's HLO)."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import jax

from clover_jax import CloverError, Generator, SamplingConfig


def profile_folder(name: str) -> str:
    """A row name as one folder name: a tree given as a file path must not nest folders."""
    return re.sub(r"[^\w.=,-]+", "_", name)


def hlo_sources(text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (result shape, what it computes) in optimized HLO text, so a profile can say
    what `ynn_fusion.25` is: the JAX operation it came from (its op_name) or, where the compiler kept
    none, that of the computation it calls, else the opcode at that computation's root (or its own).
    Names repeat across programs; the first program's is kept."""
    named: dict[str, str] = {}  # computation -> first op_name in its body
    roots: dict[str, str] = {}  # computation -> its root's opcode
    current = None
    instructions = []
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.-]+) \(", line)
        if head:
            current = head.group(1)
            continue
        inst = re.match(r"^\s+(ROOT )?%?([\w.-]+) = (\([^=]*?\)|\S+) ([\w-]+)\(", line)
        if not inst:
            continue
        source = re.search(r'op_name="([^"]*)"', line)
        if source and current:
            named.setdefault(current, source.group(1))
        if inst.group(1) and current:
            roots[current] = inst.group(4)
        called = re.search(r"calls=%?([\w.-]+)", line)
        instructions.append((inst.group(2), inst.group(3), inst.group(4), source.group(1) if source else None,
                             called.group(1) if called else None))
    out: dict[str, tuple[str, str]] = {}
    for name, shape, opcode, source, called in instructions:
        source = source or named.get(called) or roots.get(called, opcode)
        source = re.sub(r"^jit\([^)]*\)/", "", source).replace("while/body/", "").replace("while/cond/", "")
        out.setdefault(name, (re.sub(r"\{[^}]*\}", "", shape), source))
    return out


def profile_ops(generator: Generator, group: list[list[int]], max_new: int, sampling: SamplingConfig, seed: int,
                out_dir: Path, top: int = 10, batch_size: int | None = None, eos_ids: tuple[int, ...] = ()) -> list[dict]:
    """Trace one generation of `group` (filled to `batch_size`: an already compiled batch) into `out_dir`
    and rank its operations by time per step (`eos_ids` as the timed runs had them, so that the program
    traced is the one they compiled, not a new one): on an accelerator the device's kernels, on a CPU the events of XLA operations
    (those naming an `hlo_op`), each with its result shape and source (`hlo_sources`): the reading
    behind the profiles in docs/history/benchmarks.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # No Python tracer: its events (every Python call, a retrace's too) filled the trace's million-event
    # buffer before the CPU's XLA operations were recorded, and the ranking was left with a few copies.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True, profiler_options=options):
        out = generator.generate(group, max_new, sampling, seed=seed, eos_ids=eos_ids, batch_size=batch_size)
    traces = sorted(out_dir.glob("**/*perfetto_trace.json.gz"), key=os.path.getmtime)
    if not traces:
        raise CloverError(f"jax.profiler wrote no Perfetto trace under {out_dir}; is the profiler plugin installed?")
    with gzip.open(traces[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in procs.items() if name.startswith("/device:")}
    totals: dict[str, list] = {}  # name -> [calls, microseconds, HLO op]
    containers = ("while", "conditional", "call")  # their time is their body's operations', counted apart
    for e in events:
        if e.get("ph") != "X" or e["name"].split(".")[0] in containers:
            continue
        if e["pid"] in device if device else "hlo_op" in (e.get("args") or {}):
            t = totals.setdefault(e["name"], [0, 0.0, (e.get("args") or {}).get("hlo_op", e["name"])])
            t[0] += 1
            t[1] += float(e.get("dur", 0.0))
    steps = max(out.steps, 1)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    sources = hlo_sources(generator.compiled_hlo())  # a GPU kernel names its HLO op in its args
    return [dict(op=name, shape=sources.get(hlo, ("", ""))[0], source=sources.get(hlo, ("", ""))[1],
                 calls_per_step=calls / steps, us_per_step=us / steps) for name, (calls, us, hlo) in ranked]
