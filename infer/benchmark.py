"""Measure every method side by side, in one run: tau, acceptance per depth, tokens/s, speedup over
plain decoding of the same engine, compile counts, plain decoding against the memory-bandwidth limit,
and optionally the Hugging Face `transformers` peer and a 7B/8B-shaped model's step latency.

    python -m infer.benchmark                       # reference model, every method, batch 1 and 8
    python -m infer.benchmark --hf --json bench.json --plot bench.png
    python -m infer.benchmark --shape llama3-8b --batch-sizes 1   # on an accelerator

Every prompt generates exactly --max-new-tokens tokens (EOS is not a stop), so every method does the
same work; greedy outputs are checked against plain decoding's on the way. Times are medians over
--repeats passes over the prompt set, after a warm-up pass that also compiles every bucket; the
methods take their timed passes in turn, round by round, so a shared host's drifting load reaches
them all alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import itertools
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from clover_jax.config import ModelConfig
from clover_jax.convert import load_pretrained
from clover_jax.decode import Generator, GenerationOutput, bucket_for, continue_plain, start_plain, to_host
from clover_jax.draft_vocab import DraftVocab, parse_size, resolve_size
from clover_jax.errors import CloverError
from clover_jax.model import Llama
from clover_jax.sampling import SamplingConfig
from clover_jax.sharding import make_mesh, param_sharding
from infer import cli
from infer.generate import DTYPES, METHODS, make_generator

# Real architectures with random weights: step latency does not depend on the weights' values.
SHAPES = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # The same code path at a size a CPU smoke test can afford.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rope_theta=10000.0),
}

EPILOG = """\
Rows: one per method, tree, draft vocabulary and batch size. vocab = tokens the heads drafted from
(all: the whole vocabulary; see --draft-vocab). tau = tokens per forward pass of the base model (bonus token
included; plain = 1.00); accept@d = share of steps that accepted at least d drafted tokens; speedup =
tokens/s over plain decoding's at the same batch size in this run; compiles = programs compiled over
the prompt set (the bucket count is the most it should be). The bandwidth line divides the bytes a
plain decoding step reads (weights + KV) by its time, the decoding loop timed apart from the prefill,
and compares that with streaming reads the benchmark takes between the prompts of the same passes
(the median over passes of each pass's ratio). With --hf, rows
`hf-generate` (transformers greedy `generate`) and `hf-prompt-lookup` (its assisted generation without
a draft model, batch 1) run the same model and prompts in PyTorch on the CPU.
"""


@dataclasses.dataclass
class Row:
    method: str
    batch_size: int
    tree: str = ""
    temperature: float = 0.0
    draft_vocab: str = ""  # the --draft-vocab value of a speculative row
    draft_vocab_size: int = 0  # tokens the heads drafted from; 0: the whole vocabulary
    tree_nodes: int = 1
    tau: float | None = 1.0  # None for the transformers rows (their steps are not ours to count)
    accept_per_depth: list[float] = dataclasses.field(default_factory=list)
    tokens_per_s: float = 0.0
    speedup: float = 1.0
    step_ms: float = 0.0  # the whole generation's time (prefill included) per forward pass
    steps: int = 0  # forward passes over the prompt set, the prefills included
    new_tokens: int = 0
    compile_s: float = 0.0
    compilations: int = 0
    buckets: int = 0
    matches_plain: bool | None = None

    @property
    def name(self) -> str:
        return label(self.method, self.tree or None, self.temperature, self.draft_vocab)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.benchmark", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: the shipped reference model)")
    p.add_argument("--methods", default=",".join(METHODS), metavar="LIST",
                   help="comma-separated methods to measure (default: %(default)s); plain is always measured")
    p.add_argument("--heads-root", metavar="DIR",
                   help="directory holding one heads directory per method (default: MODEL/heads)")
    p.add_argument("--tree", action="append", default=[], metavar="[METHOD=]SPEC",
                   help="draft tree for every speculative method, or METHOD=SPEC for one; repeat it to measure "
                        "several trees in the same run. SPEC: default (the method's own), auto (a chain through "
                        "every head on a CPU, the default tree elsewhere), chain:K, widths:4,2,2, full:WxD, a "
                        "named tree, a JSON file of paths, or a dynamic tree dynamic:N / eagle2:N "
                        "(default: each method's default tree)")
    p.add_argument("--draft-vocab", default="auto", metavar="LIST",
                   help="comma-separated draft vocabularies to measure every speculative method with: N (the N "
                        "most frequent tokens of the heads' training data), 0 (the whole vocabulary) or auto "
                        "(99.9%% of those tokens when greedy, the whole vocabulary when sampling); with --shape, "
                        "N drafts from N tokens of the random model and auto from all (default: %(default)s)")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL prompts, one {\"prompt\": ...} per line (default: MODEL/prompts.jsonl)")
    p.add_argument("--num-prompts", type=int, default=24, metavar="N", help="first N prompts of the file (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,8", metavar="LIST", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, metavar="N", help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--temperatures", default="0", metavar="LIST",
                   help="comma-separated sampling temperatures, 0 = greedy (default: %(default)s); speculative "
                        "sampling is lossless, so tau at 1 against 0 shows what sampling costs the drafts")
    p.add_argument("--repeats", type=int, default=3, metavar="R", help="timed passes over the prompts; medians are reported (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of weights and activations (default: %(default)s)")
    p.add_argument("--hf", action="store_true", help="also run Hugging Face transformers generate (PyTorch) on the same model and prompts")
    p.add_argument("--shape", choices=tuple(SHAPES),
                   help="also time plain and speculative steps of this architecture with random weights (bfloat16; "
                        "meant for an accelerator) and project speedup = tau (reference model) x plain step / spec step")
    p.add_argument("--shape-layers", type=int, metavar="L", help="with --shape: keep only the first L layers (a quicker, smaller run)")
    p.add_argument("--mesh", metavar="SPEC", help="shard the engine over devices, e.g. data=2,model=4 (default: one device)")
    p.add_argument("--profile", metavar="DIR",
                   help="also trace one batch of each method (first batch size and temperature) with jax.profiler "
                        "into DIR/<method> (Perfetto traces, for ui.perfetto.dev or TensorBoard) and report each "
                        "method's most costly operations per step (kernels on an accelerator, XLA ops on a CPU), "
                        "each with its result shape and the JAX operation it came from")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG: speedup and tau per method, acceptance per depth")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of random heads and random --shape weights (default: %(default)s)")
    return p


def _numbers(text: str, flag: str, parse, what: str, example: str, least: float) -> list:
    """Comma-separated numbers of a flag, each >= least, or one error line naming the flag."""
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CloverError(f"{flag} {text!r}: expected comma-separated {what} such as {example}") from None
    if not values or any(not v >= least for v in values):
        raise CloverError(f"{flag} {text!r}: give one or more {what} >= {least:g}")
    return values


def _configs(specs: list[str], methods: list[str]) -> list[tuple[str, str | None]]:
    """(method, tree spec) pairs to measure: plain once, each speculative method once per tree given for
    it (`SPEC` applies to every method, `METHOD=SPEC` to one; `default` or none: the method's own)."""
    trees: dict[str, list[str | None]] = {m: [] for m in methods if m != "plain"}
    for spec in specs:
        method, sep, tree = spec.partition("=")
        if not (sep and method in METHODS):  # a tree for every method (a JSON or path may hold '=')
            method, tree = None, spec
        if method == "plain":
            raise CloverError("--tree plain=...: plain decoding has no tree")
        for m in [method] if method else trees:
            if m in trees:
                trees[m].append(None if tree == "default" else tree)
    return [("plain", None)] + [(m, t) for m, ts in trees.items() for t in (list(dict.fromkeys(ts)) or [None])]


def label(method: str, tree: str | None, temperature: float = 0.0, draft_vocab: str | None = None) -> str:
    """A row's name: the method, for a speculative one its tree and a draft vocabulary other than auto,
    and a temperature other than 0."""
    name = method if method == "plain" or method.startswith("hf-") else f"{method} {tree or 'default'}"
    if draft_vocab and draft_vocab != "auto":
        name += f" dv={draft_vocab}"
    return name if not temperature else f"{name} T={temperature:g}"


# ------------------------------------------------------------------------------------------ measuring

class BandwidthProbe:
    """The device's streaming-read bandwidth: a jitted sum over an array far larger than any cache. 256 MB
    on a CPU; 4 GB on an accelerator, whose TB/s would otherwise read 256 MB in less time than a dispatch
    takes. The array lives as long as the probe: keep one only while reading (an accelerator's memory
    is needed for the models)."""

    def __init__(self, megabytes: int | None = None):
        if megabytes is None:
            megabytes = 256 if jax.devices()[0].platform == "cpu" else 4096
        self.x = jnp.ones((megabytes << 18,), jnp.float32)
        self.total = jax.jit(jnp.sum)
        jax.block_until_ready(self.total(self.x))

    def read(self) -> float:
        """One timed read, in bytes/s."""
        t0 = time.perf_counter()
        jax.block_until_ready(self.total(self.x))
        return self.x.nbytes / (time.perf_counter() - t0)

    def median(self, repeats: int = 7) -> float:
        """The median of `repeats` reads, in bytes/s."""
        return statistics.median(self.read() for _ in range(repeats))


def _padded_batches(prompts: list[list[int]], size: int):
    """Batches of exactly `size` (the last padded with budget-0 copies, so one program serves them all)."""
    for start in range(0, len(prompts), size):
        group = prompts[start:start + size]
        real = len(group)
        yield group + [group[0]] * (size - real), real


def engine_pass(generator: Generator, prompts: list[list[int]], batch_size: int, max_new: int,
                sampling: SamplingConfig, seed: int, progress) -> list[tuple[GenerationOutput, int]]:
    """One pass over the prompts in batches: each batch's output and how many of its rows are real."""
    outs = []
    for k, (group, real) in enumerate(_padded_batches(prompts, batch_size)):
        outs.append((generator.generate(group, max_new, sampling, seed=seed + k, eos_ids=(),
                                        budgets=[max_new] * real + [0] * (len(group) - real)), real))
        progress.update(1)
    return outs


def run_engines(generators: dict[str, Generator], prompts: list[list[int]], batch_size: int, max_new: int,
                repeats: int, progress, sampling: SamplingConfig = SamplingConfig(),
                seed: int = 0) -> dict[str, tuple[dict, list[list[int]]]]:
    """Statistics and tokens per generator: a warm-up pass of each (compiling every bucket; tokens and
    acceptance come from it), then `repeats` rounds in which each generator makes one timed pass in
    turn. A shared host's load drifts over a run; taking the generators in turn within every round
    exposes them all to the same drift, so the ratios between them hold when the absolute rates move."""
    warm = {}
    for name, gen in generators.items():
        progress.set_postfix_str(f"{name}, batch {batch_size}, T={sampling.temperature:g}, warm-up")
        warm[name] = engine_pass(gen, prompts, batch_size, max_new, sampling, seed, progress)
    seconds: dict[str, list[float]] = {name: [] for name in generators}
    for rep in range(repeats):
        progress.set_postfix_str(f"batch {batch_size}, T={sampling.temperature:g}, timed round {rep + 1}/{repeats}")
        for name, gen in generators.items():
            outs = engine_pass(gen, prompts, batch_size, max_new, sampling, seed, progress)
            seconds[name].append(sum(out.run_seconds for out, _ in outs))
    results = {}
    for name, gen in generators.items():
        outs = warm[name]
        tokens = [t for out, real in outs for t in out.tokens[:real]]
        steps = sum(out.steps for out, _ in outs)
        seq_steps = sum(sum(out.sequence_steps[:real]) for out, real in outs)
        hists = [out.accept_hist[:real].sum(0) for out, real in outs if out.accept_hist is not None]
        hist = sum(hists) if hists else None
        new = sum(len(t) for t in tokens)
        run_s = statistics.median(seconds[name])
        accept = [] if hist is None else [float(hist[d:].sum() / max(hist.sum(), 1)) for d in range(1, len(hist))]
        stats = dict(tau=new / max(seq_steps, 1), accept_per_depth=accept, tokens_per_s=new / run_s,
                     step_ms=1e3 * run_s / max(steps, 1), steps=steps, new_tokens=new,
                     compile_s=sum(out.compile_seconds for out, _ in outs), compilations=gen.compilations,
                     buckets=len({bucket_for(max(len(p) for p in group), gen.buckets)
                                  for group, _ in _padded_batches(prompts, batch_size)}))
        results[name] = (stats, tokens)
    return results


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
                out_dir: Path, top: int = 10) -> list[dict]:
    """Trace one generation of `group` (an already compiled batch) into `out_dir` and rank its operations
    by time per step: on an accelerator the device's kernels, on a CPU the events of XLA operations
    (those naming an `hlo_op`), each with its result shape and source (`hlo_sources`): the reading
    behind the profiles in docs/benchmarks.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        out = generator.generate(group, max_new, sampling, seed=seed, eos_ids=())
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


def plain_phases(generator: Generator, prompts: list[list[int]], max_new: int, repeats: int) -> dict:
    """Batch-1 plain generation of each prompt run as two jitted programs, the prefill (`start_plain`)
    and the decoding loop (`continue_plain`), each timed on its own, with one streaming read
    (`BandwidthProbe`) before each prefill: per timed pass (after a warm-up pass), the seconds of each
    phase over the prompts and the median bandwidth read in between, and the decoding steps taken. A
    shared host's load drifts over a run; the reads taken during a pass measure the bandwidth it had."""
    static_names = ("sampling", "eos_ids", "max_new", "cache_len")
    start = jax.jit(lambda g, params, *a, **s: start_plain(nnx.merge(g, params), *a, **s),
                    static_argnums=0, static_argnames=(*static_names, "mesh"))
    loop = jax.jit(lambda g, params, state, budgets, **s: continue_plain(nnx.merge(g, params), state, budgets, **s),
                   static_argnums=0, static_argnames=static_names, donate_argnums=2)
    probe = BandwidthProbe()
    passes = []
    for _ in range(repeats + 1):
        prefill_s = decode_s = steps = 0
        reads = []
        for p in prompts:
            args, static = generator.prepare([p], max_new, eos_ids=())
            reads.append(probe.read())
            t0 = time.perf_counter()
            state = jax.block_until_ready(start(generator.graphdef, *args, **static))
            t1 = time.perf_counter()
            static.pop("mesh")
            state = jax.block_until_ready(loop(generator.graphdef, args[0], state, args[3], **static))
            decode_s += time.perf_counter() - t1
            prefill_s += t1 - t0
            steps += int(to_host(state.step))
        passes.append(dict(prefill_s=prefill_s, decode_s=decode_s, bandwidth=statistics.median(reads)))
    return dict(passes=passes[1:], decode_steps=steps)


def plain_efficiency(model: Llama, prompts: list[list[int]], max_new: int, phases: dict) -> dict:
    """Batch-1 plain decoding against the bandwidth limit: each decoding step reads every weight once
    and the K/V of the tokens so far (the mean over the run's steps). The step time is the decoding
    loop's alone (`plain_phases`); a prefill reads the weights once for a whole prompt. The fraction is
    the median over the timed passes of each pass's achieved bytes/s over the bandwidth read during it."""
    cfg = model.cfg
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    per_token_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
    mean_context = float(np.mean([len(p) + (max_new - 1) / 2 for p in prompts]))
    step_bytes = weight_bytes + per_token_kv * mean_context
    steps = max(phases["decode_steps"], 1)
    passes = phases["passes"]
    decode_s = statistics.median(p["decode_s"] for p in passes) / steps
    bandwidth = statistics.median(p["bandwidth"] for p in passes)
    fraction = statistics.median(step_bytes * steps / p["decode_s"] / p["bandwidth"] for p in passes)
    return dict(weight_bytes=int(weight_bytes), kv_bytes_per_step=float(per_token_kv * mean_context),
                bytes_per_step=float(step_bytes), decode_steps=phases["decode_steps"], decode_step_ms=1e3 * decode_s,
                prefill_ms_per_prompt=1e3 * statistics.median(p["prefill_s"] for p in passes) / len(prompts),
                achieved_bytes_per_s=step_bytes / decode_s, bandwidth_bytes_per_s=bandwidth,
                fraction_of_bandwidth=fraction, limit_step_ms=1e3 * step_bytes / bandwidth,
                passes=[dict(decode_step_ms=1e3 * p["decode_s"] / steps, bandwidth_bytes_per_s=p["bandwidth"],
                             fraction_of_bandwidth=step_bytes * steps / p["decode_s"] / p["bandwidth"])
                        for p in passes])


def run_hf(path: Path, prompts: list[list[int]], batch_size: int, max_new: int, repeats: int, dtype: str,
           progress) -> dict[str, tuple[dict, list[list[int]]]]:
    """`transformers` greedy generate on the same checkpoint and token ids; with batch 1 also prompt
    lookup decoding (HF's assisted generation without a draft model)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise CloverError("--hf needs PyTorch: pip install torch") from None
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), use_safetensors=True, trust_remote_code=False, local_files_only=True)
    model.eval()
    modes = {"hf-generate": {}}
    if batch_size == 1:
        modes["hf-prompt-lookup"] = {"prompt_lookup_num_tokens": 10}
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    results = {}
    for name, extra in modes.items():
        seconds, tokens = [], []
        for rep in range(repeats + 1):
            run_s = 0.0
            for start in range(0, len(prompts), batch_size):
                group = prompts[start:start + batch_size]
                width = max(len(p) for p in group)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                         min_new_tokens=max_new, do_sample=False, pad_token_id=pad, **extra)
                run_s += time.perf_counter() - t0
                progress.update(1)
                if rep == 0:
                    tokens += [row[width:].tolist() for row in out]
            if rep:
                seconds.append(run_s)
        new = sum(len(t) for t in tokens)
        results[name] = (dict(tokens_per_s=new / statistics.median(seconds), new_tokens=new), tokens)
    return results


def random_model(shape: str, layers: int | None = None, seed: int = 0, mesh=None) -> Llama:
    """A `SHAPES` architecture with random bfloat16 weights (0.02 x normal), drawn on (and, with a mesh,
    straight into the shards of) the devices: a 16 GB model never passes through the host."""
    fields = dict(SHAPES[shape], model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False)
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = ModelConfig.from_hf_dict(fields)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))))
    counter = itertools.count()
    draws = {}  # one compiled draw per (shape, dtype, sharding): 32 identical layers compile once

    def init(path, var):
        a, key = var.get_value(), jax.random.fold_in(jax.random.key(seed), next(counter))
        sharding = param_sharding(path, var, mesh) if mesh else None
        spec = (a.shape, a.dtype, sharding)
        if spec not in draws:
            draws[spec] = jax.jit(lambda k: (0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype),
                                  out_shardings=sharding)
        return var.replace(draws[spec](key))

    return nnx.merge(graphdef, nnx.map_state(init, abstract))


def shape_step_times(shape: str, layers: int | None, configs: list[tuple[str, str | None, str | None]], batch_size: int,
                     max_new: int, seed: int, progress, mesh=None) -> dict[str, dict]:
    """Plain and speculative step latency (the decoding loop's, the prefill apart) of a real architecture
    with random bfloat16 weights and random heads (acceptance is irrelevant here: a step costs the same
    whatever it accepts). A numeric draft vocabulary takes that many tokens (which ones does not change
    the time); auto, the whole vocabulary."""
    from clover_jax.heads import DEFAULT_NUM_HEADS, HeadsConfig, make_heads
    from clover_jax.speculative import SpeculativeGenerator
    from clover_jax.tree import resolve_tree

    model = random_model(shape, layers, seed, mesh)
    cfg = model.cfg
    prompt_len = 128
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch_size)]
    out = {}
    no_counts = np.zeros(cfg.vocab_size, np.int64)  # random heads: no token more frequent than another
    for method, tree, dv in configs:
        size = 0
        if method == "plain":
            gen = Generator(model, max_len=prompt_len + max_new, mesh=mesh)
        else:
            heads = make_heads(HeadsConfig(method, DEFAULT_NUM_HEADS[method]), model, seed=seed)
            size = resolve_size(dv, no_counts, cfg.vocab_size)  # auto: the whole vocabulary, as no counts give
            vocab = DraftVocab.most_frequent(model.lm_head_weight(), no_counts, size) if size else None
            gen = SpeculativeGenerator(model, heads, resolve_tree(tree, method, heads.num_heads),
                                       max_len=prompt_len + max_new, mesh=mesh, draft_vocab=vocab)
        compile_s = gen.generate(prompts, max_new, eos_ids=()).compile_seconds
        # The same program with a budget of one token runs the prefill alone; the loop's steps are the
        # difference, so a prefill (a step of its own kind) does not dilute the step time.
        whole, alone = [], []
        for _ in range(3):
            o = gen.generate(prompts, max_new, eos_ids=())
            p = gen.generate(prompts, max_new, eos_ids=(), budgets=[1] * batch_size)
            whole.append(o.run_seconds)
            alone.append(p.run_seconds)
        loop_steps = o.steps - p.steps
        progress.update(1)
        out[label(method, tree, draft_vocab=dv)] = dict(
            step_ms=1e3 * (statistics.median(whole) - statistics.median(alone)) / loop_steps,
            prefill_ms=1e3 * statistics.median(alone), loop_steps=loop_steps, compile_s=compile_s,
            tree_nodes=getattr(getattr(gen, "tree", None), "num_nodes", 1), draft_vocab_size=size)
        del gen
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return dict(shape=shape, layers=cfg.num_layers, batch_size=batch_size, weight_bytes=int(weight_bytes),
                methods=out)


# ------------------------------------------------------------------------------------------ reporting

def machine_info(bandwidth: float) -> dict:
    dev = jax.devices()[0]
    return dict(platform=dev.platform, device=dev.device_kind, devices=jax.device_count(),
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                jax=jax.__version__, bandwidth_bytes_per_s=bandwidth,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def format_table(rows: list[Row]) -> str:
    head = f"{'method':<17}{'batch':>5} {'tree':<22}{'vocab':>6}{'tau':>6}{'tok/s':>9}{'speedup':>8}{'step ms':>9}" \
           f"{'compile s':>10}{'compiles':>9}  accept@1..D"
    lines = [head, "-" * len(head)]
    for r in rows:
        tree = f"{r.tree} ({r.tree_nodes})" if r.tree else "-"
        vocab = "-" if not r.tree else str(r.draft_vocab_size or "all")
        compiles = f"{r.compilations}/{r.buckets}" if r.buckets else "-"
        same = "" if r.matches_plain is None else ("" if r.matches_plain else "  OUTPUT DIFFERS FROM PLAIN")
        step = f"{r.step_ms:.2f}" if r.step_ms else "-"
        comp = f"{r.compile_s:.1f}" if r.buckets else "-"
        tau = "-" if r.tau is None else f"{r.tau:.2f}"
        name = r.method if not r.temperature else f"{r.method} T={r.temperature:g}"
        lines.append(f"{name:<17}{r.batch_size:>5} {tree:<22}{vocab:>6}{tau:>6}{r.tokens_per_s:>9.1f}{r.speedup:>7.2f}x"
                     f"{step:>9}{comp:>10}{compiles:>9}  {' '.join(f'{a:.2f}' for a in r.accept_per_depth)}{same}")
    return "\n".join(lines)


def exactness_note(rows: list[Row], dtype: str) -> str | None:
    """Why a greedy row wrote other tokens than plain decoding, where numerics explain it (not float32)."""
    if dtype == "float32" or all(r.matches_plain is not False for r in rows):
        return None
    return (f"In {dtype}, a forward pass over several tokens rounds some logits differently from one over a "
            "single token, so a near-tie can go the other way and the texts part there; in float32 greedy "
            "speculative decoding writes plain decoding's tokens exactly (README).")


def _label_bars(ax, names: list[str], offset: float = 0.0) -> None:
    """A bar panel's x labels, slanted so long row names stay readable, and the 1.0 line."""
    ax.set_xticks(np.arange(len(names)) + offset)
    ax.set_xticklabels(names, rotation=50, ha="right", rotation_mode="anchor", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)


METHOD_COLORS = {"medusa": "tab:blue", "clover": "tab:green", "clover2": "tab:red"}


def acceptance_curves(rows: list[Row]) -> list[tuple[str, Row]]:
    """(legend name, row) per acceptance curve to draw: rows that differ only in their draft vocabulary
    and accept alike (as they mostly do) share one curve, named without the vocabulary."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.method, r.tree, r.temperature), []).append(r)
    curves = []
    for (method, tree, temperature), group in groups.items():
        alike = len({tuple(np.round(r.accept_per_depth, 2)) for r in group}) == 1
        curves += [(label(method, tree or None, temperature), group[0])] if alike else [(r.name, r) for r in group]
    return curves


def plot(rows: list[Row], out: str, shape: dict | None = None) -> None:
    """Speedup and tau per row, acceptance per depth; with `--shape`, also its projected speedups."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.name for r in rows))
    sizes = sorted({r.batch_size for r in rows})
    bars = max(4.5, 0.4 * len(names))  # inches per bar panel: room for every label
    shaped = list(shape["methods"]) if shape else []
    widths = (bars, bars) + ((max(4.5, 0.4 * len(shaped)),) if shaped else ()) + (5.5,)
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths), 4.2), width_ratios=widths)
    width = 0.8 / len(sizes)
    for k, b in enumerate(sizes):
        by = {r.name: r for r in rows if r.batch_size == b}
        xs = np.arange(len(names)) + k * width
        axes[0].bar(xs, [by[m].speedup if m in by else 0 for m in names], width, label=f"batch {b}")
        axes[1].bar(xs, [(by[m].tau or 0) if m in by else 0 for m in names], width, label=f"batch {b}")
    for ax, title in ((axes[0], "speedup over plain (tokens/s ratio)"), (axes[1], "tau: tokens per base forward")):
        _label_bars(ax, names, width * (len(sizes) - 1) / 2)
        ax.set_title(title)
        ax.legend()
    if shaped:
        ax, methods = axes[2], shape["methods"]
        heights = [methods[m]["projected_speedup"] for m in shaped]
        ax.bar(np.arange(len(shaped)), heights, 0.6, color="tab:green")
        for i, m in enumerate(shaped):
            ax.annotate(f"{methods[m]['step_ms']:.1f}", (i, heights[i]), ha="center", va="bottom", fontsize=7)
        _label_bars(ax, shaped)
        ax.set_title(f"--shape {shape['shape']}: projected speedup\n(tau x plain step / step; step ms on bars)", fontsize=10)
    curves = acceptance_curves([r for r in rows if r.accept_per_depth and r.batch_size == sizes[0]])
    trees: dict[str, list[str]] = {}
    for name, r in curves:  # a colour per method, a marker per tree (hollow: not the default draft
        shapes = trees.setdefault(r.method, [])  # vocabulary, where it accepts otherwise), sampled rows dashed
        shapes += [r.tree] if r.tree not in shapes else []
        axes[-1].plot(range(1, len(r.accept_per_depth) + 1), r.accept_per_depth, color=METHOD_COLORS.get(r.method),
                      marker="osD^vP*X"[shapes.index(r.tree) % 8], ls="--" if r.temperature else "-", label=name,
                      mfc="none" if name.endswith(f"dv={r.draft_vocab}") else None)
    axes[-1].set_title(f"steps accepting >= d drafted tokens (batch {sizes[0]})")
    axes[-1].set_xlabel("depth d")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[-1].set_ylim(0, 1)
    if curves:  # beside the panel: with many rows a legend inside would hide the curves
        axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), ncol=1 + len(curves) // 16)
    fig.tight_layout()
    tmp = Path(out).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, out)
    plt.close(fig)


