"""`--turns all`: the later turns of each conversation, asked after the model's own earlier answers.
"""
from __future__ import annotations

import sys

from tqdm import tqdm

from clover_jax import _cli as cli
from clover_jax._cli.conversation import answer_turns, record_turns
from clover_jax import BUCKETS, Generator


def with_later_turns(model, tokenizer, prompts: list[list[int]], records: list[tuple[dict, str]],
                     systems: list[str | None], max_new: int, eos: tuple[int, ...], batch_size: int,
                     mesh=None, buckets=BUCKETS) -> tuple[list[list[int]], list[int]]:
    """The first turns' prompts, then each record's later turns' (Spec-Bench's second MT-Bench question,
    ShareGPT's later human turns), with the index of each prompt's record: a later turn is asked after
    the conversation so far, as Spec-Bench asks it, its earlier answers plain greedy decoding's, up to
    EOS or `max_new` tokens (`answer_turns`). The answers come from a generator of their own, so the
    measured ones compile and count only theirs; a conversation whose next prompt would not leave
    `max_new` tokens of room ends there."""
    gen = Generator(model, mesh=mesh, buckets=buckets)
    users = [record_turns(record, where)[0] for record, where in records]

    def answer(batch: list[list[int]], turn: int) -> list[list[int]]:
        out = []
        groups = cli.batches(batch, batch_size)
        for group in tqdm(groups, desc=f"turn {turn + 1}'s answers by plain greedy decoding, to ask the next",
                          unit="batch", file=sys.stderr, dynamic_ncols=True):
            out += gen.generate(group, max_new, eos_ids=eos, batch_size=batch_size).tokens
        return out

    turns = answer_turns(answer, tokenizer, users, systems, prompts, eos, gen.max_len - max_new + 1,
                         [where for _, where in records], last=False)
    later = [(ids, i) for i, conversation in enumerate(turns) for ids, _, _ in conversation[1:]]
    return prompts + [ids for ids, _ in later], list(range(len(prompts))) + [i for _, i in later]
