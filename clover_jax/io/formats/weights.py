"""The tensors of a published drafter: safetensors read as they are; a pickle only through its
converted copy.

Many drafters are published only as pickles (`pytorch_model.bin`, `.pt`), and unpickling runs whatever
code the file names. They are never unpickled here: `python -m infer.convert_pickle FOLDER` loads one
once with PyTorch's weights-only loader (tensors and plain containers; no code from the file runs) and
writes the tensors as safetensors into the cache, keyed by the pickle's sha256; later loads of that
folder read the converted copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from clover_jax.errors import CloverError
from clover_jax.io.files import sha256
from clover_jax.io.sources import PICKLE_SUFFIXES, cache_root


def converted_dir() -> Path:
    """Where converted pickles live: the cache's `converted/` folder, one file per pickle's sha256."""
    return cache_root() / "converted"


def converted_path(pickle: Path) -> Path:
    """The safetensors copy `convert_pickle` writes for `pickle` (which may not exist yet)."""
    return converted_dir() / f"{sha256(pickle)}.safetensors"


def find_weights(folder: Path, names: tuple[str, ...]) -> Path | None:
    """The first of `names` in `folder` as a safetensors file to read: the file itself, or for a pickle
    its converted copy; None when none of the names is there. A pickle not yet converted is one line
    saying how to convert it."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        if path.suffix in PICKLE_SUFFIXES:
            copy = converted_path(path)
            if not copy.is_file():
                raise CloverError(f"{path}: a pickle, which is never unpickled by default; convert it once with "
                                  f"python -m infer.convert_pickle {folder} (weights only: no code from the file runs)")
            return copy
        return path
    return None


def read_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Every tensor of the first of `names` found in `folder` (see `find_weights`); a sharded checkpoint
    (`model.safetensors.index.json` among the names) is read whole. One line when none is there or a file
    cannot be read."""
    from safetensors.numpy import load_file

    index = folder / "model.safetensors.index.json"
    if "model.safetensors.index.json" in names and index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CloverError(f"{index}: not a valid safetensors index ({e})") from None
        paths = [folder / f for f in files]
    else:
        path = find_weights(folder, tuple(n for n in names if n != "model.safetensors.index.json"))
        if path is None:
            raise CloverError(f"{folder}: no weights file ({', '.join(names)})")
        paths = [path]
    tensors = {}
    for path in paths:
        try:
            tensors.update(load_file(str(path)))
        except Exception as e:  # safetensors' own error types for missing or damaged files
            raise CloverError(f"{path}: cannot read the weights ({e})") from None
    return tensors


def read_config(folder: Path, strict: bool = True) -> dict:
    """folder/config.json as a dict ({} when absent; unreadable: one line when `strict`, else {})."""
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        if strict:
            raise CloverError(f"{path}: not valid JSON ({e})") from None
        return {}
    if not isinstance(config, dict):
        if strict:
            raise CloverError(f"{path}: not a JSON object")
        return {}
    return config