def _write_json(result: dict, out: str) -> None:
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)


# ------------------------------------------------------------------------------------------ main

def _benchmark(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise CloverError(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    methods = ["plain"] + [m for m in dict.fromkeys(methods) if m != "plain"]
    sizes = _numbers(args.batch_sizes, "--batch-sizes", int, "integers", "1,8", 1)
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--repeats", args.repeats)):
        if value < 1:
            raise CloverError(f"{flag} {value} must be >= 1")
    draft_vocabs = list(dict.fromkeys(str(parse_size(v)) for v in args.draft_vocab.split(",") if v.strip())) or ["auto"]
    configs = [(m, t, None if m == "plain" else dv) for m, t in _configs(args.tree, methods)
               for dv in ([None] if m == "plain" else draft_vocabs)]
    path = cli.model_dir(args.model)
    cfg = ModelConfig.from_pretrained(path)
    tokenizer = cli.load_tokenizer(path)
    prompt_file = args.prompts or path / "prompts.jsonl"
    if args.prompts is None and not Path(prompt_file).is_file():
        raise CloverError(f"no prompts file at {prompt_file}; pass --prompts FILE")
    texts = cli.read_prompts(prompt_file)[: args.num_prompts]
    prompts = [cli.encode(tokenizer, t, bos_id=cfg.bos_token_id) for t in texts]
    mesh = make_mesh(args.mesh) if args.mesh else None
    _, model = load_pretrained(path, dtype=DTYPES[args.dtype], mesh=mesh)
    heads_root = Path(args.heads_root) if args.heads_root else path / "heads"

    bandwidth = BandwidthProbe().median()
    per_size = {b: -(-len(prompts) // b) * (args.repeats + 1) for b in sizes}  # batches per method and size
    hf_passes = sum(n * (2 if b == 1 else 1) for b, n in per_size.items()) if args.hf else 0
    temps = _numbers(args.temperatures, "--temperatures", float, "numbers", "0,1", 0)
    total = sum(per_size.values()) * len(configs) * len(temps) + hf_passes + (len(configs) if args.shape else 0)
    rows: list[Row] = []
    profiles: dict[str, list[dict]] = {}
    efficiency = None
    with tqdm(total=total, desc="benchmark", unit="batch", file=sys.stderr) as progress:
        for b in sizes:
            plain_tokens = None
            for temp in temps:
                sampling = SamplingConfig(temperature=temp)
                generators = {}
                for method, spec, dv in configs:
                    heads = None if method == "plain" else str(heads_root / method)
                    generators[label(method, spec, draft_vocab=dv)] = make_generator(
                        model, method, model_path=path, heads=heads, tree=spec, seed=args.seed, mesh=mesh,
                        draft_vocab=dv, greedy=sampling.greedy)
                measured = run_engines(generators, prompts, b, args.max_new_tokens, args.repeats, progress,
                                       sampling, args.seed)
                if args.profile and b == sizes[0] and temp == temps[0]:
                    group = next(_padded_batches(prompts, b))[0]
                    for name, gen in generators.items():
                        progress.set_postfix_str(f"{name}, profiling")
                        profiles[name] = profile_ops(gen, group, args.max_new_tokens, sampling, args.seed,
                                                     Path(args.profile) / profile_folder(name))
                for (method, spec, dv), (name, gen) in zip(configs, generators.items()):
                    stats, tokens = measured[name]
                    tree = getattr(gen, "tree", None)
                    vocab = getattr(gen, "draft_vocab", None)
                    row = Row(method=method, batch_size=b, tree="" if method == "plain" else spec or "default",
                              temperature=temp, draft_vocab=dv or "", draft_vocab_size=vocab.size if vocab else 0,
                              tree_nodes=tree.num_nodes if tree else 1, **stats)
                    if method == "plain":
                        plain_tps = row.tokens_per_s
                        if temp == 0:
                            plain_tokens = tokens
                            if b == 1:
                                progress.set_postfix_str("plain decoding against the bandwidth limit")
                                phases = plain_phases(gen, prompts, args.max_new_tokens, args.repeats)
                                efficiency = plain_efficiency(model, prompts, args.max_new_tokens, phases)
                    elif temp == 0:
                        row.matches_plain = tokens == plain_tokens
                    row.speedup = row.tokens_per_s / plain_tps
                    rows.append(row)
                del generators, measured
            plain_tps = next(r.tokens_per_s for r in rows if r.method == "plain" and r.batch_size == b)
            if args.hf:
                for name, (stats, tokens) in run_hf(path, prompts, b, args.max_new_tokens, args.repeats,
                                                    args.dtype, progress).items():
                    rows.append(Row(method=name, batch_size=b, tau=None, speedup=stats["tokens_per_s"] / plain_tps,
                                    tokens_per_s=stats["tokens_per_s"], new_tokens=stats["new_tokens"],
                                    matches_plain=None if plain_tokens is None else tokens == plain_tokens))
        shape = None
        if args.shape:
            progress.set_postfix_str(f"--shape {args.shape}")
            shape = shape_step_times(args.shape, args.shape_layers, configs, sizes[0], args.max_new_tokens,
                                     args.seed, progress, mesh)
            plain_ms = shape["methods"]["plain"]["step_ms"]
            tau = {label(r.method, r.tree or None, draft_vocab=r.draft_vocab): r.tau for r in rows
                   if r.batch_size == sizes[0] and r.temperature == temps[0]}
            for m, s in shape["methods"].items():
                s["tau_reference"] = tau[m]
                s["projected_speedup"] = tau[m] * plain_ms / s["step_ms"]
            shape["limit_step_ms"] = 1e3 * shape["weight_bytes"] / bandwidth

    print(format_table(rows))
    note = exactness_note(rows, args.dtype)
    if note:
        print("\n" + note)
    if efficiency:
        print(f"\nplain decoding, batch 1: {efficiency['bytes_per_step'] / 1e6:.1f} MB read per step "
              f"(weights {efficiency['weight_bytes'] / 1e6:.1f} MB + KV {efficiency['kv_bytes_per_step'] / 1e6:.2f} MB) "
              f"in {efficiency['decode_step_ms']:.2f} ms (prefill excluded: "
              f"{efficiency['prefill_ms_per_prompt']:.1f} ms per prompt) = "
              f"{efficiency['achieved_bytes_per_s'] / 1e9:.1f} GB/s; streaming reads between the prompts "
              f"{efficiency['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s -> {100 * efficiency['fraction_of_bandwidth']:.0f}% "
              f"of the limit ({efficiency['limit_step_ms']:.2f} ms/step; median of the passes: "
              + ", ".join(f"{100 * p['fraction_of_bandwidth']:.0f}%" for p in efficiency["passes"]) + ")")
    for b in sizes:
        hf = {r.method: r for r in rows if r.batch_size == b and r.method.startswith("hf-")}
        if "hf-generate" in hf:
            ours = {r.name: r.tokens_per_s for r in rows
                    if r.batch_size == b and not r.method.startswith("hf-") and not r.temperature}
            ratios = ", ".join(f"{m} {t / hf['hf-generate'].tokens_per_s:.1f}x" for m, t in ours.items())
            print(f"against transformers generate, batch {b}: {ratios}")
    if shape:
        print(f"\n--shape {shape['shape']} ({shape['layers']} layers, bfloat16, batch {shape['batch_size']}, "
              f"{shape['weight_bytes'] / 1e9:.2f} GB of weights; bandwidth limit {shape['limit_step_ms']:.2f} ms/step):")
        for m, s in shape["methods"].items():
            print(f"  {m:<24} step {s['step_ms']:8.2f} ms  nodes {s['tree_nodes']:>3}  tau(reference) {s['tau_reference']:.2f}"
                  f"  projected speedup {s['projected_speedup']:.2f}x  (compiled in {s['compile_s']:.0f} s)")
    for name, ops in profiles.items():
        print(f"\nprofile, {name} (batch {sizes[0]}): most costly operations per step")
        for op in ops[:6]:
            print(f"  {op['us_per_step']:9.1f} us  {op['calls_per_step']:6.1f} calls  {op['op'][:40]:<40} "
                  f"{op['shape'][:24]:<24} {op['source'][-60:]}")
    result = {"results": [dataclasses.asdict(r) for r in rows], "plain_efficiency": efficiency, "shape": shape,
              "profile": profiles or None,
              "machine": machine_info(bandwidth),
              "settings": dict(model=str(path), prompts=str(prompt_file), num_prompts=len(prompts),
                               max_new_tokens=args.max_new_tokens, repeats=args.repeats, dtype=args.dtype,
                               mesh=args.mesh,
                               command=args.command)}
    if args.json:
        _write_json(result, args.json)
    if args.plot:
        plot(rows, args.plot, shape)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command = "python -m infer.benchmark " + shlex.join(sys.argv[1:] if argv is None else argv)
    return cli.run_main(lambda: _benchmark(args))


if __name__ == "__main__":
    sys.exit(main())
