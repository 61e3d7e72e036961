"""Conversations of several turns: a prompt record's turns, their rendering by the chat template with
a loss mask on the assistant's, and answering them turn by turn.

Shared by `train.make_data` (every assistant turn of a conversation in the heads' training data) and
`infer.benchmark` (Spec-Bench's later turns, asked after the earlier answers, as Spec-Bench asks them).
"""

from __future__ import annotations

from typing import Callable, Sequence

from clover_jax.errors import CloverError
from infer import cli

_USER = ("human", "user")
_ASSISTANT = ("gpt", "assistant", "chatgpt")


def record_turns(record, where: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(user turns, exchanges) of a record: {"prompt"} and its {"response"}; Spec-Bench's {"turns"}; or a
    ShareGPT conversation's human and gpt turns from its first human turn for as long as they alternate
    (what follows a break in the order is dropped)."""
    prompt = cli.first_prompt(record, where)
    if isinstance(record.get("response"), str):
        return (prompt,), ((prompt, record["response"]),)
    turns = record.get("turns")
    if isinstance(turns, list) and turns and turns[0] == prompt:
        return tuple(t for t in turns if isinstance(t, str)), ()
    conv = record.get("conversations")
    if not isinstance(conv, list):
        return (prompt,), ()
    conv = [t for t in conv if isinstance(t, dict) and isinstance(t.get("value"), str)]
    conv = conv[next((i for i, t in enumerate(conv) if t.get("from") in _USER), len(conv)):]
    users, replies = [], []
    for i, turn in enumerate(conv):
        if turn.get("from") not in (_USER if i % 2 == 0 else _ASSISTANT):
            break
        (users if i % 2 == 0 else replies).append(turn["value"])
    if users[:1] != [prompt]:  # the prompt came from elsewhere in the record ({"prompt"} beside the turns)
        return (prompt,), ()
    return tuple(users), tuple(zip(users, replies))


def encode_conversation(tokenizer, exchanges, system: str | None, eos: tuple[int, ...], where: str,
                        then: str | None = None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of (user, assistant) exchanges rendered by the chat template, as the model sees
    the conversation at each turn: mask 1 on every assistant turn as the template writes it, up to its
    first EOS (what follows is the template's, not the model's), 0 elsewhere. `then`, a last user turn,
    ends the ids with the assistant's opening after it: the prompt for the next reply.

    Each turn's text is the rendering of the conversation so far less the rendering before it, so the
    template must render a conversation turn by turn; one that rewrites earlier turns (some move the
    system turn into the latest user turn) is refused for a conversation of several turns."""
    turns = list(exchanges) + ([(then, None)] if then is not None else [])
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for k, (user, reply) in enumerate(turns):
        messages = cli.chat_messages(exchanges[:k], user, system)
        opening = cli.render_chat(tokenizer, messages, add_generation_prompt=True)
        full = "" if reply is None else cli.render_chat(tokenizer, messages + [{"role": "assistant", "content": reply}])
        if len(turns) == 1 and reply is not None and not full.startswith(opening):
            # A template that does not extend its own generation opening: the text plus EOS.
            full = opening + reply + (tokenizer.eos_token or "")
        if not (opening.startswith(done) and (reply is None or full.startswith(opening))):
            raise CloverError(f"{where}: the chat template rewrites earlier turns when it renders turn {k + 1}, so "
                              "the turns cannot be masked apart; use --turns first")
        prompt = tokenizer(opening[len(done):], add_special_tokens=False)["input_ids"]
        ids += prompt
        mask += [0] * len(prompt)
        if reply is None:
            break
        answer = tokenizer(full[len(opening):], add_special_tokens=False)["input_ids"]
        cut = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
        rest = answer[cut:] if k + 1 < len(turns) else []  # the last turn's ends the example
        ids += answer[:cut] + rest
        mask += [1] * cut + [0] * len(rest)
        done = full
    return [int(i) for i in ids], mask


def answer_turns(answer: Callable[[list[list[int]], int], list[list[int]]], tokenizer,
                 users: Sequence[Sequence[str]], systems: Sequence[str | None], first: Sequence[list[int]],
                 eos: tuple[int, ...], max_len: int, where: Sequence[str]) -> list[list[tuple]]:
    """Conversations answered turn by turn: `answer(prompts, turn)` replies (EOS included when hit) to
    the prompts of turn `turn` (0 first), in one call per turn; conversation i's first prompt is
    `first[i]`, and its turn t's is the conversation so far, its earlier answers as the chat template
    renders them (as a chat application sends a conversation back), then `users[i][t]`.

    Returns per conversation the (prompt ids, prompt loss mask, reply) of each turn answered. A
    conversation ends at its last user turn, at an answer without EOS (cut short), or where the next
    prompt would reach `max_len` tokens."""
    pending = {i: (list(p), [0] * len(p)) for i, p in enumerate(first)}  # conversation -> its next prompt
    history: list[list[tuple[str, str]]] = [[] for _ in first]
    out: list[list[tuple]] = [[] for _ in first]
    turn = 0
    while pending:
        order = list(pending)
        replies = answer([pending[i][0] for i in order], turn)
        turn += 1
        nxt = {}
        for i, reply in zip(order, replies):
            ids, mask = pending[i]
            out[i].append((ids, mask, reply))
            if turn < len(users[i]) and reply and reply[-1] in eos:
                history[i].append((users[i][turn - 1], tokenizer.decode(reply[:-1], skip_special_tokens=True)))
                ids, mask = encode_conversation(tokenizer, history[i], systems[i], eos, where[i], then=users[i][turn])
                if len(ids) < max_len:
                    nxt[i] = (ids, mask)
        pending = nxt
    return out
