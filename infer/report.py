"""What a benchmark run reports: its rows, the terminal table and summary lines, the JSON and the plot."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
from pathlib import Path

import jax
import numpy as np

from clover_jax._cli import plots
from clover_jax.plan import step_cost
from clover_jax.io.files import atomic_path, write_text

# The method of a plain-decoding row (no drafter), as the results files already written name it.
PLAIN = "plain"


@dataclasses.dataclass
class Row:
    """One measured configuration (method, tree, draft vocabulary, batch size, temperature) and its
    figures; the JSON's `results` are these rows."""

    method: str  # PLAIN, a draft method, or a peer such as hf-generate
    batch_size: int
    tree: str = ""
    temperature: float = 0.0
    draft_vocab: str = ""  # the --draft-vocab value of a speculative row
    draft_vocab_size: int = 0  # tokens the heads drafted from; 0: the whole vocabulary
    tree_nodes: int = 1
    tau: float | None = 1.0  # None for the transformers rows (their steps are not ours to count)
    accept_per_depth: list[float] = dataclasses.field(default_factory=list)  # of the steps that drafted
    step_cost: float | None = None  # what a paced row's loop took a speculative step to cost (plain steps)
    drafted: float | None = None  # the share of a speculative row's steps (prefills apart) that drafted
    tokens_per_s: float = 0.0
    speedup: float = 1.0
    step_ms: float = 0.0  # the whole generation's time (prefill included) per forward pass
    steps: int = 0  # forward passes over the prompt set, the prefills included
    new_tokens: int = 0
    compile_s: float = 0.0
    compilations: int = 0
    buckets: int = 0
    matches_plain: bool | None = None
    # Greedy rows: how many prompts' texts are plain decoding's (same dtype and batch size), and per prompt
    # None where it is, else where it first parted (`clover_jax.model.divergence.Divergence`: the token
    # index, the two tokens, their logit gap, the top-2 gap and the logits' scale and spacing there).
    same_text: int | None = None
    divergences: list[dict | None] | None = None
    at_eos: int | None = None  # with --stop-at-eos, the answers that ended at an EOS (the rest hit the budget)
    node_hits: list[int] | None = None  # a static tree's: steps whose accepted path held node i (--fit-tree)
    # Per Spec-Bench task, where the prompts name one (`benchmark.per_task`): prompts, tau, new_tokens,
    # tokens_per_s and speedup (None where a batch mixed tasks, so no time is the task's alone).
    per_task: dict[str, dict] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return label(self.method, self.tree or None, self.temperature, self.draft_vocab)


def label(method: str, tree: str | None, temperature: float = 0.0, draft_vocab: str | None = None) -> str:
    """A row's name: the method, for a speculative one its tree and a draft vocabulary other than auto,
    and a temperature other than 0."""
    name = method if method == PLAIN or method.startswith("hf-") else f"{method} {tree or 'default'}"
    if draft_vocab and draft_vocab != "auto":
        name += f" dv={draft_vocab}"
    return name if not temperature else f"{name} T={temperature:g}"


