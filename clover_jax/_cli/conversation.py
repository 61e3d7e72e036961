"""Conversations of several turns: a prompt record's turns, their rendering by the chat template with
a loss mask on the assistant's, and answering them turn by turn.

Shared by `train.make_data` (every assistant turn of a conversation in the heads' training data) and
`infer.benchmark` (Spec-Bench's later turns, asked after the earlier answers, as Spec-Bench asks them).
"""

from __future__ import annotations

from typing import Callable, Sequence

from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io import tokenization

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
    """(ids, loss mask) of (user, assistant) exchanges rendered by the chat template: mask 1 on every
    assistant turn as the template writes it, up to its first EOS (what follows is the template's, not
    the model's), 0 elsewhere. `then`, a last user turn, ends the ids with the assistant's opening after
    it: the prompt for the next reply.

    The ids are the tokenization of the whole rendered text, as a chat application sends the conversation
    (and as `infer.generate --interactive` does); cut into turns, a tokenizer that joins or marks text at
    a boundary (sentencepiece's leading "▁") would give ids that decoding never sees. Each assistant turn
    is found as text: the rendering of the conversation up to it and through it, so the template must
    render a conversation turn by turn; one that rewrites earlier turns (some move the system turn into
    the latest user turn) is refused for a conversation of several turns."""
    turns = list(exchanges) + ([(then, None)] if then is not None else [])
    spans: list[tuple[int, int]] = []  # each reply's characters in `text`
    text = ""
    for k, (user, reply) in enumerate(turns):
        messages = tokenization.chat_messages(exchanges[:k], user, system)
        opening = tokenization.render_chat(tokenizer, messages, add_generation_prompt=True)
        full = opening if reply is None else tokenization.render_chat(tokenizer, messages + [{"role": "assistant",
                                                                                      "content": reply}])
        if len(turns) == 1 and reply is not None and not full.startswith(opening):
            # A template that does not extend its own generation opening: the text plus EOS.
            full = opening + reply + (tokenizer.eos_token or "")
        if not (opening.startswith(text) and full.startswith(opening)):
            raise CloverError(f"{where}: the chat template rewrites earlier turns when it renders turn {k + 1}, so "
                              "the turns cannot be masked apart; use --turns first")
        if reply is not None:
            spans.append((len(opening), len(full)))
        text = full
    ids, mask = masked_ids(tokenizer, text, spans, eos, add_special_tokens=False)
    if then is None and any(mask):  # the last turn's EOS ends the example: drop the template's text after it
        last = len(mask) - mask[::-1].index(1)
        ids, mask = ids[:last], mask[:last]
    return ids, mask


def masked_ids(tokenizer, text: str, spans: Sequence[tuple[int, int]], eos: tuple[int, ...],
               add_special_tokens: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of `text` tokenized whole: mask 1 on the tokens that overlap a (start, end) span of
    its characters, each span up to its first EOS token, 0 elsewhere."""
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                        return_special_tokens_mask=True)
    except NotImplementedError:
        raise CloverError("the tokenizer cannot map its tokens to the text (a slow tokenizer); use one with a "
                          "tokenizer.json") from None
    ids = [int(i) for i in enc["input_ids"]]
    mask = [0] * len(ids)
    for a, b in spans:
        for i, ((start, end), added) in enumerate(zip(enc["offset_mapping"], enc["special_tokens_mask"])):
            if start >= b:
                break
            # A token trimmed to no width (spaces, where the tokenizer trims offsets) sits where it starts;
            # one the tokenizer added (its BOS) is no reply's.
            if start < end and end > a or start == end and start >= a and not added:
                mask[i] = 1
                if ids[i] in eos:
                    break
    return ids, mask


def answer_turns(answer: Callable[[list[list[int]], int], list[list[int]]], tokenizer,
                 users: Sequence[Sequence[str]], systems: Sequence[str | None], first: Sequence[list[int]],
                 eos: tuple[int, ...], max_len: int, where: Sequence[str], last: bool = True) -> list[list[tuple]]:
    """Conversations answered turn by turn: `answer(prompts, turn)` replies (EOS included when hit) to
    the prompts of turn `turn` (0 first), in one call per turn; conversation i's first prompt is
    `first[i]`, and its turn t's is the conversation so far, its earlier answers as the chat template
    renders them (as a chat application sends a conversation back), then `users[i][t]`.

    Returns per conversation the (prompt ids, prompt loss mask, reply) of each turn answered. A
    conversation ends at its last user turn, at an answer without EOS (cut short), or where the next
    prompt would reach `max_len` tokens. `last=False` leaves each conversation's last user turn
    unanswered (reply []): for a caller that wants the prompts, whose answers it makes itself."""
    pending = {i: (list(p), [0] * len(p)) for i, p in enumerate(first)}  # conversation -> its next prompt
    history: list[list[tuple[str, str]]] = [[] for _ in first]
    out: list[list[tuple]] = [[] for _ in first]
    turn = 0
    while pending:
        order = list(pending)
        asked = [i for i in order if last or turn + 1 < len(users[i])]
        replies = dict(zip(asked, answer([pending[i][0] for i in asked], turn) if asked else []))
        turn += 1
        nxt = {}
        for i in order:
            reply = replies.get(i, [])
            ids, mask = pending[i]
            out[i].append((ids, mask, reply))
            if turn < len(users[i]) and reply and reply[-1] in eos:
                history[i].append((users[i][turn - 1], tokenizer.decode(reply[:-1], skip_special_tokens=True)))
                ids, mask = encode_conversation(tokenizer, history[i], systems[i], eos, where[i], then=users[i][turn])
                if len(ids) < max_len:
                    nxt[i] = (ids, mask)
        pending = nxt
    return out
