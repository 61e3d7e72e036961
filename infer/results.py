"""docs/results.md's tables, made from benchmark JSONs: a rerun replaces its section instead of adding one.

    python -m infer.results render NAME RUN.json [RUN.json ...]   # the runs' rows (per task, --shape too)
    python -m infer.results steps NAME BEFORE.json [AFTER.json]   # step ms of two runs side by side

RUN.json is what `python -m infer.benchmark --json` wrote. The generated markdown replaces what lies
between the lines `<!-- results:NAME -->` and `<!-- /results:NAME -->` of the document (`--doc`,
docs/results.md), which must hold both; everything outside the markers is left as it is. The rows'
figures are formatted by `infer.report.cells`, as the benchmark's own terminal table shows them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io.files import write_text
from infer import report
from infer.report import Row

DOC = "docs/results.md"
_FIELDS = {f.name for f in dataclasses.fields(Row)}


def read_run(path: str | Path) -> tuple[dict, list[Row]]:
    """A benchmark JSON and its rows; fields an older benchmark did not write take their defaults."""
    try:
        run = json.loads(Path(path).read_text())
        rows = [Row(**{k: v for k, v in r.items() if k in _FIELDS}) for r in run["results"]]
    except FileNotFoundError:
        raise CloverError(f"{path}: no such file; give a JSON that `python -m infer.benchmark --json` wrote") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CloverError(f"{path}: not a benchmark JSON ({e}); give one that `infer.benchmark --json` wrote") from None
    return run, rows


def markdown_table(head: list[str], body: list[list[str]]) -> list[str]:
    escape = lambda cell: cell.replace("|", "\\|")
    return ["| " + " | ".join(map(escape, line)) + " |" for line in [head, ["---"] * len(head), *body]]


def provenance(run: dict, path: str | Path, lead: str = "Measured") -> str:
    """Where and when a run was measured, and from which file, with the command that measured it: the
    line under its table."""
    m = run.get("machine") or {}
    where = m.get("device", "?") if m.get("platform") != "cpu" else f"CPU ({m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores)"
    settings = run.get("settings") or {}
    line = f"{lead} {m.get('date', 'on an unrecorded date')} on {where}, JAX {m.get('jax', '?')}, " \
           f"{settings.get('dtype', 'float32')}; from `{Path(path).as_posix()}`."
    command = settings.get("command")
    return line + (f" Command: `{command}`." if command else "")


def rows_table(runs: list[list[Row]], dtypes: list[str] | None = None) -> list[str]:
    """Every row of the runs, the benchmark's columns, with a first column naming the run where there are
    several (speedups compare a row with its own run's plain decoding), and the `same text` column where a
    run counted the texts; a greedy row that wrote other text than plain decoding says so in its last cell
    where its run's dtype (`dtypes`, one per run; float32 if not given) makes that a bug, or no count says
    how far."""
    dtypes = dtypes or ["float32"] * len(runs)
    same = any(report.has_same_text(rows) for rows in runs)
    body = []
    for n, (rows, dtype) in enumerate(zip(runs, dtypes), 1):
        for r in rows:
            line = report.cells(r, same)
            if report.flags_difference(r, dtype):
                line[-1] = (line[-1] + " **output differs from plain**").strip()
            body.append(([str(n)] if len(runs) > 1 else []) + line)
    return markdown_table((["run"] if len(runs) > 1 else []) + report.columns(same), body)


def tasks_table(runs: list[list[Row]]) -> list[str]:
    """Speedup (tau) per Spec-Bench task or MT-Bench category, a line per speculative row; none without
    two tasks."""
    tasks = list(dict.fromkeys(t for rows in runs for t in report.tasks_of(rows)))
    if not tasks:
        return []
    body = [([str(n)] if len(runs) > 1 else []) + [f"{r.name}, batch {r.batch_size}"]
            + [report.task_cell(r.per_task.get(t)) for t in tasks]
            for n, rows in enumerate(runs, 1) for r in rows
            if r.per_task and r.method != report.PLAIN]  # plain's own: 1.00x (1.00) everywhere
    head = (["run"] if len(runs) > 1 else []) + ["speedup (tau) per task", *tasks]
    return [""] + markdown_table(head, body)


def shape_table(shape: dict | None) -> list[str]:
    """`--shape`'s step latencies and projected speedups (tau of the run's own model), where it ran."""
    if not shape:
        return []
    body = [[name, str(s["tree_nodes"]), f"{s['step_ms']:.2f}", f"{s['tau_reference']:.2f}",
             f"{s['projected_speedup']:.2f}x"] for name, s in shape["methods"].items()]
    head = [f"`--shape {shape['shape']}` ({shape['layers']} layers, batch {shape['batch_size']}; "
            f"bandwidth limit {shape['limit_step_ms']:.2f} ms a step)", "nodes", "step ms", "tau (run's model)",
            "projected speedup"]
    return [""] + markdown_table(head, body)


def render_runs(paths: list[str | Path], tasks: bool = True) -> str:
    """One or more runs' rows in one table, then the per-task table (unless `tasks` is False) and each
    run's `--shape` table where it has one, and a line per run saying where it was measured."""
    read = [read_run(p) for p in paths]
    runs = [rows for _, rows in read]
    dtypes = [(run.get("settings") or {}).get("dtype", "float32") for run, _ in read]
    lines = rows_table(runs, dtypes) + (tasks_table(runs) if tasks else [])
    for run, _ in read:
        lines += shape_table(run.get("shape"))
    for n, ((run, _), path) in enumerate(zip(read, paths), 1):
        lines += ["", provenance(run, path, f"Run {n}: measured" if len(paths) > 1 else "Measured")]
    return "\n".join(lines)


