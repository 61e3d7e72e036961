"""`python -m device.check`: the prepared device check, one call of at most 8 minutes on an H100/H200.

    python3 -m device.stage .device-stage/part-3.tar --need check && python3 -m device.check   # on the device
    python -m device.check --dry --out /tmp/check                                               # here, on a CPU

Runs `python -m infer.benchmark` over a plan of runs, most important first: SmolLM2 on MT-Bench (first
and second turns, 256-token answers) with every method on its default (fitted, 64-node) and chain
trees, bfloat16 and exact float32, greedy and T=1, batch 1 and 8; the Llama-3-8B shape with random
weights (step cost per method and tree against plain, plain against the measured bandwidth); the loop
A/B (chunked loop, XLA command buffers). Compiling is most of such a run (16-45 s per SmolLM2 program
on the last lease, against seconds of decoding), so: one prompt bucket (1024 holds MT-Bench's second
turns), JAX's persistent compilation cache in the stage, and a first phase that compiles every run's
programs side by side (`--jobs` processes, each run's warm-up pass alone, into that cache) before the
timed runs load them one after another, alone on the GPU. A run is started only if its estimate fits in
what is left of `--budget-s`; the rest are named as skipped. After every run, OUT holds check.tar.gz
(every JSON, plot and log) and summary.md (each run's tables as `python -m infer.results render` makes
them, and the loop A/B's step times).

`--dry` runs the same plan on the shipped reference model with tiny sizes on this CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

from device.common import Clock, bundle, out_dir, run_jobs, run_one, stage_dir, stage_env, tail

REPO = Path(__file__).resolve().parents[1]
METHODS = ("medusa", "clover", "clover2", "eagle", "eagle3")
# The loop A/B's switches, named in this one place: the benchmark's flag for the chunked loop's K, and
# its switch for XLA's command-buffer (CUDA graph) loops. Where the benchmark lacks the switch, the same
# XLA flag is set through XLA_FLAGS instead; where it lacks the chunk flag, that A/B is skipped.
LOOP_CHUNK_FLAG = "--loop-chunk"
COMMAND_BUFFER_FLAG = "--command-buffer"
COMMAND_BUFFER_XLA = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
LOOP_CHUNKS = (1, 8, 32)


@dataclasses.dataclass
class Run:
    """One benchmark process: its flags (not --json/--plot), extra environment, and the seconds it is
    expected to take once its programs are compiled (what the budget is checked against)."""

    name: str
    args: list[str]
    estimate_s: float
    env: dict = dataclasses.field(default_factory=dict)
    skip: str = ""  # why the run cannot run with this benchmark, if it cannot


def benchmark_flags() -> set[str]:
    from infer.benchmark import build_parser

    return {s for a in build_parser()._actions for s in a.option_strings}


def plan(dry: bool, stage: Path, flags: set[str] | None = None) -> list[Run]:
    """The check's runs, most important first (the targets: bfloat16 batch 1, the 8B shape)."""
    flags = benchmark_flags() if flags is None else flags
    if dry:  # the reference model, its prompts, a few tokens: the same runs in seconds each
        base = ["--methods", "medusa", "--chat", "--turns", "all", "--num-prompts", "1",
                "--max-new-tokens", "4", "--buckets", "128", "--repeats", "0", "--step-cost", "none"]
        trees = ["--tree", "default", "--tree", "chain:2"]
        shape_trees, shape = ["--tree", "chain:2"], ["--shape", "tiny"]
        few, scale = ["--num-prompts", "1"], 0.0
    else:
        heads = stage / "heads"
        base = ["--model", "smollm2", "--heads-root", str(heads), "--chat", "--turns", "all", "--per-task", "2",
                "--max-new-tokens", "256", "--buckets", "1024", "--repeats", "1"]
        trees = ["--tree", "default"] + [a for m in METHODS for a in ("--tree", f"{m}={chain(m)}")]
        # The shipped 64-node trees named by file: the random heads of --shape have no tree.json of their own.
        shape_trees = [a for m in METHODS for a in ("--tree", f"{m}={heads / m / 'tree.json'}")] + \
                      ["--tree", f"clover2={chain('clover2')}"]
        shape, few, scale = ["--shape", "llama3-8b"], ["--per-task", "1"], 1.0

    def run(name, dtype, temps, sizes, extra, estimate, env=None, skip=""):
        args = base + ["--dtype", dtype, "--temperatures", temps, "--batch-sizes", sizes] + extra
        return Run(name, args, estimate * scale, env or {}, skip)

    runs = [run("smollm2-bf16-greedy-b1", "bfloat16", "0", "1", trees, 75),
            run("shape-llama3-8b", "bfloat16", "0", "1", few + shape_trees + shape, 60),
            run("smollm2-f32-greedy-b1", "float32", "0", "1", trees, 80)]
    ab = few + ["--methods", "clover2", "--tree", "default"]
    runs.append(run("loop-base", "bfloat16", "0", "1", ab, 15))
    for k in LOOP_CHUNKS:
        runs.append(run(f"loop-k{k}", "bfloat16", "0", "1", ab + [LOOP_CHUNK_FLAG, str(k)], 15,
                        skip="" if LOOP_CHUNK_FLAG in flags else f"the benchmark has no {LOOP_CHUNK_FLAG} flag yet"))
    if COMMAND_BUFFER_FLAG in flags:
        runs.append(run("loop-cmdbuf", "bfloat16", "0", "1", ab + [COMMAND_BUFFER_FLAG], 15))
    else:
        runs.append(run("loop-cmdbuf", "bfloat16", "0", "1", ab, 15, env={"XLA_FLAGS": COMMAND_BUFFER_XLA}))
    if LOOP_CHUNK_FLAG in flags and COMMAND_BUFFER_FLAG in flags:  # command buffers with each chunk but 1's
        runs += [run(f"loop-cmdbuf-k{k}", "bfloat16", "0", "1", ab + [LOOP_CHUNK_FLAG, str(k), COMMAND_BUFFER_FLAG],
                     15) for k in LOOP_CHUNKS if k != 1]
    runs += [run("smollm2-bf16-sampled-b1", "bfloat16", "1", "1", trees, 80),
             run("smollm2-bf16-b8", "bfloat16", "0,1", "8", trees, 50),
             run("smollm2-f32-sampled-b1", "float32", "1", "1", trees, 85),
             run("smollm2-f32-b8", "float32", "0,1", "8", trees, 55)]
    return runs


