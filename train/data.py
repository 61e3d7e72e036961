"""The draft heads' training set, as written by `train.make_data`, read memory-mapped.

Batches are pure functions of (seed, step): example order is a fresh permutation per epoch drawn
from (seed, epoch), and each example's window from (seed, step), so a resumed run sees exactly the
batches it would have seen. The validation split is a hash of each example's index, so it does not
change with the seed or when examples are appended.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator, Sequence

import ml_dtypes
import numpy as np

from clover_jax import Llama
from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io.files import (allocated_bytes, atomic_path, check_free_space, preallocate, recover_dir, replace_dir,
                                 temporary_name, write_text)
from clover_jax.training import base_fingerprint

# The files `train.make_data` writes; meta.json is written last, so without it a dataset is unfinished.
FILES = ("tokens.npy", "offsets.npy", "loss_mask.npy", "hidden.npy", "features.npy")
META = "meta.json"
# make_data's hidden-state pass in progress: the arrays filled so far and how far (`hidden_states.store_hidden`).
PARTIAL = ("hidden.npy.partial", "features.npy.partial", "hidden-progress.json")
MAKERS = ("train.make_data", "train.merge_data")  # what a dataset's meta.json may say made it
HIDDEN_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def staging_dir(out: str | Path) -> Path:
    """Where the dataset for `out` is built before it takes out's place: the sibling OUT.building."""
    out = Path(out).resolve()
    return out.with_name(out.name + ".building")


def _check_ours(folder: Path, allowed: tuple[str, ...]) -> None:
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in allowed) if folder.is_dir() else []
    if foreign:
        raise CloverError(f"{folder}: holds {foreign[0]}, which is not part of a dataset; choose an empty or "
                          "new --out directory")


def prepare_dataset_dir(out: Path) -> Path:
    """Check that `out` may take a new dataset (refusing a folder that holds anything else) and return
    the folder to build it in (`staging_dir`), emptied of what a killed run left there. Nothing in `out`
    is removed: an old dataset stays whole, and in use, until `install_dataset` swaps the new one in, so a
    run refused, interrupted or out of space on the way leaves it as it was. An interrupted hidden-state
    pass (`PARTIAL`, kept in `out` beside the old set, where no reader takes it for dataset files) stays
    for make_data to resume."""
    cli.check_output_dir(out, "--out")
    out = Path(out).resolve()
    recover_dir(out)  # a swap killed between its two renames
    ours = (META,) + FILES + tuple(temporary_name(name).name for name in (META,) + FILES)
    _check_ours(out, ours + PARTIAL)
    staging = staging_dir(out)
    _check_ours(staging, ours)
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def install_dataset(staging: Path, out: Path) -> None:
    """Put the finished dataset in `staging` in `out`'s place, removing the old one (and what is left
    of the hidden-state pass) only now."""
    replace_dir(staging, Path(out).resolve())


def write_dataset(staging: Path, out: Path, tokens: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray,
                  meta: dict) -> None:
    """Write the arrays and meta.json (last) into `staging`, beside any hidden states already there,
    and swap the finished dataset into `out` (`install_dataset`)."""
    save_array(staging / "tokens.npy", tokens)
    save_array(staging / "offsets.npy", offsets)
    save_array(staging / "loss_mask.npy", loss_mask)
    write_text(staging / META, json.dumps(meta, indent=2) + "\n")
    install_dataset(staging, out)


def dataset_bytes(num_tokens: int, num_examples: int, hidden_row_bytes: int = 0) -> int:
    """The bytes of a dataset's files: tokens, loss mask and offsets, and `hidden_row_bytes` of hidden
    states (and features) per token."""
    return num_tokens * (4 + 1 + hidden_row_bytes) + 8 * (num_examples + 1) + (1 << 16)


