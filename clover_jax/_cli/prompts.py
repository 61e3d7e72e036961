"""Prompt files: JSONL records with a `prompt`, Spec-Bench `turns` or ShareGPT `conversations`, read
with where each came from (for one-line errors), and encoded for a batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from clover_jax._cli import datasets
from clover_jax.errors import CloverError
from clover_jax.io import sources
from clover_jax.io.tokenization import encode


def first_prompt(record, where: str) -> str:
    """The prompt of one record: {"prompt"}, Spec-Bench {"turns"} (first turn) or ShareGPT
    {"conversations"} (first human turn)."""
    if isinstance(record, dict):
        if isinstance(record.get("prompt"), str):
            return record["prompt"]
        turns = record.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
        conv = record.get("conversations")
        if isinstance(conv, list):
            for turn in conv:
                if isinstance(turn, dict) and turn.get("from") in ("human", "user") \
                        and isinstance(turn.get("value"), str):
                    return turn["value"]
    raise CloverError(f"{where}: no prompt found; expected {{\"prompt\": ...}}, Spec-Bench {{\"turns\": [...]}} "
                      "or ShareGPT {\"conversations\": [{\"from\": \"human\", \"value\": ...}]}")


def read_records(path: str | Path) -> list[tuple[dict, str]]:
    """(record, where) for each record of a JSONL file (one per line) or a JSON array (ShareGPT's usual
    form), of standard input for "-", or of a named source (`sharegpt`, `mt-bench`: `datasets.named_records`);
    `where` names the record ("file:line") in error messages."""
    if sources.is_named(path) and not Path(path).exists():
        if sources.is_named(path, "model"):
            raise CloverError(f"{path} is a model, not a prompts or data source; named ones: "
                              f"{', '.join(n for n, s in sources.SOURCES.items() if s.kind != 'model')}")
        return datasets.named_records(str(path))
    stdin = str(path) == "-"
    name = "stdin" if stdin else str(path)
    try:
        text = sys.stdin.read() if stdin else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"{name}: cannot read the prompts file ({e.__class__.__name__}: {e})") from None
    if text.lstrip().startswith("["):
        try:
            records = [(r, f"{name}: record {i + 1}") for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise CloverError(f"{name}: not valid JSON ({e})") from None
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((json.loads(line), f"{name}:{n}"))
                except json.JSONDecodeError as e:
                    raise CloverError(f"{name}:{n}: not a JSON object ({e})") from None
    if not records:
        raise CloverError(f"{name}: no prompts in the file")
    return records


def record_system(record) -> str | None:
    """A record's own system turn: a top-level "system" string, or a ShareGPT {"from": "system"} turn."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("system"), str):
        return record["system"]
    conv = record.get("conversations")
    for turn in conv if isinstance(conv, list) else ():
        if isinstance(turn, dict) and turn.get("from") == "system" and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


def prompt_turns(records: list[tuple[dict, str]]) -> list[tuple[str, str | None]]:
    """(text, the record's own system turn or None) per (record, where) of `read_records`."""
    return [(first_prompt(record, where), record_system(record)) for record, where in records]


def read_prompt_turns(path: str | Path) -> list[tuple[str, str | None]]:
    """`prompt_turns` of a prompts file (see `read_records`, and `first_prompt` for the record formats)."""
    return prompt_turns(read_records(path))


def read_prompts(path: str | Path) -> list[str]:
    """The prompt texts of a prompts file (`read_prompt_turns` without the system turns)."""
    return [text for text, _ in read_prompt_turns(path)]


def default_prompts(model, path: Path) -> str | Path:
    """The prompts a benchmark asks by default: prompts.jsonl beside the checkpoint `path`, or for a named
    model (--model's value) in the project's folder for it (`sources.shipped_dir`: gemma3's, plain text
    for a base model); a named model without one is a chat model, asked MT-Bench's questions (`mt-bench`).
    None found is one error line."""
    own = (sources.shipped_dir(model) or Path(path)) / "prompts.jsonl"
    if own.is_file():
        return own
    if sources.is_named(model, "model"):
        return "mt-bench"
    raise CloverError(f"no prompts file at {own}; pass --prompts FILE")


def prompt_system(own: str | None, chat: bool, system: str | None) -> str | None:
    """The system turn a prompt is rendered with: under --chat its record's own when it has one (the
    conversation was written under it), else --system; without --chat there are no turns to keep."""
    return own if chat and own is not None else system


def encode_prompts(tokenizer, prompts: list[tuple[str, str | None]], chat: bool, system: str | None,
                   bos_id: int | None) -> list[list[int]]:
    """Token ids of `read_prompt_turns`' (text, own system) pairs under --chat and --system (`encode`)."""
    return [encode(tokenizer, text, chat=chat, bos_id=bos_id, system=prompt_system(own, chat, system))
            for text, own in prompts]
