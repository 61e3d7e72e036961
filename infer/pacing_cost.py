"""Where a paced loop's time goes on this machine.

    python -m infer.pacing_cost --model smollm2 --methods medusa,clover2,eagle3 --tree chain:3

On a CPU, `--tree auto` paces its chain: plain steps while the drafts accepted lately do not pay for a
speculative step, a probe (one speculative step) after 8 plain steps, then after 16, 32 and 64 while the
probes keep failing; what the plain steps commit reaches the drafter in one commit per 8 of them (a
flush). A plain step of that loop should cost what plain decoding's does. Per method, at batch 1 on the
same prompts, each run to the token budget, this times:

- plain decoding's step, timed beside each method: its decoding loop's time (each prompt's prefill timed apart and taken off)
  over its steps;
- the speculative step, drafting at every step (unpaced): what a probe costs;
- the paced loop at a step cost no draft can pay for, so that it takes plain steps and probes only;
  its plain step is what remains once the probes are taken off at the unpaced step's cost;
- one flush on its own (the drafter's commit of 8 plain steps' rows), and how many the loop took;

and splits the paced plain step's time beyond plain decoding's into the flushes and the rest, the
loop's own work (the feature layers each plain step keeps for the drafter, the pending rows, the
nested loops).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax import CloverError, SamplingConfig, load, make_generator
from clover_jax import _cli as cli
from clover_jax.engine.pacing import MAX_WAIT, PROBE_EVERY, Paced
from clover_jax.io.files import write_text

# A step cost no accepted draft reaches (tau would have to be this high): the paced loop only probes.
NEVER_PAYS = 1e6


def loop_seconds(generators: dict, prompts: list[list[int]], max_new: int, sampling: SamplingConfig,
                 repeats: int) -> dict:
    """{name: (median over `repeats` timed passes of the decoding loops' seconds, summed over the
    prompts; per prompt its decoding steps and, of those, the steps that drafted; the last run's
    output)} for each of `generators`. A loop's time is a run of `max_new` tokens less a run of the same
    program with a budget of one token, which is the prefill alone. Each pass takes every generator in
    turn, so that a shared machine's drifting load falls on all alike; the first pass compiles."""
    seconds = {name: [] for name in generators}
    counts = {}
    for _ in range(repeats + 1):
        for name, generator in generators.items():
            total, steps, drafted = 0.0, [], []
            for p in prompts:
                prefill = generator.generate([p], max_new, sampling=sampling, eos_ids=(), budgets=[1]).run_seconds
                out = generator.generate([p], max_new, sampling=sampling, eos_ids=())
                total += out.run_seconds - prefill
                steps.append(out.decode_steps)
                drafted.append(out.drafted_steps)
            seconds[name].append(total)
            counts[name] = (steps, drafted, out)
    return {name: (statistics.median(seconds[name][1:]), *counts[name]) for name in generators}