def check_dataset_room(out: Path, need: int) -> str:
    """Refuse, before the dataset is written, one of `need` bytes that out's file system has no room for
    (an interrupted hidden-state pass's files are counted as room: they are reused or replaced); returns
    the note `files.space_errors` gives a full disk met later anyway."""
    out = Path(out).resolve()
    note = " for the new dataset" + (" (the old one stays until the new one is whole)" if (out / META).is_file()
                                     else "")
    check_free_space(out.parent, need - sum(allocated_bytes(out / name) for name in PARTIAL), note)
    return note


def new_memmap(path: Path, dtype, shape: tuple[int, ...]) -> np.memmap:
    """A new .npy file at `path` of `shape`, memory-mapped for writing, with its blocks allocated up
    front (`files.preallocate`): a full disk is an error here, not a SIGBUS mid-pass."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    preallocate(path)
    return array


def save_array(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: np.save would add .npy to a name
        np.save(f, array)


def _index_hash(indices: np.ndarray) -> np.ndarray:
    """splitmix64 of each index, as a uniform float in [0, 1)."""
    with np.errstate(over="ignore"):
        z = indices.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class HeadDataset:
    """Examples e = tokens[offsets[e]:offsets[e + 1]], with loss mask, optional hidden states [N, D] and
    optional inner-layer outputs [N, F, D] (the layers `feature_layers` names)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CloverError(f"{self.path}: no such dataset directory; make one with train.make_data")
        meta_path = self.path / META
        if not meta_path.is_file():
            raise CloverError(f"{self.path}: not a dataset made by train.make_data (no meta.json)")
        try:
            self.meta = json.loads(meta_path.read_text())
            if self.meta.get("created_by") not in MAKERS:
                raise KeyError("created_by")
            self.vocab_size = int(self.meta["vocab_size"])
            self.hidden_size = int(self.meta["hidden_size"])
            hidden_dtype = self.meta["hidden_dtype"]
            self.feature_layers = tuple(int(i) for i in self.meta.get("feature_layers") or ())
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CloverError(f"{meta_path}: not a meta.json written by train.make_data ({e})") from None
        self.tokens = self._load("tokens.npy", np.int32)  # [N]
        self.offsets = self._load("offsets.npy", np.int64)  # [E + 1]
        self.loss_mask = self._load("loss_mask.npy", np.uint8)  # [N]
        self.hidden = None  # [N, D] float16 / bfloat16, or None
        if hidden_dtype is not None:
            if hidden_dtype not in HIDDEN_DTYPES:
                raise CloverError(f"{meta_path}: unknown hidden_dtype {hidden_dtype!r}")
            raw = self._load("hidden.npy", None)
            self.hidden = raw.view(HIDDEN_DTYPES[hidden_dtype])  # bfloat16 is stored as raw 2-byte records
        self.features = None  # [N, F, D] in the hidden states' dtype, or None
        if self.feature_layers:
            if hidden_dtype is None:
                raise CloverError(f"{meta_path}: feature_layers without hidden states; rerun train.make_data")
            self.features = self._load("features.npy", None).view(HIDDEN_DTYPES[hidden_dtype])
        self._validate()
        self._perm: tuple[tuple[int, int, int], np.ndarray] | None = None

    def _load(self, name: str, dtype) -> np.ndarray:
        file = self.path / name
        if not file.is_file():
            raise CloverError(f"{self.path}: the dataset lacks {name}; rerun train.make_data")
        try:
            array = np.load(file, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise CloverError(f"{file}: not a readable .npy file ({e})") from None
        if dtype is not None and array.dtype != dtype:
            raise CloverError(f"{file}: dtype {array.dtype}, expected {np.dtype(dtype)}; rerun train.make_data")
        return array

    def _validate(self) -> None:
        n, off = len(self.tokens), self.offsets
        if len(off) < 2:
            raise CloverError(f"{self.path}: empty dataset (no examples); rerun train.make_data with some prompts")
        if off[0] != 0 or off[-1] != n or np.any(np.diff(off) <= 0) or len(self.loss_mask) != n:
            raise CloverError(f"{self.path}: offsets.npy, tokens.npy and loss_mask.npy disagree; the dataset is "
                              "damaged, rerun train.make_data")
        if self.meta.get("num_examples") != self.num_examples or self.meta.get("num_tokens") != n:
            raise CloverError(f"{self.path}: meta.json does not describe these files; rerun train.make_data")
        if self.hidden is not None and self.hidden.shape != (n, self.hidden_size):
            raise CloverError(f"{self.path}: hidden.npy has shape {list(self.hidden.shape)}, expected "
                              f"{[n, self.hidden_size]}; rerun train.make_data")
        want = (n, len(self.feature_layers), self.hidden_size)
        if self.features is not None and self.features.shape != want:
            raise CloverError(f"{self.path}: features.npy has shape {list(self.features.shape)}, expected "
                              f"{list(want)}; rerun train.make_data")
        lo, hi = int(self.tokens.min()), int(self.tokens.max())
        if lo < 0 or hi >= self.vocab_size:
            raise CloverError(f"{self.path}: token id {hi if hi >= self.vocab_size else lo} is outside the "
                              f"vocabulary of {self.vocab_size}; the dataset is damaged, rerun train.make_data")
        self.max_id = hi

    @property
    def num_examples(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.num_examples

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per example [E]."""
        return np.diff(self.offsets)

    def example_mask(self, indices: Sequence[int]) -> np.ndarray:
        """[N] uint8: 1 on the tokens of the given examples."""
        mask = np.zeros(len(self.tokens), np.uint8)
        for e in indices:
            mask[self.offsets[e]: self.offsets[e + 1]] = 1
        return mask

    def check_base(self, base: Llama) -> None:
        """Refuse a base model other than the one the dataset (and its hidden states) came from."""
        mine = self.meta.get("base_fingerprint")
        if base_fingerprint(base) != mine:
            raise CloverError(f"{self.path}: this dataset was made with another base model (fingerprint {mine}); "
                              "make the data with this model (train.make_data --base)")

    def check_vocab(self, vocab_size: int) -> None:
        if vocab_size != self.vocab_size or self.max_id >= vocab_size:
            raise CloverError(f"{self.path}: the dataset's vocabulary has {self.vocab_size} ids (largest used "
                              f"{self.max_id}) but the model's has {vocab_size}; make the data with this model")

    def _window(self, e: int, seq_len: int, rng: np.random.Generator | None) -> int:
        """Start of example e's window of `seq_len` tokens: 0 when it fits; else one that holds response
        tokens, drawn from `rng`, or (rng None) the one ending at the last response token."""
        length = int(self.offsets[e + 1] - self.offsets[e])
        if length <= seq_len:
            return 0
        response = np.flatnonzero(self.loss_mask[self.offsets[e]: self.offsets[e + 1]])
        if not len(response):
            return 0 if rng is None else int(rng.integers(0, length - seq_len + 1))
        lo, hi = max(0, int(response[0]) - seq_len + 1), min(length - seq_len, int(response[-1]))
        if rng is None:
            return max(lo, min(hi, int(response[-1]) - seq_len + 1))
        return int(rng.integers(lo, hi + 1))

    def _gather(self, examples: Sequence[int], starts: Sequence[int], batch_size: int, seq_len: int) -> dict:
        """Rows [B, T] of the given windows, right-padded with token 0 and mask 0; missing rows all padding."""
        tokens = np.zeros((batch_size, seq_len), np.int32)
        mask = np.zeros((batch_size, seq_len), np.float32)
        positions = np.zeros((batch_size, seq_len), np.int32)
        lengths = np.zeros((batch_size,), np.int32)
        hidden = None if self.hidden is None else np.zeros((batch_size, seq_len, self.hidden_size), self.hidden.dtype)
        features = None if self.features is None else np.zeros((batch_size, seq_len) + self.features.shape[1:],
                                                                self.features.dtype)
        for row, (e, s) in enumerate(zip(examples, starts)):
            a = int(self.offsets[e]) + s
            b = min(a + seq_len, int(self.offsets[e + 1]))
            n = b - a
            tokens[row, :n] = self.tokens[a:b]
            mask[row, :n] = self.loss_mask[a:b]
            positions[row, :n] = np.arange(s, s + n)
            lengths[row] = n
            if hidden is not None:
                hidden[row, :n] = self.hidden[a:b]
            if features is not None:
                features[row, :n] = self.features[a:b]
        return {"tokens": tokens, "loss_mask": mask, "lengths": lengths, "positions": positions, "hidden": hidden,
                "features": features}

    def _epoch_order(self, seed: int, epoch: int, n: int) -> np.ndarray:
        key = (seed, epoch, n)
        if self._perm is None or self._perm[0] != key:
            self._perm = (key, np.random.default_rng([seed, 0, epoch]).permutation(n))
        return self._perm[1]

    def _indices(self, indices: Sequence[int] | None) -> np.ndarray:
        out = np.arange(self.num_examples) if indices is None else np.asarray(indices, np.int64)
        if out.ndim != 1 or not len(out):
            raise CloverError("no examples to draw batches from (an empty split); lower the validation fraction")
        if out.min() < 0 or out.max() >= self.num_examples:
            raise CloverError(f"example index out of range for a dataset of {self.num_examples} examples")
        return out

    def batch_at(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
                 indices: Sequence[int] | None = None) -> dict:
        """The training batch of `step`, a pure function of (seed, step) (and `indices`, default all).

        Returns tokens [B, T] int32, loss_mask [B, T] float32 (1 on response tokens), lengths [B] int32
        (real tokens per row; the rest is right padding with token 0 and mask 0), positions [B, T] int32
        (each token's position in its example), hidden [B, T, D] (stored dtype) or None and features
        [B, T, F, D] (stored dtype) or None. Step s takes
        entries s*B .. s*B+B-1 of the endless sequence of per-epoch permutations of `indices`; an example
        longer than T gives a random window holding some of its response.
        """
        if step < 0 or seed < 0 or batch_size < 1 or seq_len < 1:
            raise CloverError("step and seed must be >= 0, batch size and sequence length >= 1")
        pool = self._indices(indices)
        n = len(pool)
        picks = [(step * batch_size + k) for k in range(batch_size)]
        examples = [int(pool[self._epoch_order(seed, p // n, n)[p % n]]) for p in picks]
        rng = np.random.default_rng([seed, 1, step])
        starts = [self._window(e, seq_len, rng) for e in examples]
        return self._gather(examples, starts, batch_size, seq_len)

    def split(self, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(train indices, validation indices): an example is held out when the hash of its index falls
        under the fraction; a positive fraction holds out at least one example."""
        if not 0 <= validation_fraction < 1:
            raise CloverError(f"validation fraction {validation_fraction} must be in [0, 1)")
        idx = np.arange(self.num_examples)
        u = _index_hash(idx)
        val = u < validation_fraction
        if validation_fraction > 0 and not val.any():
            val[np.argmin(u)] = True
        if val.all():
            raise CloverError(f"{self.path}: validation fraction {validation_fraction} leaves no training "
                              f"examples out of {self.num_examples}; lower it or make more data")
        return idx[~val], idx[val]

    def eval_batches(self, seq_len: int, batch_size: int, indices: Sequence[int] | None = None) -> Iterator[dict]:
        """Every example of `indices` once, in order, as `batch_at`'s batches with a fixed window per
        example (the one ending at its last response token); the last batch is padded with empty rows
        (mask 0, length 0) so every batch has one shape."""
        if batch_size < 1 or seq_len < 1:
            raise CloverError("batch size and sequence length must be >= 1")
        if indices is not None and not len(indices):
            return
        pool = self._indices(indices)
        for i in range(0, len(pool), batch_size):
            examples = [int(e) for e in pool[i: i + batch_size]]
            yield self._gather(examples, [self._window(e, seq_len, None) for e in examples], batch_size, seq_len)