def machine_info(bandwidth: float) -> dict:
    dev = jax.devices()[0]
    return dict(platform=dev.platform, device=dev.device_kind, devices=jax.device_count(),
                cpu=step_cost.cpu_model(), cpu_count=os.cpu_count(),
                jax=jax.__version__, bandwidth_bytes_per_s=bandwidth,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


COLUMNS = ("method", "batch", "tree (nodes)", "vocab", "tau", "tok/s", "speedup", "step ms", "compile s", "compiles",
           "drafted", "accept@1..D")
_WIDTHS = (-17, 5, -26, 6, 6, 9, 8, 9, 10, 9, 8)  # the terminal table's columns; negative: left-aligned
_SAME_WIDTH = 25  # the `same text` column's, where shown


def cells(r: Row, same_text: bool = False) -> list[str]:
    """A row's figures as its tables show them, one string per `COLUMNS` entry: the terminal's
    (`format_table`) and the markdown of docs/results.md (`infer.results`); with `same_text`, also
    `same_text_cell`'s, before the last (`columns`)."""
    tree = f"{r.tree} ({r.tree_nodes})" if r.tree else "-"
    vocab = "-" if r.tree_nodes == 1 else str(r.draft_vocab_size or "all")  # plain, or `auto` decoding plain
    out = [r.method if not r.temperature else f"{r.method} T={r.temperature:g}", str(r.batch_size), tree, vocab,
           "-" if r.tau is None else f"{r.tau:.2f}", f"{r.tokens_per_s:.1f}", f"{r.speedup:.2f}x",
           f"{r.step_ms:.2f}" if r.step_ms else "-", f"{r.compile_s:.1f}" if r.buckets else "-",
           f"{r.compilations}/{r.buckets}" if r.buckets else "-", "-" if r.drafted is None else f"{r.drafted:.0%}",
           " ".join(f"{a:.2f}" for a in r.accept_per_depth)]
    return out[:-1] + [same_text_cell(r)] + out[-1:] if same_text else out


SAME_TEXT = "same text"


def has_same_text(rows: list[Row]) -> bool:
    """Whether the tables show the `same text` column: where a run counted the texts (older JSONs did not)."""
    return any(r.same_text is not None for r in rows)


def columns(same_text: bool = False) -> list[str]:
    """The tables' column names; with `same_text`, its column before the last, as `cells` puts it."""
    return list(COLUMNS[:-1]) + [SAME_TEXT] + list(COLUMNS[-1:]) if same_text else list(COLUMNS)


def parted_at(r: Row) -> list[int]:
    """The token indices at which the row's texts first parted from plain decoding's, one per prompt
    whose text is not plain's."""
    return [d["index"] for d in r.divergences or [] if d]


def same_text_cell(r: Row) -> str:
    """`k/n`: k of the n prompts' texts are plain decoding's; where some are not, the median and first
    token index at which they parted: `22/24 (at 41, first 7)`; `-` where not counted (sampling, plain)."""
    if r.same_text is None:
        return "-"
    n, at = len(r.divergences or []), parted_at(r)
    return f"{r.same_text}/{n}" + (f" (at {statistics.median(at):g}, first {min(at)})" if at else "")


def record_partings(row: Row, parts: list) -> None:
    """A greedy row's `same_text` and `divergences` from its prompts' `divergence.compare` (None: the
    prompt's text is plain decoding's)."""
    row.same_text = sum(d is None for d in parts)
    row.divergences = [None if d is None else dataclasses.asdict(d) for d in parts]


def strict_partings(rows: list[Row], dtype: str) -> list[str]:
    """The greedy rows of this engine whose text parted from plain decoding's where it must not: in
    float32 (a bug; `transformers`' rows are another implementation, and not held to it)."""
    return [f"{r.name} (batch {r.batch_size})" for r in rows
            if dtype == "float32" and r.matches_plain is False and not r.method.startswith("hf-")]


def flags_difference(r: Row, dtype: str) -> bool:
    """Whether a table marks the row's output as differing from plain decoding's: in float32, where it
    is a bug, or where no `same text` count says how far it differs."""
    return r.matches_plain is False and (dtype == "float32" or r.same_text is None)


def format_table(rows: list[Row], dtype: str = "float32") -> str:
    def line(values):  # the tree column's leading space parts it from the batch size
        return "".join(f"{v:<{-w}}" if w < 0 else f"{v:>{w}}" for v, w in zip(values, widths)) + "  " + values[-1]

    same = has_same_text(rows)
    widths = _WIDTHS + ((_SAME_WIDTH,) if same else ())
    head = line([c if c != "tree (nodes)" else " " + c for c in columns(same)]).rstrip()
    lines = [head, "-" * len(head)]
    for r in rows:
        values = cells(r, same)
        values[2] = " " + values[2]
        lines.append(line(values) + ("  OUTPUT DIFFERS FROM PLAIN" if flags_difference(r, dtype) else ""))
    return "\n".join(lines)


def tasks_of(rows: list[Row]) -> list[str]:
    """The tasks the rows were measured on, in the prompts' order; none unless there are two or more (one
    task's figures are the table's)."""
    tasks = list(dict.fromkeys(t for r in rows for t in r.per_task))
    return tasks if len(tasks) > 1 else []


def task_cell(figures: dict | None) -> str:
    """One task's figures of a row, `speedup (tau)`: `-` for a speedup where the task's prompts shared
    batches with others, `-` alone where the row has no prompt of the task."""
    if not figures:
        return "-"
    speed = "-" if figures.get("speedup") is None else f"{figures['speedup']:.2f}x"
    return speed if figures["tau"] is None else f"{speed} ({figures['tau']:.2f})"


def format_tasks(rows: list[Row]) -> str:
    """Speedup and tau per Spec-Bench task, a table per batch size, as the papers report them; empty
    without two tasks."""
    tasks = tasks_of(rows)
    if not tasks:
        return ""
    first = next(r for r in rows if r.per_task)
    counts = ", ".join(f"{t} {first.per_task[t]['prompts']}" for t in tasks if t in first.per_task)
    tables = []
    for b in sorted({r.batch_size for r in rows}):
        mine = [r for r in rows if r.batch_size == b and r.per_task]
        head = f"{'per task, batch ' + str(b):<34}" + "".join(f"{t[:15]:>16}" for t in tasks)
        lines = [head, "-" * len(head)]
        for r in mine:
            lines.append(f"{r.name[:33]:<34}" + "".join(f"{task_cell(r.per_task.get(t)):>16}" for t in tasks))
        tables.append("\n".join(lines))
    return f"speedup over plain (tau) per task; prompts: {counts}\n" + "\n\n".join(tables)


def exactness_note(rows: list[Row], dtype: str) -> str | None:
    """Why a greedy row wrote other tokens than plain decoding, where numerics explain it (not float32),
    and per such row where its texts parted and how near a tie the base model's two tokens were there."""
    if dtype == "float32" or all(r.matches_plain is not False for r in rows):
        return None
    lines = [f"In {dtype}, a forward pass over several tokens rounds some logits differently from one over a "
             "single token, so a near-tie can go the other way and the texts part there; in float32 greedy "
             "speculative decoding writes plain decoding's tokens exactly (docs/generate.md, \"Exactness and dtype\")."]
    for r in rows:
        if r.matches_plain is False and parted_at(r):
            lines.append(f"  {r.name}, batch {r.batch_size}: " + parting_line(r))
    return "\n".join(lines)


def parting_line(r: Row) -> str:
    """Where a row's texts parted from plain decoding's, and the base model's gap between the two tokens
    there in spacings of the logits' dtype at the largest logit (a few: a near-tie within rounding)."""
    parted = [d for d in r.divergences or [] if d]
    at = [d["index"] for d in parted]
    ulps = [abs(d["gap"]) / d["ulp"] for d in parted if d.get("gap") is not None and d.get("ulp")]
    line = (f"{r.same_text} of {len(r.divergences)} texts are plain decoding's; the other {len(parted)} "
            f"part{'s' if len(parted) == 1 else ''} at "
            f"token {statistics.median(at):g} (median; first {min(at)})")
    if ulps:
        line += (f", where the two tokens' logits lay {statistics.median(ulps):.2f} spacings apart (median; at most "
                 f"{max(ulps):.2f}) at the largest logit")
    return line


def strict_note(rows: list[Row], dtype: str) -> str | None:
    """The line that says a float32 row parted from plain decoding (a bug), naming the rows."""
    bad = strict_partings(rows, dtype)
    if not bad:
        return None
    return (f"greedy output differs from plain decoding's in float32, where it must not (a bug; please report it): "
            + ", ".join(bad))


def summary(rows: list[Row], sizes: list[int], dtype: str, efficiency: dict | None, shape: dict | None,
            profiles: dict[str, list[dict]]) -> str:
    """The lines under the table: why bfloat16 rows may part from plain decoding, plain decoding against
    the bandwidth limit, the ratios to transformers generate, --shape's projection and --profile's ops."""
    out = []
    note = exactness_note(rows, dtype)
    if note:
        out.append("\n" + note)
    if efficiency:
        e = efficiency
        out.append(f"\nplain decoding, batch 1, first {e['prompts']} prompts: {e['bytes_per_step'] / 1e6:.1f} MB read per step "
                   f"(weights {e['weight_bytes'] / 1e6:.1f} MB + KV {e['kv_bytes_per_step'] / 1e6:.2f} MB) "
                   f"in {e['decode_step_ms']:.2f} ms (prefill excluded: {e['prefill_ms_per_prompt']:.1f} ms per prompt) "
                   f"= {e['achieved_bytes_per_s'] / 1e9:.1f} GB/s; streaming reads between the prompts "
                   f"{e['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s -> {100 * e['fraction_of_bandwidth']:.0f}% "
                   f"of the limit ({e['limit_step_ms']:.2f} ms/step; median of the passes: "
                   + ", ".join(f"{100 * p['fraction_of_bandwidth']:.0f}%" for p in e["passes"]) + ")")
    costs = chain_cost_note(rows)
    if costs:
        out.append("\n" + costs)
    for b in sizes:
        hf = {r.method: r for r in rows if r.batch_size == b and r.method.startswith("hf-")}
        if "hf-generate" in hf:
            ours = {r.name: r.tokens_per_s for r in rows
                    if r.batch_size == b and not r.method.startswith("hf-") and not r.temperature}
            ratios = ", ".join(f"{m} {t / hf['hf-generate'].tokens_per_s:.1f}x" for m, t in ours.items())
            out.append(f"against transformers generate, batch {b}: {ratios}")
    if shape:
        out.append(f"\n--shape {shape['shape']} ({shape['layers']} layers, bfloat16, batch {shape['batch_size']}, "
                   f"{shape['weight_bytes'] / 1e9:.2f} GB of weights; bandwidth limit {shape['limit_step_ms']:.2f} ms/step):")
        for m, s in shape["methods"].items():
            out.append(f"  {m:<24} step {s['step_ms']:8.2f} ms  nodes {s['tree_nodes']:>3}  tau(reference) "
                       f"{s['tau_reference']:.2f}  projected speedup {s['projected_speedup']:.2f}x  "
                       f"(compiled in {s['compile_s']:.0f} s)")
    for name, ops in profiles.items():
        out.append(f"\nprofile, {name} (batch {sizes[0]}): most costly operations per step")
        for op in ops[:6]:
            out.append(f"  {op['us_per_step']:9.1f} us  {op['calls_per_step']:6.1f} calls  {op['op'][:40]:<40} "
                       f"{op['shape'][:24]:<24} {op['source'][-60:]}")
    return "\n".join(out)


def eos_note(rows: list[Row], prompts: int, max_new: int) -> str | None:
    """How many answers ended at the model's EOS rather than at the token budget, per row where it was
    counted: a figure measured "to EOS" holds only as far as the answers got there."""
    counts = {r.name: r.at_eos for r in rows if r.at_eos is not None}  # alike at every batch size
    if not counts:
        return None
    return (f"answers that ended at EOS, of {prompts} (the rest ran to --max-new-tokens {max_new}): "
            + ", ".join(f"{name} {n}" for name, n in counts.items()))


def chain_cost_note(rows: list[Row]) -> str:
    """On a CPU, what each unpaced chain row's step cost in this run, in plain steps of the same batch
    size and temperature: the figure that decides whether drafting pays here (`--tree auto` times its
    own once per machine, `step_cost.chain_cost`)."""
    if jax.default_backend() != "cpu":
        return ""
    plain = {(r.batch_size, r.temperature): r for r in rows if r.method == PLAIN}
    found = []
    for r in rows:
        base = plain.get((r.batch_size, r.temperature))
        if r.tree.startswith("chain:") and r.step_cost is None and base is not None and base.step_ms and r.step_ms:
            found.append(f"{r.name} (batch {r.batch_size}, T={r.temperature:g}) {r.step_ms / base.step_ms:.2f}")
    if not found:
        return ""
    return ("a chain step in this run, in plain steps: " + ", ".join(found)
            + " (--tree auto times its own once per machine: step-costs.json in the cache folder)")


def _label_bars(ax, names: list[str], offset: float = 0.0) -> None:
    """A bar panel's x labels, slanted so long row names stay readable, and the 1.0 line."""
    ax.set_xticks(np.arange(len(names)) + offset)
    ax.set_xticklabels(names, rotation=50, ha="right", rotation_mode="anchor", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)


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
    tasks = tasks_of(rows)
    by_task = [r for r in rows if r.batch_size == sizes[0] and r.per_task and r.method != PLAIN]
    widths = (bars, bars) + ((max(4.5, 0.4 * len(shaped)),) if shaped else ()) + \
        ((max(4.5, 0.25 * len(tasks) * len(by_task)),) if tasks else ()) + (5.5,)
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
        ax, projected = axes[2], shape["methods"]
        heights = [projected[m]["projected_speedup"] for m in shaped]
        ax.bar(np.arange(len(shaped)), heights, 0.6, color="tab:green")
        for i, m in enumerate(shaped):
            ax.annotate(f"{projected[m]['step_ms']:.1f}", (i, heights[i]), ha="center", va="bottom", fontsize=7)
        _label_bars(ax, shaped)
        ax.set_title(f"--shape {shape['shape']}: projected speedup\n(tau x plain step / step; step ms on bars)", fontsize=10)
    if tasks:  # Spec-Bench's figure: speedup per task, a bar per row
        ax, width = axes[-2], 0.8 / max(len(by_task), 1)
        one_each = len({r.method for r in by_task}) == len(by_task)  # then a row's colour is its method's
        for k, r in enumerate(by_task):
            speedups = [(r.per_task.get(t) or {}).get("speedup") or 0 for t in tasks]
            ax.bar(np.arange(len(tasks)) + k * width, speedups, width, label=r.name,
                   color=plots.color(r.method) if one_each else None)
        _label_bars(ax, tasks, width * (len(by_task) - 1) / 2)
        ax.set_title(f"speedup over plain per task (batch {sizes[0]})")
        ax.legend(fontsize=7)
    curves = acceptance_curves([r for r in rows if r.accept_per_depth and r.batch_size == sizes[0]])
    trees: dict[str, list[str]] = {}
    for name, r in curves:  # a colour per method, a marker per tree (hollow: not the default draft
        shapes = trees.setdefault(r.method, [])  # vocabulary, where it accepts otherwise), sampled rows dashed
        shapes += [r.tree] if r.tree not in shapes else []
        axes[-1].plot(range(1, len(r.accept_per_depth) + 1), r.accept_per_depth, color=plots.color(r.method),
                      marker="osD^vP*X"[shapes.index(r.tree) % 8], ls="--" if r.temperature else "-", label=name,
                      mfc="none" if name.endswith(f"dv={r.draft_vocab}") else None)
    axes[-1].set_title(f"steps accepting >= d drafted tokens (batch {sizes[0]})")
    axes[-1].set_xlabel("depth d")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[-1].set_ylim(0, 1)
    if curves:  # beside the panel: with many rows a legend inside would hide the curves
        axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), ncol=1 + len(curves) // 16)
    fig.tight_layout()
    with atomic_path(out) as tmp:  # the format from out's own suffix: the temporary's is .tmp
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format=Path(out).suffix[1:].lower() or "png")
    plt.close(fig)


def write_json(result: dict, out: str) -> None:
    """Written whole or not at all: a killed run leaves no truncated file."""
    write_text(out, json.dumps(result, indent=2) + "\n")
