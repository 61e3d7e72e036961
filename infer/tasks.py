"""Spec-Bench's tasks and MT-Bench's categories: which task a prompt belongs to, which prompts a
`--per-task` run takes, and the per-task figures (tau, tokens/s, speedup) the benchmark reports, as
Spec-Bench and the Clover-2 paper break their results down."""

from __future__ import annotations

import statistics

from clover_jax.errors import CloverError
from infer.report import Row

# Spec-Bench's MT-Bench questions carry MT-Bench's eight categories, which it reports as one task.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def task_of(record: dict) -> str | None:
    """The task a prompt record belongs to, as Spec-Bench reports it: its "category" (mt_bench for MT-Bench's
    eight; translation, summarization, qa, math_reasoning, rag), or None without one."""
    category = record.get("category")
    if not isinstance(category, str) or not category:
        return None
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def tasks_of(records: list[tuple[dict, str]]) -> list[str | None]:
    """The task of each record (`task_of`); where every record is one of MT-Bench's (FastChat's 80 questions,
    `--prompts mt-bench`), each of its eight categories is a task of its own, as the Clover-2 paper breaks
    MT-Bench down."""
    categories = [record.get("category") if isinstance(record, dict) else None for record, _ in records]
    if categories and all(c in MT_BENCH_CATEGORIES for c in categories):
        return categories
    return [task_of(record) if isinstance(record, dict) else None for record, _ in records]


def first_of_each_task(records: list[tuple[dict, str]], n: int) -> list[tuple[dict, str]]:
    """The first `n` records of each task (`tasks_of`), in the file's order; one error line when no
    record names one."""
    taken: dict[str, int] = {}
    out = []
    for (record, where), task in zip(records, tasks_of(records)):
        if task is not None and taken.get(task, 0) < n:
            taken[task] = taken.get(task, 0) + 1
            out.append((record, where))
    if not out:
        raise CloverError("--per-task: no record of the prompts file names a \"category\" (Spec-Bench's "
                          "question.jsonl does); use --num-prompts")
    return out


def per_task(tasks: list[str | None], new: list[int], seq_steps: list[int] | None, seconds: list[list[float]],
             batch_size: int) -> dict[str, dict]:
    """Per task (prompts without one left out): its prompt count, tau (None without `seq_steps`: the
    transformers rows) and tokens/s. A task's time is its batches' (median over the timed passes), so it
    is known when no batch holds prompts of another task as well (always at batch 1; Spec-Bench's files
    keep each task's prompts together); else None."""
    out = {}
    for task in dict.fromkeys(t for t in tasks if t is not None):
        mine = [i for i, t in enumerate(tasks) if t == task]
        batches = {i // batch_size for i in mine}
        alone = all(t == task for i, t in enumerate(tasks) if i // batch_size in batches)
        tokens = sum(new[i] for i in mine)
        run_s = statistics.median(sum(p[k] for k in batches) for p in seconds) if alone else None
        tau = None if seq_steps is None else tokens / max(sum(seq_steps[i] for i in mine), 1)
        out[task] = dict(prompts=len(mine), tau=tau, new_tokens=tokens, tokens_per_s=tokens / run_s if run_s else None)
    return out


def task_speedups(row: Row, plain: Row) -> None:
    """Each of the row's tasks' speedup: its tokens/s over plain decoding's on that task's prompts."""
    for task, figures in row.per_task.items():
        base = plain.per_task[task]["tokens_per_s"]
        figures["speedup"] = figures["tokens_per_s"] / base if base and figures["tokens_per_s"] else None