def flushes(plain_steps: int) -> int:
    """The flushes a paced loop takes over `plain_steps` plain steps when no probe pays: its runs of
    plain steps last PROBE_EVERY, then twice as many after each probe, up to MAX_WAIT; each run is
    flushed every PROBE_EVERY steps and at its end."""
    count, wait = 0, PROBE_EVERY
    while plain_steps > 0:
        run = min(wait, plain_steps)
        count += -(-run // PROBE_EVERY)
        plain_steps -= run
        wait = min(2 * wait, MAX_WAIT)
    return count


def flush_seconds(generator, state, repeats: int = 20) -> float:
    """The median time of one flush on its own: the drafter's commit of PROBE_EVERY rows, those a paced
    run's final state (`state`, consumed) holds pending. Each flush takes the state the last one left
    and updates it in place, as the loop does."""
    def flush(graphdefs, params, s):
        base, drafter = nnx.merge(graphdefs.base, params.base), nnx.merge(graphdefs.drafter, params.drafter)
        paced = Paced(NEVER_PAYS, base, drafter, sampling=SamplingConfig(), cache_len=0)
        return paced.flush(s.replace(pace=s.pace.replace(pending_n=jnp.full_like(s.pace.pending_n, PROBE_EVERY))))

    program = jax.jit(flush, static_argnums=0, donate_argnums=2)
    state = jax.block_until_ready(program(generator.graphdef, generator.params, state))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(program(generator.graphdef, generator.params, state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model, method: str, tree: str, prompts, max_new: int, sampling: SamplingConfig, repeats: int) -> dict:
    """One method's figures (the module docstring), in milliseconds, plain decoding timed beside it."""
    drafter = model.drafter(method)
    build = lambda cost: make_generator(model.module, method, drafter=drafter, tree=tree, greedy=sampling.greedy,
                                        step_cost=cost)
    timed = loop_seconds({"plain": make_generator(model.module, None), "unpaced": build(None),
                          "paced": build(NEVER_PAYS)}, prompts, max_new, sampling, repeats)
    plain_s, plain_n, _, _ = timed["plain"]
    plain_ms = 1e3 * plain_s / sum(plain_n)
    unpaced_s, unpaced_n, _, _ = timed["unpaced"]
    spec_ms = 1e3 * unpaced_s / max(sum(unpaced_n), 1)
    paced_s, steps, drafted, out = timed["paced"]
    plain = [n - d for n, d in zip(steps, drafted)]
    plain_steps, probes = sum(plain), sum(drafted)
    if plain_steps < 1:
        raise CloverError(f"{method}: the paced loop took no plain step; raise --max-new-tokens")
    paced_plain_ms = (1e3 * paced_s - probes * spec_ms) / plain_steps
    flush_ms = 1e3 * flush_seconds(build(NEVER_PAYS), out.state)
    per_step_flush = flush_ms * sum(map(flushes, plain)) / plain_steps
    return dict(method=method, tree=tree, plain_step_ms=plain_ms, speculative_step_ms=spec_ms,
                probe_plain_steps=spec_ms / plain_ms, paced_plain_step_ms=paced_plain_ms,
                over_plain=paced_plain_ms / plain_ms - 1, flush_ms=flush_ms, flush_per_plain_step_ms=per_step_flush,
                loop_overhead_ms=paced_plain_ms - plain_ms - per_step_flush, probes=probes, plain_steps=plain_steps)


def table(rows: list[dict]) -> str:
    lines = ["| method | tree | plain step ms | probe ms (plain steps) | paced plain step ms (vs plain) | "
             "flush ms (per plain step) | loop's own ms | probes / plain steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['tree']} | {r['plain_step_ms']:.3f} | {r['speculative_step_ms']:.3f} "
                     f"({r['probe_plain_steps']:.2f}) | {r['paced_plain_step_ms']:.3f} ({r['over_plain']:+.1%}) | "
                     f"{r['flush_ms']:.3f} ({r['flush_per_plain_step_ms']:.3f}) | {r['loop_overhead_ms']:+.3f} | "
                     f"{r['probes']} / {r['plain_steps']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.pacing_cost", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model", help="a checkpoint directory, .gguf file, Hub id or named model (default: the "
                                   "shipped reference model)")
    p.add_argument("--methods", default="medusa,clover2,eagle3",
                   help="comma-separated draft methods whose shipped heads to time (default: %(default)s)")
    p.add_argument("--tree", default="chain:3",
                   help="the tree each method drafts when it drafts, a --tree spec (default: %(default)s)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL or text prompts (default: the model's own, as "
                                                     "infer.benchmark reads them)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts timed, the first of the file (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens each prompt runs to (no EOS stops it; default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes after the compiling one; their median "
                                                          "counts (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to this JSON file")
    return p


def _main(args: argparse.Namespace) -> int:
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--repeats", args.repeats)):
        if value < 1:
            raise CloverError(f"{flag} {value} must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise CloverError("--methods names no method; give one or more, comma-separated")
    sampling = SamplingConfig(temperature=args.temperature)
    model = load(args.model)
    texts = cli.read_prompts(args.prompts or cli.default_prompts(args.model, model.path))[: args.num_prompts]
    prompts = [model.encode(t) for t in texts]
    rows = [measure(model, m, args.tree, prompts, args.max_new_tokens, sampling, args.repeats) for m in methods]
    print(table(rows))
    if args.json:
        record = dict(backend=jax.default_backend(), temperature=args.temperature,
                      prompts=len(prompts), max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      command="python -m infer.pacing_cost " + " ".join(sys.argv[1:]), rows=rows)
        write_text(args.json, json.dumps(record, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _main(args))


if __name__ == "__main__":
    cli.exit(main())
