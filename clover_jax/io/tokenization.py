"""Text in and out: a checkpoint's tokenizer, prompts encoded (plain or as a chat turn), and the ids
that end generation.

transformers is used for its tokenizers and chat templates only, never its PyTorch models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from clover_jax.errors import CloverError
from clover_jax.model.config import ModelConfig

# The tools use transformers for tokenizers and chat templates only, never its torch models: its advice,
# printed at import where torch is missing (as it is for users of the tools), is noise on every run.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(path: Path, chat_template: str | None = None):
    """`AutoTokenizer` from a local directory: no hub look-up, never `trust_remote_code`; with
    `chat_template` (a Jinja template's text), that template in place of the tokenizer's own."""
    from transformers import AutoTokenizer  # slow import: only text in and out needs it

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise CloverError(f"{path}: cannot load a tokenizer ({first})") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The text of `messages` under the tokenizer's chat template, or one error line: no template, or
    the template's own refusal (jinja2's raise_exception, e.g. a system turn Mistral's will not take)."""
    if not getattr(tokenizer, "chat_template", None):
        raise CloverError("chat=True: the tokenizer has no chat template; drop chat=True or use a chat model's "
                          "tokenizer", arguments=("chat",))
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template's own refusal
        hint = ("; it may take no system turn: drop system=, or the records' system turns"
                if any(m["role"] == "system" for m in messages) else "")
        raise CloverError(f"chat=True: the tokenizer's chat template refused the prompt: {e}{hint}",
                          arguments=("chat", "system")) from None


def chat_turns(text: str, system: str | None = None) -> list[dict]:
    """The messages a prompt becomes under --chat: a system turn when given, then the user's."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


def chat_messages(exchanges, user: str, system: str | None = None) -> list[dict]:
    """The messages of a conversation's (user, reply) exchanges then a new user turn, the system turn
    (when given) first."""
    messages: list[dict] = []
    for said, reply in exchanges:
        messages += chat_turns(said, None if messages else system) + [{"role": "assistant", "content": reply}]
    return messages + chat_turns(user, None if messages else system)


def check_system(chat: bool, system: str | None) -> None:
    """Refuse a system turn without chat: a system turn is a turn of the chat template."""
    if system is not None and not chat:
        raise CloverError("system= is a turn of the chat template; add chat=True", arguments=("system", "chat"))


def encode(tokenizer, text: str, chat: bool = False, bos_id: int | None = None,
           system: str | None = None) -> list[int]:
    """Token ids of a prompt, with the special tokens the tokenizer adds by default (Llama's BOS).

    With `chat`, the text is the user turn of the tokenizer's chat template (after a `system` turn
    when given), rendered with the assistant's opening; the template writes its own special tokens,
    so none are added on top. An empty prompt becomes [BOS] when there is one: the model needs at
    least one token.
    """
    check_system(chat, system)
    if chat:
        text = render_chat(tokenizer, chat_turns(text, system), add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos_id
        if bos is None:
            raise CloverError("the prompt is empty and the tokenizer has no BOS token to start from; give a prompt")
        ids = [int(bos)]
    return ids


def eos_ids(path: Path, cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: config.json's, generation_config.json's and the tokenizer's."""
    ids = set(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as e:
            raise CloverError(f"{gen}: cannot be read as JSON ({e})") from None
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(int(i) for i in ids))
