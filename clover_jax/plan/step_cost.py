"""What a chain step costs on this machine, in plain steps: timed once and kept, so that `--tree auto`
on a CPU decides by this CPU's figure rather than by one fitted on another.

Why: on a CPU each verified row costs compute, and what a chain:1 step costs against a plain one differs
from machine to machine by more than a drafter gains: 1.25-1.35 plain steps on one 2-core EPYC, 1.60-1.69
on another (docs/history/benchmarks.md), where SmolLM2's heads bring 1.3 tokens a step. The fitted model
(`tree.CPU_CHAIN_COST`) picks a chain that loses on the second.

How: plain decoding and unpaced chains through the first head and through every head run on one made-up
prompt at batch 1, each with a short and a long token budget in the same compiled program; a step's time
is the difference of the two runs over the difference of their steps (the prefill cancels), the median
of a few. A chain step's shapes are static, so its cost does not depend on what it accepts. The fit
through the two chains is `tree.ChainCost` (base + per_draft * D). Each figure is kept in
`step-costs.json` in the cache folder (`sources.cache_root`), under the machine (CPU model, cores, JAX
version), the model (fingerprint, dtype), the drafter (kind, heads), its draft vocabulary and whether
it samples; delete the file to time again. $CLOVER_JAX_STEP_COSTS names another file, or is "off": no
timing, the fitted model.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import jax
from flax import nnx

from clover_jax.drafters.base import Drafter
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.engine.decode import Generator
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.io.files import write_text
from clover_jax.io.heads_dir import base_fingerprint
from clover_jax.io.sources import cache_root
from clover_jax.model.llama import Llama
from clover_jax.plan.auto import CPU_CHAIN_COST, ChainCost
from clover_jax.trees.static import chain

COSTS_ENV = "CLOVER_JAX_STEP_COSTS"
COSTS_FILE = "step-costs.json"
# The timed runs: a prompt of PROMPT_LEN made-up tokens, then SHORT and LONG new tokens, REPEATS times.
PROMPT_LEN, SHORT, LONG, REPEATS = 200, 8, 40, 3
# A busy machine can make the long run no slower than the short one (a small model's steps take
# microseconds): the median is taken again, up to ROUNDS times, until it is positive.
ROUNDS = 3


def costs_path() -> Path | None:
    """Where timed costs are kept: $CLOVER_JAX_STEP_COSTS, else step-costs.json in the cache folder;
    None when that variable is "off"."""
    named = os.environ.get(COSTS_ENV)
    if named == "off":
        return None
    return Path(named) if named else cache_root() / COSTS_FILE


def cpu_model() -> str:
    """The CPU's model name (`platform.processor()` says only "x86_64" on Linux)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def machine() -> str:
    """This host as far as a step's cost goes: CPU model, cores, JAX version."""
    return f"{cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}"


def entry_key(model: Llama, drafter: Drafter, vocab: DraftVocab | None, sampling: bool) -> str:
    """What a timed cost is kept under: machine, model, drafter, draft vocabulary, greedy or sampling."""
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))})
    return (f"{machine()} | model {base_fingerprint(model)} {'+'.join(dtypes)} | {type(drafter).__name__} "
            f"{drafter.num_heads} heads, drafting from {'all' if vocab is None else vocab.size} tokens | "
            f"{'sampling' if sampling else 'greedy'}")


def seconds_per_step(generator: Generator, sampling: SamplingConfig) -> float:
    """A decoding step's time, prefill excluded: (long run - short run) / (their step difference)."""
    cfg = generator.cfg
    length = min(PROMPT_LEN, cfg.max_position_embeddings // 2)  # a small model's context may hold less
    budget = min(LONG, cfg.max_position_embeddings - length)
    prompt = [[(7 + 31 * i) % cfg.vocab_size for i in range(length)]]
    for _ in range(ROUNDS):
        times = []
        for _ in range(REPEATS):
            short, long = [generator.generate(prompt, budget, sampling, eos_ids=(), budgets=[n]) for n in (SHORT, budget)]
            times.append((long.run_seconds - short.run_seconds) / max(long.steps - short.steps, 1))
        step = statistics.median(times)
        if step > 0:
            break
    return step  # <= 0 after every round: the machine's noise outweighed the steps


def measure(model: Llama, drafter: Drafter, vocab: DraftVocab | None, sampling: bool, mesh=None) -> dict | None:
    """Time plain steps and chain steps through the first head and through every head (one compile each):
    their costs in plain steps and the `ChainCost` fit through them; None where a step's time did not
    come out positive."""
    config = SamplingConfig(temperature=1.0 if sampling else 0.0)
    plain = seconds_per_step(Generator(model, mesh=mesh), config)
    if plain <= 0:
        return None
    depths = sorted({1, drafter.num_heads})
    steps = {d: seconds_per_step(SpeculativeGenerator(model, drafter, chain(d), draft_vocab=vocab, mesh=mesh),
                                 config) / plain for d in depths}
    if min(steps.values()) <= 0:
        return None
    first, last = depths[0], depths[-1]
    # Heads of one draft have one depth to time: the increment per draft is then the fitted model's.
    per_draft = max((steps[last] - steps[first]) / (last - first), 0.0) if last > first else CPU_CHAIN_COST.per_draft
    return {"plain_ms": round(plain * 1e3, 3), "chain": {str(d): round(c, 4) for d, c in steps.items()},
            "base": round(steps[first] - per_draft * first, 4), "per_draft": round(per_draft, 4)}


def usable(entry) -> bool:
    """Whether a kept entry holds a chain cost: a positive `base` and a `per_draft` >= 0, as finite numbers.
    Any other (a hand edit, a damaged file, another version's) is timed again and replaced, as a missing one."""
    if not isinstance(entry, dict):
        return False
    base, per_draft = entry.get("base"), entry.get("per_draft")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (base, per_draft))
    return numbers and base > 0 and per_draft >= 0


def chain_cost(model: Llama, drafter: Drafter, vocab: DraftVocab | None, sampling: bool,
               mesh=None) -> ChainCost | None:
    """This machine's chain step cost for `drafter` on `model` (`vocab`, greedy or `sampling`), timed
    the first time and kept (`costs_path`); None on an accelerator (trees cost about one plain step
    there), where timing is off, or where it came out unusable (the fitted model decides then)."""
    path = costs_path()
    if path is None or jax.default_backend() != "cpu":
        return None
    key = entry_key(model, drafter, vocab, sampling)
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = {}
    if not isinstance(kept, dict):
        kept = {}
    entry = kept.get(key)
    if not usable(entry):
        print(f"timing a plain step and chain steps on this CPU, once (kept in {path}) ...", file=sys.stderr, flush=True)
        entry = measure(model, drafter, vocab, sampling, mesh)
        if entry is None:
            print("the timing came out unusable (is the machine busy?): the fitted cost is used, and the step is "
                  "timed again next time", file=sys.stderr, flush=True)
            return None
        kept[key] = entry
        try:
            write_text(path, json.dumps(kept, indent=1) + "\n")
        except OSError as e:
            print(f"could not keep the timed step cost in {path} ({e}); it will be timed again", file=sys.stderr)
        print(f"a chain:D step here costs {entry['base']:.2f} + {entry['per_draft']:.2f} D plain steps "
              f"({entry['plain_ms']:.3g} ms a plain step)", file=sys.stderr, flush=True)
    return ChainCost(float(entry["base"]), float(entry["per_draft"]))
