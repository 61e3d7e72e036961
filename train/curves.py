"""Held-out curves of head training runs: a table and a plot from their work directories.

python -m train.curves runs/smollm2-r5-medusa runs/smollm2-r5-clover runs/smollm2-r5-clover2 --plot curves.png

Each work directory train.train wrote holds run.json (the method) and metrics.jsonl (a training record
every 10 steps, a held-out one every --eval-every). The table gives, per run, the held-out chain tau at
every evaluation, the held-out loss from first to last, the top-1 accuracy per head and the chain tau
of a chain through the first 1, 2, ... heads at the last, and the minutes the steps took; the plot
draws chain tau and loss against the step, a colour per method.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from clover_jax import _cli as cli
from clover_jax._cli import plots
from clover_jax.errors import CloverError
from clover_jax.io.files import atomic_path, write_text
from train.runs import RUN_FILE

METRICS = "metrics.jsonl"
STOPPED_S = 600  # a longer gap between two records is a stop (a kill, a session's end) before a resume


@dataclass
class Curve:
    """One run's held-out evaluations, by step, and its training time."""
    name: str
    method: str
    steps: list[int]
    chain_tau: list[float]
    loss: list[float]
    top1: list[list[float]]
    minutes: float
    by_depth: list[float]  # the last evaluation's chain tau through the first 1, 2, ... heads (older runs: none)

    def row(self, steps: list[int]) -> list[str]:
        tau = dict(zip(self.steps, self.chain_tau))
        return ([self.name, self.method, f"{self.minutes:.1f}"] + [f"{tau[s]:.3f}" if s in tau else "" for s in steps]
                + [f"{self.loss[0]:.2f} -> {self.loss[-1]:.2f}", ", ".join(f"{a:.3f}" for a in self.top1[-1]),
                   ", ".join(f"{t:.3f}" for t in self.by_depth)])


def read_curve(work: str | Path) -> Curve:
    """The curve of one work directory; a resumed run's repeated steps keep their latest record."""
    work = Path(work)
    try:
        method = json.loads((work / RUN_FILE).read_text())["method"]
        lines = (work / METRICS).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError as e:
        raise CloverError(f"{work}: no {Path(e.filename).name}; pass a --work-dir that train.train wrote") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CloverError(f"{work}: cannot read its run.json or {METRICS} ({e})") from None
    held = {r["step"]: r for r in records if "val_chain_tau" in r}
    if not held:
        raise CloverError(f"{work}: no held-out evaluation recorded yet (train.train evaluates every --eval-every steps)")
    times = [r["time"] for r in records]
    busy = sum(b - a for a, b in zip(times, times[1:]) if b - a < STOPPED_S)
    steps = sorted(held)
    return Curve(work.name, method, steps, [held[s]["val_chain_tau"] for s in steps],
                 [held[s]["val_loss"] for s in steps], [held[s]["val_top1"] for s in steps], busy / 60,
                 held[steps[-1]].get("val_chain_tau_by_depth", []))


def table(curves: list[Curve]) -> str:
    """A Markdown table: a row per run, a chain tau column per evaluated step."""
    steps = sorted({s for c in curves for s in c.steps})
    head = (["run", "method", "minutes"] + [f"chain tau @ {s}" for s in steps]
            + ["held-out loss", "top-1 per head (last)", "chain tau by depth (last)"])
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return "\n".join(lines + ["| " + " | ".join(c.row(steps)) + " |" for c in curves])


def plot(curves: list[Curve], out: str) -> None:
    """Held-out chain tau and loss against the step: a colour per method, a line style per repeat of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    seen: dict[str, int] = {}
    for c in curves:
        style = ("-", "--", ":", "-.")[seen.get(c.method, 0) % 4]
        seen[c.method] = seen.get(c.method, 0) + 1
        for ax, ys in zip(axes, (c.chain_tau, c.loss)):
            ax.plot(c.steps, ys, ls=style, marker="o", ms=3, color=plots.color(c.method), label=c.name)
    axes[0].set_title("held-out chain tau (tokens per step, chain through every head)")
    axes[1].set_title("held-out loss (each method its own)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format=Path(out).suffix[1:].lower() or "png")
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.curves", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("work_dirs", nargs="+", metavar="WORK_DIR", help="train.train --work-dir directories, in table order")
    p.add_argument("--plot", metavar="FILE", help="also draw the curves to this image (.png, .svg, .pdf)")
    p.add_argument("--out", metavar="FILE", help="write the Markdown table here instead of printing it")
    return p


def run(args) -> int:
    for flag, path in (("--plot", args.plot), ("--out", args.out)):
        if path:  # the plot is drawn before the table is written: neither may fail after the other
            cli.check_output_file(path, flag)
    curves = [read_curve(w) for w in args.work_dirs]
    if args.plot:
        cli.check_plot_format(args.plot)
        plot(curves, args.plot)
    text = table(curves) + "\n"
    if args.out:
        write_text(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    cli.exit(main())