def _key(r: Row) -> tuple:
    return r.method, r.tree, r.batch_size, r.temperature, r.draft_vocab


def render_steps(before: str | Path, after: str | Path | None) -> str:
    """Step ms per row of two runs of the same command, side by side, matched by method, tree, batch
    size, temperature and draft vocabulary; the before run alone while `after` does not exist yet."""
    run_b, rows_b = read_run(before)
    if after is None or not Path(after).exists():
        body = [[r.method, f"{r.tree} ({r.tree_nodes})" if r.tree else "-", str(r.batch_size), f"{r.step_ms:.2f}"]
                for r in rows_b]
        note = f"The after run (`{Path(after).as_posix()}`, the same command) is to come." if after else ""
        return "\n".join(markdown_table(["method", "tree (nodes)", "batch", "step ms before"], body)
                         + ["", provenance(run_b, before)] + (["", note] if note else []))
    run_a, rows_a = read_run(after)
    by_key = {_key(r): r for r in rows_a}
    body = []
    for r in rows_b:
        a = by_key.pop(_key(r), None)
        ratio = f"{a.step_ms / r.step_ms:.2f}" if a and a.step_ms and r.step_ms else "-"
        body.append([r.method, f"{r.tree} ({r.tree_nodes})" if r.tree else "-", str(r.batch_size), f"{r.step_ms:.2f}",
                     f"{a.step_ms:.2f}" if a else "-", ratio])
    body += [[a.method, f"{a.tree} ({a.tree_nodes})" if a.tree else "-", str(a.batch_size), "-", f"{a.step_ms:.2f}", "-"]
             for a in by_key.values()]  # rows only the after run measured
    head = ["method", "tree (nodes)", "batch", "step ms before", "step ms after", "after / before"]
    return "\n".join(markdown_table(head, body) + ["", provenance(run_b, before, "Before: measured"), "",
                                                   provenance(run_a, after, "After: measured")])


def replace_section(doc: str, name: str, body: str) -> str:
    """`doc` with what lies between NAME's two marker lines replaced by `body`."""
    start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
    if len(pattern.findall(doc)) != 1:
        raise CloverError(f"the document needs one section between the lines {start} and {end} (in that order); "
                          "add the two lines where the table goes")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", doc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.results", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    render = sub.add_parser("render", help="one benchmark run's rows, per-task and --shape tables")
    render.add_argument("name", help="the section: the NAME of its marker lines")
    render.add_argument("runs", nargs="+", metavar="RUN.json",
                        help="JSONs of python -m infer.benchmark --json, their rows in one table")
    render.add_argument("--no-tasks", dest="tasks", action="store_false",
                        help="leave out the per-task table (where the per-task figures say nothing new)")
    steps = sub.add_parser("steps", help="step ms of two runs of one command side by side")
    steps.add_argument("name", help="the section: the NAME of its marker lines")
    steps.add_argument("before", help="the earlier run's JSON")
    steps.add_argument("after", nargs="?", help="the later run's JSON (not there yet: the before run alone)")
    for s in (render, steps):
        s.add_argument("--doc", default=DOC, help=f"the markdown file holding the section (default {DOC})")
    return p


def _main(args: argparse.Namespace) -> int:
    body = render_runs(args.runs, args.tasks) if args.what == "render" else render_steps(args.before, args.after)
    try:
        doc = Path(args.doc).read_text()
    except FileNotFoundError:
        raise CloverError(f"--doc {args.doc}: no such file") from None
    write_text(args.doc, replace_section(doc, args.name, body))
    print(f"{args.doc}: section {args.name} rendered")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _main(args))


if __name__ == "__main__":
    cli.exit(main())
