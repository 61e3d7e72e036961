"""Measure every method side by side, in one run: tau, acceptance per depth, tokens/s, speedup over
plain decoding of the same engine, compile counts, plain decoding against the memory-bandwidth limit,
and optionally the Hugging Face `transformers` peer and a 7B/8B-shaped model's step latency.

    python -m infer.benchmark                       # reference model, every method, batch 1 and 8
    python -m infer.benchmark --hf --json bench.json --plot bench.png
    python -m infer.benchmark --shape llama3-8b --batch-sizes 1   # on an accelerator

Every prompt generates exactly --max-new-tokens tokens (EOS is not a stop), so every method does the
same work; or, with --stop-at-eos (the default with --chat, as Spec-Bench runs), each answer ends at the
model's EOS, where a chat model's turn ends: greedy, every method then still writes the same tokens.
Greedy outputs are checked against plain decoding's on the way: each row counts the prompts whose text
is plain decoding's and, for the others, where it first parted and how near a tie the base model's two
tokens were there; in float32 a parting is a bug, and the run ends with status 1. Times are medians over
--repeats passes over the prompt set, after a warm-up pass that also compiles every bucket; the
methods take their timed passes in turn, round by round, so a shared host's drifting load reaches
them all alike. With --repeats 0 the warm-up pass alone is timed (its compiling left out): tau at half
the cost, for a slow machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from clover_jax import (BUCKETS, DTYPES, METHODS, CloverError, DynamicTree, GenerationOutput, Generator,
                        LoadedDrafter, ModelConfig, SamplingConfig, load_drafter, load_pretrained, make_generator,
                        plan_drafting)
from clover_jax import _cli as cli
from clover_jax.drafters.vocab import parse_size
from clover_jax.engine.decode import bucket_for
from clover_jax.io import sources, tokenization
from clover_jax.model.divergence import compare
from infer import loop_flags, report
from infer.bandwidth import SAMPLE_PROMPTS, BandwidthProbe, plain_efficiency, plain_phases
from infer.profiling import profile_folder, profile_ops
from infer.report import PLAIN, Row, label
from infer.fitting import check_fit_source, fit_from_run
from infer.hf_peer import ended_at, run_hf
from infer.turns import with_later_turns
from infer.tasks import first_of_each_task, per_task, task_speedups, tasks_of
from infer.shapes import SHAPES, project, shape_step_times

EPILOG = """\
Rows: one per method, tree, draft vocabulary and batch size. tree (nodes) = the tree the row ran (auto, the
default, resolved as infer.generate resolves it: chain:K on a CPU, the paper tree `default` on a GPU or
TPU, for EAGLE-1 and EAGLE-3 their authors' dynamic trees eagle2:60,10,5 and eagle2:60,10,7: N nodes,
top-k K, depth D) and its node count. vocab = tokens the heads drafted from (all:
the whole vocabulary; see --draft-vocab). tau = tokens per forward pass of the base model (bonus token
included; plain = 1.00); accept@d = share of steps that accepted at least d drafted tokens; speedup =
tokens/s over plain decoding's at the same batch size in this run; compile s = seconds spent compiling,
each new program's first (set-up) run included; compiles = programs compiled over the prompt set (the
bucket count is the most it should be); same text = of a greedy row's prompts, those whose text is plain
decoding's at the same batch size (at N, first M: the median and earliest token index at which the others
first parted; the summary says how near a tie the base model's two tokens were there). The bandwidth line divides the bytes a plain decoding step reads
(weights + KV) by its time, the decoding loop timed apart from the prefill, over the first 8 prompts
at batch 1, and compares that with streaming reads the benchmark takes between the prompts of the same
passes (the median over passes of each pass's ratio). With --hf, rows `hf-generate` (transformers
greedy `generate`) and `hf-prompt-lookup` (its assisted generation without a draft model, batch 1)
run the same model and prompts in PyTorch on the CPU. Prompts whose records name a Spec-Bench
`category` also get speedup and tau per task (MT-Bench's eight categories as mt_bench), a speedup only
where a task's prompts fill their batches alone (always at batch 1).
"""


ROW_METHODS = (PLAIN,) + METHODS  # --methods' words: plain decoding (no drafter) and the draft methods
DEFAULT_METHODS = ",".join(ROW_METHODS)
# A row whose --tree auto decodes plain (no chain of its heads pays here): its tree column.
NO_TREE = "plain"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.benchmark", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: the shipped reference model)")
    p.add_argument("--methods", default=DEFAULT_METHODS, metavar="LIST",
                   help="comma-separated methods to measure (default: %(default)s); plain is always measured")
    p.add_argument("--heads-root", metavar="DIR",
                   help="directory holding one heads directory per method (default: MODEL/heads)")
    p.add_argument("--tree", action="append", default=[], metavar="[METHOD=]SPEC",
                   help="draft tree for every speculative method, or METHOD=SPEC for one; repeat it to measure "
                        "several trees in the same run. SPEC: auto (on a CPU a chain as deep as the heads' "
                        "held-out chain tau says is fastest, or plain decoding, tree 'plain', where no chain is "
                        "modelled to pay; the default tree elsewhere; as infer.generate picks), default (on "
                        "a GPU or TPU EAGLE-1's and EAGLE-3's own dynamic trees, eagle2:60,10,5 and "
                        "eagle2:60,10,7; else the tree fitted to the heads, their tree.json, shown as 'fitted'; "
                        "else the method's paper tree), fitted, paper, chain:K, widths:4,2,2, full:WxD, a named "
                        "tree, a JSON file of paths, or a dynamic tree dynamic:N[,W] / eagle2[:N,K,D] (default: "
                        "auto; each row names the tree it used, a dynamic one with every setting)")
    p.add_argument("--fit-tree", type=int, metavar="N",
                   help="fit an N-node tree to where this run's drafts were accepted, greedy or sampled: the nodes "
                        "of the run's static tree that accepted most (a subtree accepts what they did), written to "
                        "--tree-out for --tree FILE. Run one speculative method on one tree larger than N at one "
                        "temperature and batch size, on prompts other than those you will measure it on")
    p.add_argument("--tree-out", metavar="FILE", help="with --fit-tree: the JSON file the fitted tree is written to")
    p.add_argument("--draft-vocab", default="auto", metavar="LIST",
                   help="comma-separated draft vocabularies to measure every speculative method with: N (the N "
                        "most frequent tokens of the heads' training data; when sampling, the N most probable "
                        "under the base model there), 0 (the whole vocabulary) or auto (99.9%% of those tokens "
                        "when greedy, 99%% of that probability mass when sampling; the whole vocabulary when "
                        "sampling with heads exported without it); with --shape, N drafts from N tokens of the "
                        "random model and auto from all (default: %(default)s)")
    p.add_argument("--step-cost", default="auto", metavar="LIST",
                   help="comma-separated pacings to measure every speculative method with (infer.generate's "
                        "--step-cost): auto (on a CPU, the tree auto picks paced by its measured cost: plain steps "
                        "while the drafts accepted lately do not pay for it; unpaced elsewhere), none (draft at every "
                        "step) or a speculative step's cost in plain steps; each row names its pacing "
                        "(default: %(default)s)")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL prompts: {\"prompt\"}, Spec-Bench {\"turns\"} or ShareGPT {\"conversations\"} "
                        "records, their first turns and, with --chat, their later ones (--turns) "
                        "(default: MODEL/prompts.jsonl; for a named model the project's prompts for it, gemma3's "
                        "plain-text Spec-Bench-style tasks for a base model, else MT-Bench's questions)")
    cli.add_chat_flags(p)
    p.add_argument("--turns", choices=("first", "all"),
                   help="with --chat: also measure each later turn of a multi-turn record (Spec-Bench's MT-Bench "
                        "questions, ShareGPT's human turns), asked after the conversation so far as Spec-Bench "
                        "asks it, its earlier answers plain greedy decoding's (to EOS), so every method sees the "
                        "same prompts (all); or the first turns only (first). Without --chat only the first "
                        "(default: all with --chat)")
    p.add_argument("--num-prompts", type=int, default=24, metavar="N", help="first N prompts of the file (default: %(default)s)")
    p.add_argument("--per-task", type=int, metavar="N",
                   help="instead of --num-prompts: the first N prompts of each Spec-Bench task (records' "
                        "\"category\"; MT-Bench's eight count as one), for every task in a run of modest length")
    p.add_argument("--batch-sizes", default="1,8", metavar="LIST", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--buckets", metavar="LIST",
                   help="comma-separated prompt lengths a prompt is padded up to, each a program compiled per "
                        "method, and a longer prompt to the whole cache (default: 32,64,128,... doubling): one "
                        "length that holds every prompt, such as 1024, compiles one program per method, which "
                        "on an accelerator saves most of a short run, as compiling a 30-layer model's step takes "
                        "tens of seconds there and running it milliseconds")
    p.add_argument("--max-new-tokens", type=int, default=96, metavar="N",
                   help="tokens generated per prompt, exactly, or at most with --stop-at-eos (default: %(default)s)")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction,
                   help="end each answer at the model's EOS, as Spec-Bench does (a chat model's turn ends there; "
                        "what follows is no answer), rather than always generating --max-new-tokens; greedy, "
                        "every method still writes the same tokens (default: on with --chat, else off)")
    p.add_argument("--temperatures", default="0", metavar="LIST",
                   help="comma-separated sampling temperatures, 0 = greedy (default: %(default)s); speculative "
                        "sampling is lossless, so tau at 1 against 0 shows what sampling costs the drafts")
    p.add_argument("--draft-temperature", type=float, default=1.0, metavar="X",
                   help="when sampling, draw the drafts from the heads' logits at the temperature times X (the "
                        "output's distribution does not change; how often drafts are kept does) (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, metavar="R",
                   help="timed passes over the prompts after the warm-up pass (which compiles, and gives tau and the "
                        "tokens); medians are reported. 0: the warm-up pass is timed too, and is the only one: half "
                        "the time of 1, for tau on a slow machine, with noisier speedups (compiling and each "
                        "program's set-up run stay out of the times either way) (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of weights and activations (default: %(default)s)")
    loop_flags.add_loop_chunk(p)
    loop_flags.add_command_buffer(p)
    p.add_argument("--hf", action="store_true", help="also run Hugging Face transformers generate (PyTorch) on the same model and prompts")
    p.add_argument("--shape", choices=tuple(SHAPES),
                   help="also time plain and speculative steps of this architecture with random weights (bfloat16; "
                        "meant for an accelerator) and project speedup = tau (reference model) x plain step / spec step")
    p.add_argument("--shape-layers", type=int, metavar="L", help="with --shape: keep only the first L layers (a quicker, smaller run)")
    cli.add_mesh_flags(p, "the engine")
    p.add_argument("--profile", metavar="DIR",
                   help="also trace one batch of each method (first batch size and temperature) with jax.profiler "
                        "into DIR/<method> (Perfetto traces, for ui.perfetto.dev or TensorBoard) and report each "
                        "method's most costly operations per step (kernels on an accelerator, XLA ops on a CPU), "
                        "each with its result shape and the JAX operation it came from")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write a PNG: speedup and tau per method, speedup per Spec-Bench task, acceptance per depth")
    p.add_argument("--seed", type=cli.seed, default=0, metavar="S",
                   help="seed of random heads, random --shape weights and sampling, 0 to 2**32-1 "
                        "(default: %(default)s)")
    return p


def _configs(specs: list[str], methods: list[str]) -> list[tuple[str, str | None]]:
    """(method, tree spec) pairs to measure: plain once, each speculative method once per tree given for
    it (`SPEC` applies to every method, `METHOD=SPEC` to one; `default`: the method's paper tree, None
    here; none given: `auto`, which `planned` resolves)."""
    trees: dict[str, list[str | None]] = {m: [] for m in methods if m != PLAIN}
    for spec in specs:
        method, sep, tree = spec.partition("=")
        if not (sep and method in ROW_METHODS):  # a tree for every method (a JSON or path may hold '=')
            method, tree = None, spec
        if method == PLAIN:
            raise CloverError("--tree plain=...: plain decoding has no tree")
        for m in [method] if method else trees:
            if m in trees:
                trees[m].append(None if tree == "default" else tree)
    return [(PLAIN, None)] + [(m, t) for m, ts in trees.items() for t in (list(dict.fromkeys(ts)) or ["auto"])]


def planned(model, drafter: LoadedDrafter | None, spec: str | None, value: str | None, draft_vocab, sampling: bool,
            mesh=None) -> tuple[str | None, float | None]:
    """(the tree a row runs, as its tree column names it: NO_TREE where `auto` decodes plain, "fitted" for
    the heads' fitted tree, None for the paper tree, a dynamic tree with every setting written out (`eagle2`
    as eagle2:60,10,7, also where `default` stands for it on an accelerator); its step cost) for `drafter`
    (None: plain decoding), tree `spec` and `--step-cost` `value`, as infer.generate plans them
    (`plan_drafting`: on a CPU `auto` is a chain, its depth picked by the heads' held-out chain tau and
    this machine's timed chain step cost), so that each row names the tree it ran."""
    if drafter is None:
        return spec, None
    plan = plan_drafting(model, None, drafter=drafter, tree=spec, draft_vocab=draft_vocab, greedy=not sampling,
                         step_cost=value, mesh=mesh)
    if plan is None:
        return NO_TREE, None
    if isinstance(plan.tree, DynamicTree):
        return str(plan.tree), plan.step_cost
    if plan.spec in (None, "default"):  # the heads' fitted tree, or the method's paper tree, and the rows say which
        return ("fitted" if drafter.ships_fitted_tree else None), plan.step_cost
    return plan.spec, plan.step_cost


def paced(spec: str | None, cost: float | None) -> str:
    """A speculative row's tree column: its tree, and the step cost it was paced by."""
    return (spec or "default") + ("" if cost is None else f" paced {cost:g}")


def engine_pass(generator: Generator, prompts: list[list[int]], batch_size: int, max_new: int,
                sampling: SamplingConfig, seed: int, progress,
                eos: tuple[int, ...] = ()) -> list[GenerationOutput]:
    """One pass over the prompts in batches of `batch_size` (the last one filled to it: one compiled
    shape): each batch's output, without its final device state. `eos`: the ids that end an answer
    (none: every answer runs to `max_new`)."""
    outs = []
    for k, group in enumerate(cli.batches(prompts, batch_size)):
        out = generator.generate(group, max_new, sampling=sampling, seed=seed + k, eos_ids=eos, batch_size=batch_size)
        # The state holds the batch's KV cache, which the counts here do not need: kept for every batch, it
        # grew a run over MT-Bench at batch 8 by about 230 MB a batch (one batch's cache), 8 GB by the 27th.
        out.state = None
        outs.append(out)
        progress.update(1)
    return outs


def run_engines(generators: dict[str, Generator], prompts: list[list[int]], batch_size: int, max_new: int,
                repeats: int, progress, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                tasks: list[str | None] | None = None,
                eos: tuple[int, ...] = ()) -> dict[str, tuple[dict, list[list[int]]]]:
    """Statistics and tokens per generator: a warm-up pass of each (compiling every bucket; tokens and
    acceptance come from it), then `repeats` rounds in which each generator makes one timed pass in
    turn (none: the warm-up pass's times, compiling left out, are the figures). A shared host's load
    drifts over a run; taking the generators in turn within every round exposes them all to the same
    drift, so the ratios between them hold when the absolute rates move.
    With `tasks` (one per prompt, `task_of`), the statistics also hold `per_task` (`per_task`)."""
    warm = {}
    for name, gen in generators.items():
        what = "warm-up" if repeats else "one pass, timed"  # with no timed rounds this pass gives the figures
        progress.set_postfix_str(f"{name}, batch {batch_size}, T={sampling.temperature:g}, {what}")
        warm[name] = engine_pass(gen, prompts, batch_size, max_new, sampling, seed, progress, eos)
    seconds: dict[str, list[list[float]]] = {name: [] for name in generators}  # per timed pass, per batch
    for rep in range(repeats):
        progress.set_postfix_str(f"batch {batch_size}, T={sampling.temperature:g}, timed round {rep + 1}/{repeats}")
        for name, gen in generators.items():
            outs = engine_pass(gen, prompts, batch_size, max_new, sampling, seed, progress, eos)
            seconds[name].append([out.run_seconds for out in outs])
    if not repeats:
        seconds = {name: [[out.run_seconds for out in warm[name]]] for name in generators}
    results = {}
    for name, gen in generators.items():
        outs = warm[name]
        tokens = [t for out in outs for t in out.tokens]
        steps = sum(out.steps for out in outs)
        seq_steps = [s for out in outs for s in out.sequence_steps]
        hists = [out.accept_hist.sum(0) for out in outs if out.accept_hist is not None]
        hist = sum(hists) if hists else None
        hits = [out.node_hits.sum(0) for out in outs if out.node_hits is not None]
        new = sum(len(t) for t in tokens)
        run_s = statistics.median(sum(batches) for batches in seconds[name])
        accept = [] if hist is None else [float(hist[d:].sum() / max(hist.sum(), 1)) for d in range(1, len(hist))]
        later = max(sum(out.decode_steps for out in outs), 1)  # of the steps after the prefills, the share drafting
        drafted = None if hist is None else sum(out.drafted_steps for out in outs) / later
        stats = dict(tau=new / max(sum(seq_steps), 1), accept_per_depth=accept, drafted=drafted, tokens_per_s=new / run_s,
                     step_ms=1e3 * run_s / max(steps, 1), steps=steps, new_tokens=new,
                     compile_s=sum(out.compile_seconds for out in outs), compilations=gen.compilations,
                     buckets=len({bucket_for(max(len(p) for p in group), gen.buckets)
                                  for group in cli.batches(prompts, batch_size)}), at_eos=ended_at(tokens, eos),
                     node_hits=sum(hits).tolist() if hits else None)
        if tasks:
            stats["per_task"] = per_task(tasks, [len(t) for t in tokens], seq_steps, seconds[name], batch_size)
        results[name] = (stats, tokens)
    return results


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse paths that --json, --plot and --profile could not write to before anything is timed, so a
    bad path fails at once rather than after the whole run."""
    for flag, out in (("--json", args.json), ("--plot", args.plot)):
        if out:
            cli.check_output_file(out, flag)  # a file made and removed in its folder: root may not write /proc
    if args.plot:
        cli.check_plot_format(args.plot)
    if bool(args.fit_tree) != bool(args.tree_out):
        raise CloverError("--fit-tree N and --tree-out FILE go together: the tree fitted, and where it is written")
    if args.tree_out:
        if args.fit_tree < 2:
            raise CloverError(f"--fit-tree {args.fit_tree} must be >= 2 (the root and one draft)")
        cli.check_output_file(args.tree_out, "--tree-out")
    if args.profile:
        cli.check_output_dir(args.profile, "--profile")


def _benchmark(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ROW_METHODS]
    if unknown:
        raise CloverError(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(ROW_METHODS)}")
    methods = [PLAIN] + [m for m in dict.fromkeys(methods) if m != PLAIN]
    sizes = cli.numbers(args.batch_sizes, "--batch-sizes", int, "integers", "1,8", 1)
    buckets = sorted(set(cli.numbers(args.buckets, "--buckets", int, "integers", "1024", 1))) if args.buckets else BUCKETS
    for flag, value in (("--num-prompts", args.num_prompts), ("--per-task", 1 if args.per_task is None else args.per_task),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise CloverError(f"{flag} {value} must be >= 1")
    if args.repeats < 0:
        raise CloverError(f"--repeats {args.repeats} must be >= 0 (0: time the warm-up pass alone)")
    loop_flags.check_loop_chunk(args)
    SamplingConfig(draft_temperature=args.draft_temperature)  # a bad value is one line before anything loads
    draft_vocabs = list(dict.fromkeys(str(parse_size(v)) for v in args.draft_vocab.split(",") if v.strip())) or ["auto"]
    costs = list(dict.fromkeys(v.strip() for v in args.step_cost.split(",") if v.strip())) or ["auto"]
    configs = [(m, t, None if m == PLAIN else dv, None if m == PLAIN else sc) for m, t in _configs(args.tree, methods)
               for dv in ([None] if m == PLAIN else draft_vocabs) for sc in ([None] if m == PLAIN else costs)]
    _check_outputs(args)  # before anything loads or is timed (--tree auto may time a step on a CPU)
    path = sources.model_dir(args.model)
    cfg = ModelConfig.from_pretrained(path)
    tokenizer = cli.load_tokenizer(path, cli.chat_template_flag(args.chat, args.chat_template, args.model))
    prompt_file = args.prompts or cli.default_prompts(args.model, path)
    if args.turns == "all" and not args.chat:
        raise CloverError("--turns all asks later turns after the conversation so far, as the chat template renders "
                          "it; add --chat, or drop --turns")
    records = cli.read_records(prompt_file)
    records = records[: args.num_prompts] if args.per_task is None else first_of_each_task(records, args.per_task)
    texts = cli.prompt_turns(records)
    prompts = cli.encode_prompts(tokenizer, texts, args.chat, args.system, cfg.bos_token_id)
    mesh = cli.mesh_of(args)
    _, model = load_pretrained(path, dtype=DTYPES[args.dtype], mesh=mesh)
    heads_root = Path(args.heads_root) if args.heads_root else sources.heads_root(args.model, path)
    # Every built-in method (the default): those the heads root holds heads for.
    absent = [m for m in methods[1:] if not (heads_root / m).is_dir()] if args.methods == DEFAULT_METHODS else []
    methods = [m for m in methods if m not in absent]
    configs = [c for c in configs if c[0] not in absent]
    # Each method's drafter is loaded once, for every tree, temperature and batch size it runs at.
    drafters = {m: load_drafter(model, m, heads=heads_root / m, seed=args.seed) for m in methods if m != PLAIN}
    temps = cli.numbers(args.temperatures, "--temperatures", float, "numbers", "0,1", 0)
    if absent:
        print(f"note: no {', '.join(absent)} heads under {heads_root}; measuring the others (name a method in "
              "--methods to be told what is missing)", file=sys.stderr)
    # `auto` may stand for another tree (or none: NO_TREE) when sampling, whose steps cost more.
    at_temp = {}
    for t in temps:
        plans = [(m, *planned(model, drafters.get(m), spec, sc, dv, t > 0, mesh), dv) for m, spec, dv, sc in configs]
        at_temp[t] = list(dict.fromkeys((m, tree, dv, cost) for m, tree, cost, dv in plans))

    drafting = [c for t in temps for c in at_temp[t] if c[0] != PLAIN and c[1] != NO_TREE]
    if args.fit_tree and (len(drafting) != 1 or len(temps) != 1 or len(sizes) != 1):
        raise CloverError(f"--fit-tree fits one run's accepted paths, and this one drafts in {len(drafting)} "
                          f"configuration(s) at {len(temps)} temperature(s) and {len(sizes)} batch size(s): name one "
                          "speculative method, one --tree, one temperature and one batch size")
    if args.fit_tree:
        [(m, spec, dv, cost)] = drafting
        check_fit_source(make_generator(model, m, drafter=drafters[m], tree=spec, draft_vocab=dv,
                                        greedy=temps[0] == 0, step_cost=cost, mesh=mesh).tree, args.fit_tree)
    tasks = tasks_of(records)
    eos = tokenization.eos_ids(path, cfg, tokenizer)
    stop_at_eos = args.chat if args.stop_at_eos is None else args.stop_at_eos
    answer_eos = eos if stop_at_eos else ()  # what ends a measured answer
    if args.chat and args.turns != "first":
        systems = [cli.prompt_system(own, True, args.system) for _, own in texts]
        prompts, owners = with_later_turns(model, tokenizer, prompts, records, systems, args.max_new_tokens, eos,
                                           max(sizes), mesh, buckets)
        tasks = [tasks[i] for i in owners]
    cli.check_seeds(args.seed, -(-len(prompts) // min(sizes)))  # a pass's batch k samples with seed + k
    bandwidth = BandwidthProbe().median()
    per_size = {b: -(-len(prompts) // b) * (args.repeats + 1) for b in sizes}  # batches per method and size
    hf_passes = sum(n * (2 if b == 1 else 1) for b, n in per_size.items()) if args.hf else 0
    shape_configs = list(dict.fromkeys(c[:3] for c in at_temp[temps[0]] if c[1] != NO_TREE))
    total = (sum(per_size.values()) * sum(map(len, at_temp.values())) + hf_passes
             + (len(shape_configs) if args.shape else 0))
    rows: list[Row] = []
    fitted_from = None  # the last row on a static tree, and its tree
    profiles: dict[str, list[dict]] = {}
    efficiency = None
    with tqdm(total=total, desc="benchmark", unit="batch", file=sys.stderr) as progress:
        for b in sizes:
            plain_tokens = None
            for temp in temps:
                sampling = SamplingConfig(temperature=temp, draft_temperature=args.draft_temperature)
                generators = {}
                configs = at_temp[temp]
                for method, spec, dv, cost in configs:
                    generators[label(method, paced(spec, cost), draft_vocab=dv)] = make_generator(
                        model, None, drafter=None if spec == NO_TREE else drafters.get(method), tree=spec,
                        mesh=mesh, draft_vocab=dv, greedy=sampling.greedy, buckets=buckets, step_cost=cost,
                        loop_chunk=args.loop_chunk)
                measured = run_engines(generators, prompts, b, args.max_new_tokens, args.repeats, progress,
                                       sampling, args.seed, tasks, answer_eos)
                if args.profile and b == sizes[0] and temp == temps[0]:
                    group = cli.batches(prompts, b)[0]
                    for name, gen in generators.items():
                        progress.set_postfix_str(f"{name}, profiling")
                        profiles[name] = profile_ops(gen, group, args.max_new_tokens, sampling, args.seed,
                                                     Path(args.profile) / profile_folder(name), batch_size=b,
                                                     eos_ids=answer_eos)
                for (method, spec, dv, cost), (name, gen) in zip(configs, generators.items()):
                    stats, tokens = measured[name]
                    tree, vocab = gen.tree, gen.draft_vocab
                    row = Row(method=method, batch_size=b, tree="" if method == PLAIN else paced(spec, cost),
                              step_cost=cost,
                              temperature=temp, draft_vocab=dv or "", draft_vocab_size=vocab.size if vocab else 0,
                              tree_nodes=tree.num_nodes if tree else 1, **stats)
                    if method == PLAIN:
                        plain = row
                        if temp == 0:
                            plain_tokens = tokens
                            if b == 1:
                                progress.set_postfix_str("plain decoding against the bandwidth limit")
                                sample = prompts[:SAMPLE_PROMPTS]
                                phases = plain_phases(gen, sample, args.max_new_tokens, args.repeats)
                                efficiency = plain_efficiency(model, sample, args.max_new_tokens, phases)
                    elif temp == 0:
                        row.matches_plain = tokens == plain_tokens
                        report.record_partings(row, compare(model, prompts, plain_tokens, tokens))
                    row.speedup = row.tokens_per_s / plain.tokens_per_s
                    task_speedups(row, plain)
                    rows.append(row)
                    if row.node_hits is not None:
                        fitted_from = (row, tree)
                del generators, measured
            plain = next(r for r in rows if r.method == PLAIN and r.batch_size == b)
            if args.hf:
                for name, (stats, tokens) in run_hf(path, prompts, b, args.max_new_tokens, args.repeats,
                                                    args.dtype, progress, tasks, answer_eos).items():
                    row = Row(method=name, batch_size=b, tau=None, matches_plain=None if plain_tokens is None else
                              tokens == plain_tokens, speedup=stats["tokens_per_s"] / plain.tokens_per_s, **stats)
                    if plain_tokens is not None:
                        report.record_partings(row, compare(model, prompts, plain_tokens, tokens))
                    task_speedups(row, plain)
                    rows.append(row)
        shape = None
        if args.shape:
            progress.set_postfix_str(f"--shape {args.shape}")
            shape = shape_step_times(args.shape, args.shape_layers, shape_configs,
                                     sizes[0], args.max_new_tokens,
                                     args.seed, progress, mesh)
            project(shape, {label(r.method, r.tree or None, draft_vocab=r.draft_vocab): r.tau for r in rows
                            if r.batch_size == sizes[0] and r.temperature == temps[0]}, bandwidth)

    print(report.format_table(rows, args.dtype))
    tasks_table = report.format_tasks(rows)
    if tasks_table:
        print("\n" + tasks_table)
    print(report.summary(rows, sizes, args.dtype, efficiency, shape, profiles))
    ended = report.eos_note(rows, len(prompts), args.max_new_tokens)
    if ended:
        print("\n" + ended)
    result = {"results": [dataclasses.asdict(r) for r in rows], "plain_efficiency": efficiency, "shape": shape,
              "profile": profiles or None,
              "machine": report.machine_info(bandwidth),
              "settings": dict(model=str(path), prompts=str(prompt_file), num_prompts=len(prompts),
                               num_records=len(records), per_task=args.per_task, chat=args.chat,
                               chat_template=args.chat_template, system=args.system,
                               turns="all" if args.chat and args.turns != "first" else "first",
                               max_new_tokens=args.max_new_tokens, stop_at_eos=stop_at_eos, repeats=args.repeats,
                               draft_temperature=args.draft_temperature,
                               dtype=args.dtype, mesh=args.mesh, buckets=args.buckets and buckets,
                               command=args.command)}
    if args.fit_tree:
        fit_from_run(fitted_from, args.fit_tree, args.tree_out, str(prompt_file))
    if args.json:
        report.write_json(result, args.json)
    if args.plot:
        report.plot(rows, args.plot, shape)
    strict = report.strict_note(rows, args.dtype)
    if strict:  # after the outputs are written, which show where the texts parted
        print(f"error: {strict}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command = "python -m infer.benchmark " + shlex.join(sys.argv[1:] if argv is None else argv)

    def run() -> int:
        loop_flags.use_command_buffer(args.command_buffer)  # into XLA_FLAGS, before JAX's backend starts
        return _benchmark(args)

    return cli.run_main(run)


if __name__ == "__main__":
    cli.exit(main())
