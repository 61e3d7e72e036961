"""The training corpus: the running interpreter's standard library `.py` sources.

Every machine that runs this project has them, nobody here wrote them, and they are real, varied
code with docstrings, so the reference model (`models/reference`) trains on them. The split is by file
(a stable SHA-1 of the relative path), so held-out loss and evaluation prompts come from files the
model never saw, and it is the same on every machine with the same Python version.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import sys
import sysconfig
from typing import Iterable

import numpy as np
from tqdm import tqdm

from clover_jax.errors import CloverError
from clover_jax.io.files import atomic_path, write_text

SPLITS = ("train", "validation", "test")
MAX_FILE_BYTES = 300_000  # a few generated tables (pydoc_data/topics.py) would dominate the corpus
EOS_TOKEN = "<|endoftext|>"

# Directory names never descended into: other people's packages, test suites and their data, build
# leftovers. Test code is excluded so the held-out files are not near-copies of training files.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "test", "tests",
              "idle_test"}
_CHARMAP_TABLE = re.compile(rb"^decoding_(table|map) = ", re.MULTILINE)


def stdlib_root() -> pathlib.Path:
    """The directory of the running interpreter's standard library, from `sysconfig`."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CloverError(f"standard library directory {root} not found; is this a full Python install?")
    return root


def _keep_dir(name: str) -> bool:
    # config-3.X-<platform> holds the build's python-config.py, not library code.
    return name not in _SKIP_DIRS and not name.startswith("config-")


def _keep_file(path: pathlib.Path) -> bool:
    # _sysconfigdata_*.py is generated per build (paths, compiler flags): not portable, not prose.
    if path.name.startswith("_sysconfigdata_") or path.stat().st_size > MAX_FILE_BYTES:
        return False
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    # The ~70 generated charmap codecs (encodings/cp037.py, ...) are one template around a table of
    # hex escapes: 10% of the bytes, and near-copies of each other across the split.
    return _CHARMAP_TABLE.search(data) is None


def list_files(root: pathlib.Path | None = None) -> list[str]:
    """All corpus files as sorted relative POSIX paths (e.g. "json/decoder.py") under `root`."""
    root = stdlib_root() if root is None else pathlib.Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if _keep_dir(d))
        for name in filenames:
            path = pathlib.Path(dirpath, name)
            if name.endswith(".py") and _keep_file(path):
                found.append(path.relative_to(root).as_posix())
    if not found:
        raise CloverError(f"no .py files found under {root}; is the standard library source installed?")
    return sorted(found)


def _bucket(rel: str) -> int:
    """A stable bucket in [0, 100) from the path alone (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha1(rel.encode("utf-8")).digest()[:8], "big") % 100


def split_files(files: Iterable[str]) -> dict[str, list[str]]:
    """Split relative paths 90/5/5 into "train"/"validation"/"test" by file; each list sorted."""
    out: dict[str, list[str]] = {name: [] for name in SPLITS}
    for rel in sorted(files):
        b = _bucket(rel)
        out["train" if b < 90 else "validation" if b < 95 else "test"].append(rel)
    return out


def write_split(out_dir: str | os.PathLike) -> pathlib.Path:
    """Write `split.json` (root, Python version, file lists) into `out_dir` so the split can be redone."""
    out = pathlib.Path(out_dir)
    record = {"stdlib": str(stdlib_root()), "python": sys.version.split()[0], **split_files(list_files())}
    path = out / "split.json"
    write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def read_text(rel: str, root: pathlib.Path | None = None) -> str:
    """One file's exact text: decoded from bytes, so CRLF and trailing whitespace survive."""
    root = stdlib_root() if root is None else pathlib.Path(root)
    try:
        return (root / rel).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"cannot read corpus file {rel} under {root}: {e}") from None


def load_tokenizer(tokenizer):
    """A `tokenizers.Tokenizer` from an object, a tokenizer.json path, or a directory holding one."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    path = pathlib.Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise CloverError(f"tokenizer file {path} not found; train one with `python -m train.tokenizer --out DIR`")
    return Tokenizer.from_file(str(path))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the memory of a token stream whenever every id fits in it."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def encode_split(tokenizer, files: list[str], eos_id: int, batch_files: int = 64,
                 root: pathlib.Path | None = None) -> np.ndarray:
    """Tokenize `files` into one stream [tokens], each document followed by `eos_id`.

    EOS after every file (not only between) marks where each document ends, so the model learns to
    stop and a context that starts right after an EOS looks like the start of a file. No BOS is
    inserted. Files are encoded in batches to use the Rust tokenizer's threads without holding every
    `Encoding` (offsets, masks) in memory at once. dtype: `token_dtype(vocab size)`.
    """
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.get_vocab_size())
    pieces = []
    for start in tqdm(range(0, len(files), batch_files), desc="encode", unit="batch", leave=False):
        texts = [read_text(rel, root) for rel in files[start:start + batch_files]]
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=dtype))
            pieces.append(np.asarray([eos_id], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros((0,), dtype)


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()[:12]


def load_or_encode(data_dir: str | os.PathLike, tokenizer_json: str | os.PathLike, split: str) -> np.ndarray:
    """`encode_split` for one named split, cached as .npy under `data_dir`.

    The cache name carries digests of the tokenizer file and of the file list, so a retrained
    tokenizer or another Python version never reads a stale stream.
    """
    if split not in SPLITS:
        raise CloverError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    tok_path = pathlib.Path(tokenizer_json)
    if tok_path.is_dir():
        tok_path = tok_path / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise CloverError(f"tokenizer {tok_path} has no {EOS_TOKEN} token; retrain it with train.tokenizer")
    files = split_files(list_files())[split]
    key = f"{_digest(tok_path.read_bytes())}-{_digest(chr(10).join(files).encode())}"
    cache = pathlib.Path(data_dir) / f"{split}-{key}.npy"
    if cache.is_file():
        return np.load(cache, allow_pickle=False)
    tokens = encode_split(tok, files, eos_id)
    with atomic_path(cache) as tmp, open(tmp, "wb") as f:  # a killed run leaves no truncated cache
        np.save(f, tokens, allow_pickle=False)
    return tokens
