"""The base model's self-distilled answers, kept as they accumulate so a long run resumes where it stopped.

Self-distilling a real data set takes hours on a CPU (SmolLM2 over ShareGPT: about 280K answer tokens
an hour on two cores), longer than a session or a machine may last. `train.make_data --answers DIR`
therefore answers its records in chunks, and writes each finished chunk to DIR as one small compressed
shard: per record its example's token ids (the conversation with the model's answers, as make_data
stores it) and the spans of the loss mask. A rerun with the same settings loads the finished shards and
answers only the rest; the shards are small enough to commit beside the model (a few MB per million
tokens), and the hidden states are recomputed from them, never stored there.

  answers.json                 the settings the answers were made with (a rerun must match them)
  answers-000000.jsonl.gz ...  one shard per chunk of records, named by its first record's index;
                               a line: {"record": i, "ids": [...], "spans": [[start, end], ...]}
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from clover_jax.errors import CloverError
from clover_jax.io.files import atomic_path, write_text

MANIFEST = "answers.json"


def shard_name(start: int) -> str:
    return f"answers-{start:06d}.jsonl.gz"


def mask_spans(mask: list[int]) -> list[list[int]]:
    """[start, end) runs of 1s in a loss mask."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


def spans_mask(spans: list[list[int]], length: int) -> list[int]:
    mask = [0] * length
    for a, b in spans:
        mask[a:b] = [1] * (b - a)
    return mask


class AnswerStore:
    """A folder of answer shards made with one set of settings (`settings`, a JSON-able dict)."""

    def __init__(self, folder: str | Path, settings: dict):
        self.folder = Path(folder)
        manifest = self.folder / MANIFEST
        if manifest.is_file():
            try:
                saved = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise CloverError(f"{manifest}: cannot be read as JSON ({e}); remove the folder or fix it") from None
            changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
            if changed:
                k = changed[0]
                raise CloverError(f"--answers {self.folder}: its answers were made with {k}={saved.get(k)!r}, this run "
                                  f"asks {k}={settings.get(k)!r}; rerun with the same settings to resume, or give "
                                  "another --answers folder")
        else:
            if self.folder.exists() and any(self.folder.iterdir()):
                raise CloverError(f"--answers {self.folder}: holds files but no {MANIFEST}; give an empty or new folder")
            self.folder.mkdir(parents=True, exist_ok=True)
            write_text(manifest, json.dumps(settings, indent=2) + "\n")
        self.settings = settings
        self.chunk = int(settings["chunk"])

    def load(self, start: int) -> dict[int, tuple[list[int], list[int]]] | None:
        """record index -> (ids, loss mask) of the chunk starting at `start`, or None when not yet made."""
        path = self.folder / shard_name(start)
        if not path.is_file():
            return None
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return {int(r["record"]): (r["ids"], spans_mask(r["spans"], len(r["ids"]))) for r in rows}
        except (OSError, EOFError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CloverError(f"{path}: a damaged answer shard ({e.__class__.__name__}); delete it and rerun to "
                              "answer its records again") from None

    def save(self, start: int, examples: dict[int, tuple[list[int], list[int]]]) -> None:
        """Write one chunk's examples, whole or not at all."""
        with atomic_path(self.folder / shard_name(start)) as tmp:
            # mtime=0: the same answers give the same bytes, so a committed shard does not churn.
            with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
                for i in sorted(examples):
                    ids, mask = examples[i]
                    line = json.dumps({"record": i, "ids": [int(t) for t in ids], "spans": mask_spans(mask)},
                                      separators=(",", ":"))
                    f.write((line + "\n").encode("utf-8"))
