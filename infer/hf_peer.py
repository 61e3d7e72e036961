"""The Hugging Face `transformers` peer of the benchmark (`--hf`): greedy `generate` and its prompt-lookup
assisted generation, in PyTorch on the CPU, over the same prompts; and where an answer ends at EOS.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from clover_jax.errors import CloverError
from infer.tasks import per_task


def ended_at(answers: list[list[int]], eos: tuple[int, ...]) -> int | None:
    """How many of `answers` ended at one of `eos` (None without them: every answer ran to the budget)."""
    return sum(1 for a in answers if a and a[-1] in eos) if eos else None


def up_to_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """`tokens` up to and including the first of `eos`."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def run_hf(path: Path, prompts: list[list[int]], batch_size: int, max_new: int, repeats: int, dtype: str,
           progress, tasks: list[str | None] | None = None,
           eos: tuple[int, ...] = ()) -> dict[str, tuple[dict, list[list[int]]]]:
    """`transformers` greedy generate on the same checkpoint and token ids; with batch 1 also prompt
    lookup decoding (HF's assisted generation without a draft model). With `tasks`, also `per_task`;
    with `eos`, each answer ends at the first of them (else it runs to `max_new`)."""
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
    stop = dict(eos_token_id=list(eos)) if eos else dict(min_new_tokens=max_new)
    results = {}
    for name, extra in modes.items():
        seconds, tokens = [], []  # per timed pass, per batch
        for rep in range(repeats + 1):
            run_s = []
            for start in range(0, len(prompts), batch_size):
                group = prompts[start:start + batch_size]
                width = max(len(p) for p in group)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                         do_sample=False, pad_token_id=pad, **stop, **extra)
                run_s.append(time.perf_counter() - t0)
                progress.update(1)
                if rep == 0:  # a row that ended early is padded after its EOS
                    tokens += [up_to_eos(row[width:].tolist(), eos) for row in out]
            if rep or not repeats:
                seconds.append(run_s)
        new = sum(len(t) for t in tokens)
        stats = dict(tokens_per_s=new / statistics.median(sum(p) for p in seconds), new_tokens=new,
                     at_eos=ended_at(tokens, eos))
        if tasks:
            stats["per_task"] = per_task(tasks, [len(t) for t in tokens], None, seconds, batch_size)
        results[name] = (stats, tokens)
    return results
