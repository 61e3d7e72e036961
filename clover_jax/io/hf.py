"""Import from and export to Hugging Face checkpoints (config.json + *.safetensors).

Our parameters carry HF's names, so the mapping is a renaming (`kernel` <-> `weight`, plus the
`model.` prefix) and a transpose for linear kernels; HF's q, k and v projections are read into, and
written out of, our one fused `qkv_proj` (`layers.QKVProjection`). Tensors are read one at a time from the
memory-mapped safetensors files, and each lands straight on its device (or its shards, given a
sharding), so a load never holds two full copies of the weights in host memory. Only safetensors are
read: no pickle, and never `trust_remote_code`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from clover_jax.model.config import ModelConfig
from clover_jax.errors import CloverError
from clover_jax.io.files import atomic_path, write_text
from clover_jax.model.layers import fuse_qkv, stored_parts, to_stored
from clover_jax.model.llama import Llama
from clover_jax.model.sharding import param_sharding

# HF keys that carry no weights we need (old checkpoints saved RoPE buffers).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
_SHARD_BYTES = 4 << 30  # files larger than this are split, with an index, as HF does


def hf_name(path: tuple) -> tuple[str, bool]:
    """Our state path -> (HF tensor name, whether the tensor is stored transposed)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    transpose = leaf == "kernel"
    parts[-1] = "weight" if leaf in ("kernel", "embedding") else leaf
    name = ".".join(parts)
    return (name if parts[0] == "lm_head" else "model." + name), transpose


class _TensorFiles:
    """Name -> (file, shape, dtype) over one or many safetensors files, opened lazily."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise CloverError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = ["model.safetensors"]
        else:
            others = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not others:
                bins = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt*")]
                hint = (" (only pickled weights found, which are never loaded here: a pickle can run code. Where "
                        "you trust the files, convert them once with transformers: AutoModelForCausalLM."
                        "from_pretrained(DIR).save_pretrained(DIR) writes safetensors beside them)") if bins else ""
                raise CloverError(f"{model_dir}: no *.safetensors weights{hint}")
            files = others
        self.handles = {}
        self.where: dict[str, str] = {}
        for name in files:
            path = model_dir / name
            if not path.is_file():
                raise CloverError(f"{path}: listed in the safetensors index but missing; re-download the checkpoint")
            try:
                handle = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CloverError(f"{path}: not a readable safetensors file ({e})") from None
            self.handles[name] = handle
            for key in handle.keys():
                self.where[key] = name

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def slice(self, key: str):
        return self.handles[self.where[key]].get_slice(key)


def load_pretrained(model_dir: str | Path, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None
                    ) -> tuple[ModelConfig, Llama]:
    """Load a HF checkpoint directory of any family `ModelConfig` reads (Llama, Mistral, Qwen2, Qwen3,
    Gemma 3 text) into a `Llama` of the given dtype; their tensors all carry our parameters' names.

    With a mesh, each parameter is placed by the rule table (`sharding.py`) and each device reads only
    its own slice of the tensor from disk (memory-mapped), so no host or device ever holds a full copy
    of a sharded tensor; without one, everything goes to the first device.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CloverError(f"{model_dir}: no such model directory")
    cfg = ModelConfig.from_pretrained(model_dir)
    files = _TensorFiles(model_dir)
    abstract = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    device = jax.devices()[0]
    used = set()
    leaves = []
    for path, var in flat:
        shape = tuple(var.get_value().shape)
        tensors = []
        for part, part_shape in stored_parts(path, shape):  # the fused q/k/v projection reads HF's three
            name, transpose = hf_name(part)
            expected = part_shape[::-1] if transpose else part_shape
            if name not in files.where:
                raise CloverError(f"{model_dir}: checkpoint is missing tensor {name} (expected shape {list(expected)})")
            stored = files.shape(name)
            if stored != expected:
                raise CloverError(f"{model_dir}: tensor {name} has shape {list(stored)}, expected {list(expected)} for this config.json")
            used.add(name)
            tensors.append(files.slice(name))
        if mesh is None:
            sharding = jax.sharding.SingleDeviceSharding(device)
        else:
            sharding = param_sharding(path, var, mesh)

        def read(index, tensors=tensors, transpose=transpose, shape=shape):
            index = tuple(index) if index is not None else (slice(None),) * len(shape)
            if len(tensors) == 3:
                block = _read_qkv(tensors, index, shape, transpose)
            else:
                block = tensors[0][index[::-1]].T if transpose else tensors[0][index]
            return np.asarray(block).astype(dtype)

        leaves.append((path, var.replace(jax.make_array_from_callback(shape, sharding, read))))
    extra = sorted(k for k in files.where if k not in used and not k.endswith(_SKIPPED_SUFFIXES)
                   and not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    if extra:
        raise CloverError(f"{model_dir}: checkpoint has unexpected tensor {extra[0]} ({len(extra)} in all); "
                          "it does not match config.json")
    state = nnx.from_flat_state(leaves)
    return cfg, nnx.merge(graphdef, state)


def _read_qkv(tensors: list, index: tuple, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
    """The block `index` of a fused q/k/v parameter (`layers.QKVProjection`: kernel [D, K, G+2, H] or
    bias [K, G+2, H]) read from HF's q, k, v tensors: only the rows of the kv heads in the block."""
    kv, g2, h = shape[-3:]  # g2 = G + 2
    k0, k1, _ = index[-3].indices(kv)
    lead = index[:-3]  # the kernel's input-width slice

    def rows(tensor, per_head):
        block = tensor[(slice(k0 * per_head, k1 * per_head), *lead)]
        return np.asarray(block).T if transpose else np.asarray(block)

    fused = fuse_qkv(rows(tensors[0], (g2 - 2) * h), rows(tensors[1], h), rows(tensors[2], h), k1 - k0)
    return fused[(..., index[-2], index[-1])]


def save_safetensors(tensors: dict[str, np.ndarray], path: Path, metadata: dict | None = None) -> None:
    """Write a safetensors file at `path` itself, readable as any new file is: safetensors creates its
    files owner-only (0600), which would hide exported weights from the other users of a shared machine."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_safetensors(tensors: dict[str, np.ndarray], path: Path, metadata: dict | None = None) -> None:
    """`save_safetensors`, atomically (a temporary name, renamed into place)."""
    with atomic_path(path) as tmp:
        save_safetensors(tensors, tmp, metadata)


def save_pretrained(model: Llama, out_dir: str | Path, dtype=jnp.bfloat16,
                    shard_bytes: int = _SHARD_BYTES) -> None:
    """Write `model` as a HF checkpoint (config.json + safetensors, sharded with an index when large).

    Each file is written under a temporary name and renamed into place, so an interrupted export
    never leaves a half-written checkpoint behind a valid name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        for part, array in to_stored(path, np.asarray(jax.device_get(var[...].astype(dtype)))):
            name, transpose = hf_name(part)
            tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if size and size + tensors[name].nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for fname, shard in zip(names, shards):
        write_safetensors(shard, out / fname, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                 "weight_map": {n: f for f, s in zip(names, shards) for n in s}}
        write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2))
    hf = model.cfg.to_hf_dict()
    hf["torch_dtype"] = jnp.dtype(dtype).name
    write_text(out / "config.json", json.dumps(hf, indent=2))
