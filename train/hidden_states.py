"""The base model's hidden states at every token of a dataset, for `train.make_data --store-hidden`.

One causal forward per example gives the last layer's output before the final norm ([N, D], hidden.npy)
and, with `--store-features`, the low, middle and high layers' outputs EAGLE-3 drafts from ([N, 3, D],
features.npy). The pass fills its arrays in place under `train.data.PARTIAL` names in the output folder,
recording every SAVE_EVERY_S how many batches are done, so a killed run resumes from that record.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from clover_jax import BUCKETS, Llama
from clover_jax import _cli as cli
from clover_jax.engine.decode import bucket_for
from clover_jax.errors import CloverError
from clover_jax.io.files import preallocate, write_text
from clover_jax.training import causal_self_mask, put_batch, to_host
from train.data import HIDDEN_DTYPES, PARTIAL, new_memmap

SAVE_EVERY_S = 60.0  # how often the hidden-state pass records how far it got


@functools.partial(jax.jit, static_argnums=0, static_argnames=("dtype", "feature_layers"))
def _last_hidden(graphdef, params, tokens: jax.Array, *, dtype: str, feature_layers: tuple[int, ...] = ()):
    """tokens [B, T] -> (the last layer's output before the final norm [B, T, D], the outputs of
    `feature_layers` [B, T, F, D] or None), cast to `dtype`."""
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = model(tokens, positions, causal_self_mask(b, t), with_logits=False, feature_layers=feature_layers,
                causal=True)
    return out.hidden.astype(dtype), None if out.features is None else out.features.astype(dtype)


BUCKET_STEP = 256


def data_buckets(max_len: int, lengths: Sequence[int] | None = None) -> tuple[int, ...]:
    """The lengths a batch is padded to, in the hidden-state pass and when answering a turn: `lengths`
    (`--buckets`) under `max_len`, then `max_len`; by default the decoder's buckets to BUCKET_STEP, then
    every BUCKET_STEP tokens, then `max_len`. Long conversations are most of the tokens, and padded to
    powers of two a 1,100-token batch would run as 2,048 (SmolLM2's forward, 8 x 1,280 tokens 53 s
    against 96 s at 2,048 on a 2-core CPU) and decode over a cache that long. Each length is one program
    per batch size, compiled once and kept by the compile cache: on a GPU compiling SmolLM2's forward
    costs more than running it, so fewer lengths pay there."""
    if lengths is not None:
        return tuple(sorted({b for b in lengths if b < max_len})) + (max_len,)
    short = [b for b in BUCKETS if b < min(BUCKET_STEP, max_len)]
    return tuple(short + list(range(BUCKET_STEP, max_len, BUCKET_STEP)) + [max_len])


def check_finite(hidden: np.ndarray, feats: np.ndarray | None, group, lengths, dtype) -> None:
    """One line when a batch's stored values are not finite: float16 holds at most 65,504, and a base
    model whose residual stream runs larger (Gemma 3's does) would otherwise write inf into the data and
    train every method into a NaN loss."""
    for name, values in (("hidden states", hidden), ("feature layers' outputs", feats)):
        if values is not None and not all(np.isfinite(values[row, : lengths[e]]).all() for row, e in enumerate(group)):
            hint = (" (its largest value is 65504): store them as --store-hidden bfloat16, which has float32's range"
                    if dtype == np.float16 else "")
            raise CloverError(f"the base model's {name} are not finite as {dtype.name}{hint}")


def write_hidden(model: Llama, tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray, batch_size: int,
                 max_len: int, mesh=None, features: np.ndarray | None = None,
                 feature_layers: tuple[int, ...] = (), start: int = 0,
                 on_batch: Callable[[int], None] | None = None, buckets: Sequence[int] | None = None) -> None:
    """Fill `out` [N, D] with the hidden state at every token, one causal forward per example, and
    `features` [N, F, D] (given with `feature_layers`) with the outputs of those layers from the same forward.

    Examples go through in order of length, right-padded to a length bucket (`buckets`, default
    `data_buckets(max_len)`) in batches of a fixed size; right padding changes nothing at the real
    positions. The first `start` batches are taken as done (a resumed pass); `on_batch(batches done)`
    follows each."""
    graphdef, params = nnx.split(model)
    buckets = data_buckets(max_len) if buckets is None else buckets
    lengths = np.diff(offsets)
    order = np.argsort(lengths, kind="stable")
    groups = cli.batches(order, batch_size)
    for done, group in enumerate(tqdm(groups[start:], desc="hidden states", unit="batch", dynamic_ncols=True,
                                      initial=start, total=len(groups)), start + 1):
        t = bucket_for(int(lengths[group].max()), buckets)
        batch = np.zeros((batch_size, t), np.int32)
        for row, e in enumerate(group):
            batch[row, : lengths[e]] = tokens[offsets[e]: offsets[e + 1]]
        batch = jnp.asarray(batch) if mesh is None else put_batch(batch, mesh)
        hidden, feats = _last_hidden(graphdef, params, batch, dtype=out.dtype.name, feature_layers=feature_layers)
        hidden, feats = to_host(hidden), None if feats is None else to_host(feats)
        check_finite(hidden, feats, group, lengths, out.dtype)
        for row, e in enumerate(group):
            out[offsets[e]: offsets[e + 1]] = hidden[row, : lengths[e]]
            if features is not None:
                features[offsets[e]: offsets[e + 1]] = feats[row, : lengths[e]]
        if on_batch is not None:
            on_batch(done)


def open_partial(out: Path, key: str, shapes: list[tuple[int, ...]], dtype) -> tuple[list[np.ndarray], int]:
    """The hidden-state pass's arrays, memory-mapped under their PARTIAL names in `out`, and the batches
    already done: an interrupted pass's, when its record names the same `key` (same examples, model and
    settings) and its arrays are whole; else new ones, none done."""
    paths, record = [out / name for name in PARTIAL[: len(shapes)]], out / PARTIAL[2]
    try:
        saved = json.loads(record.read_text())
        if saved["key"] == key:
            for p in paths:  # blocks for a pass that a sparse file was started for
                preallocate(p)
            arrays = [np.lib.format.open_memmap(p, mode="r+") for p in paths]
            # bfloat16 comes back as the raw 2-byte records .npy stores it as
            arrays = [a.view(dtype) if a.dtype.kind == "V" and a.dtype.itemsize == dtype.itemsize else a
                      for a in arrays]
            if all(a.shape == s and a.dtype == dtype for a, s in zip(arrays, shapes)):
                return arrays, int(saved["done"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    record.unlink(missing_ok=True)
    return [new_memmap(p, dtype, s) for p, s in zip(paths, shapes)], 0


def store_hidden(model: Llama, tokens: np.ndarray, offsets: np.ndarray, out: Path, staging: Path, dtype_name: str,
                 feature_layers: tuple[int, ...], fingerprint: str, args, max_len: int, mesh=None,
                 buckets: Sequence[int] | None = None) -> None:
    """hidden.npy (and features.npy) in `staging`, resumable: the arrays fill in place under PARTIAL names in `out`, and
    every SAVE_EVERY_S the batches done so far are recorded (after a flush), so a killed run picks up at
    its last record rather than from the start (SmolLM2's 800 longest ShareGPT conversations take two
    hours on a 2-core CPU). Renamed into place when whole."""
    d = model.cfg.hidden_size
    shapes = [(len(tokens), d)] + ([(len(tokens), len(feature_layers), d)] if feature_layers else [])
    settings = [fingerprint, dtype_name, list(feature_layers), args.batch_size, max_len, args.dtype]
    if buckets is not None:  # other padding, other float rounding: a pass resumes under its own buckets only
        settings.append(list(buckets))
    digest = hashlib.sha256(json.dumps(settings).encode())
    for array in (tokens, offsets):
        digest.update(np.ascontiguousarray(array).tobytes())
    key = digest.hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    arrays, start = open_partial(out, key, shapes, HIDDEN_DTYPES[dtype_name])
    if start:
        print(f"resuming the hidden states after batch {start}, where an earlier run stopped", file=sys.stderr)
    last = time.monotonic()

    def checkpoint(done: int) -> None:
        nonlocal last
        if time.monotonic() - last >= SAVE_EVERY_S:
            for array in arrays:
                array.flush()
            write_text(out / PARTIAL[2], json.dumps({"key": key, "done": done}) + "\n")
            last = time.monotonic()

    try:
        write_hidden(model, tokens, offsets, arrays[0], args.batch_size, max_len, mesh,
                     arrays[1] if feature_layers else None, feature_layers, start=start, on_batch=checkpoint,
                     buckets=buckets)
    except CloverError:  # values this dtype cannot hold: no rerun resumes such a pass, so none is kept
        arrays.clear()
        for name in PARTIAL:
            (out / name).unlink(missing_ok=True)
        raise
    for array in arrays:
        array.flush()
    arrays.clear()  # the maps closed before their files are renamed
    staging.mkdir(parents=True, exist_ok=True)
    for partial, name in zip(PARTIAL[: len(shapes)], ("hidden.npy", "features.npy")):
        os.replace(out / partial, staging / name)
    for name in PARTIAL:  # the record, and a features array an earlier run's settings left
        (out / name).unlink(missing_ok=True)