def chain(method: str) -> str:
    """The chain through every head of a method's shipped drafter."""
    from clover_jax.drafters import registry

    return f"chain:{registry.get(method).depth}"


def summary(work: Path, runs: list[Run], notes: list[str]) -> str:
    """summary.md: each finished run's tables, the loop A/B's step times beside the base run's."""
    from infer import results

    parts = ["# Device check", "", *notes, ""]
    for r in runs:
        js = work / "json" / f"{r.name}.json"
        if not js.is_file():
            continue
        try:
            if r.name.startswith("loop-") and r.name != "loop-base" and (work / "json" / "loop-base.json").is_file():
                body = results.render_steps(work / "json" / "loop-base.json", js)
            else:
                body = results.render_runs([js])
        except Exception as e:  # a table that cannot be drawn must not lose the others
            body = f"(could not render: {e})"
        parts += [f"## {r.name}", "", body, ""]
    return "\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m device.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="the reference model, tiny sizes, on this machine")
    p.add_argument("--out", help="where the results go (default: $OUT)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds the whole check may take (default: 440; dry 600)")
    p.add_argument("--jobs", type=int, default=None, help="processes compiling side by side (default: 6; dry 2)")
    p.add_argument("--no-precompile", action="store_true", help="skip the phase that compiles side by side")
    p.add_argument("--precompile-share", type=float, default=0.45, help="share of the budget the compile phase may take")
    p.add_argument("--only", help="comma-separated run names to run (default: all, in plan order)")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stage = stage_dir()
    runs = plan(args.dry, stage)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r.name for r in runs}
        if unknown:
            raise SystemExit(f"error: --only: no run named {', '.join(sorted(unknown))}")
        runs = [r for r in runs if r.name in wanted]
    if args.list:
        for r in runs:
            print(f"{r.name} (~{r.estimate_s:.0f} s){' SKIP: ' + r.skip if r.skip else ''}: "
                  f"python -m infer.benchmark {' '.join(r.args)}")
        return 0
    out = out_dir(args.out)
    clock = Clock(args.budget_s or (600.0 if args.dry else 440.0))
    work = out / ".check-work" if args.dry else stage / "check-work"
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("json", "png", "logs", "precompile"):
        (work / sub).mkdir(parents=True)
    env = stage_env(stage) if not args.dry else stage_env(out / ".dry-stage")
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    notes = [f"- device: {smi.stdout.strip() if smi and smi.returncode == 0 else 'no nvidia-smi (CPU)'}"]
    bench = [sys.executable, "-m", "infer.benchmark"]
    todo = [r for r in runs if not r.skip]
    for r in runs:
        if r.skip:
            clock.say(f"{r.name}: skipped: {r.skip}")
            notes.append(f"- {r.name}: skipped: {r.skip}")
    if not args.no_precompile:
        jobs = [(r.name, bench + r.args + ["--repeats", "0"], {**env, **r.env}, work / "precompile" / f"{r.name}.log")
                for r in todo]
        clock.say(f"compiling {len(jobs)} runs' programs into the cache, {args.jobs or (2 if args.dry else 6)} at a time")
        run_jobs(jobs, args.jobs or (2 if args.dry else 6), args.precompile_share * clock.budget_s, clock)
    for r in todo:
        if clock.left() < r.estimate_s + 10:
            clock.say(f"{r.name}: skipped: ~{r.estimate_s:.0f} s needed, {clock.left():.0f} s left")
            notes.append(f"- {r.name}: not run, the budget ran out")
            continue
        log = work / "logs" / f"{r.name}.log"
        argv_ = bench + r.args + ["--json", str(work / "json" / f"{r.name}.json"),
                                  "--plot", str(work / "png" / f"{r.name}.png")]
        code = run_one(r.name, argv_, {**env, **r.env}, log, clock.left() - 8, clock)
        if code != 0:
            notes.append(f"- {r.name}: {'killed at the budget' if code is None else f'exit {code}'}: "
                         + tail(log, 1).replace("\n", " "))
        (work / "plan.json").write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
        (out / "summary.md").write_text(summary(work, runs, notes))
        bundle(work, out, "check")
    (out / "summary.md").write_text(summary(work, runs, notes))
    bundle(work, out, "check")
    first = work / "png" / f"{runs[0].name}.png"
    if first.is_file():
        shutil.copyfile(first, out / first.name)
    clock.say(f"done: {out / 'check.tar.gz'}, {out / 'summary.md'}")
    print((out / "summary.md").read_text()[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
