"""Medusa-1 heads (`FasterDecoding/Medusa`): `medusa_lm_head.safetensors` (or the pickle
`medusa_lm_head.pt`, read through its converted copy) beside a config.json naming medusa_num_heads,
medusa_num_layers and base_model_name_or_path.

The file is the state dict of Medusa's `medusa_head`, a ModuleList of heads, head i being
`Sequential(*[ResBlock(H)] * L, Linear(H, V, bias=False))`: tensors `{i}.{j}.linear.weight` [H, H] and
`{i}.{j}.linear.bias` [H] for j < L, then `{i}.{L}.weight` [V, H], PyTorch's [out, in] layout. The list
repeats one ResBlock object, so a head applies the same block L times and its L copies in the file are
equal (loading assigns them in order, so Medusa's code would run the last). Published configs misstate
the head count (Medusa's loader hard-codes 5), so heads are counted from the tensor names. They load as
our Medusa heads with `head_layers` L and `own_lm_head`; ours export with the base model's lm_head
copied into each head's projection.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.drafters import registry
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io.files import replace_together
from clover_jax.io.formats.weights import read_config, read_tensors
from clover_jax.io.hf import save_safetensors
from clover_jax.model.llama import Llama

NAME = "medusa"
METHOD = "medusa"
WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
CONFIG = "config.json"

_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_PROJECTION = re.compile(r"(\d+)\.(\d+)\.weight")


def matches(folder: Path) -> bool:
    """A Medusa heads file is there, or a config naming medusa_num_heads (whose weights `load` then asks for)."""
    if any((folder / name).is_file() for name in WEIGHTS):
        return True
    return "medusa_num_heads" in read_config(folder, strict=False)


def _layout(tensors: dict[str, np.ndarray], where: Path) -> tuple[int, int]:
    """(heads K, ResBlocks per head L) from the tensor names, or one line naming the first name that does
    not fit `{i}.{j}.linear.{weight,bias}` (j < L) then `{i}.{L}.weight` for heads i = 0..K-1."""
    blocks: dict[int, set[tuple[int, str]]] = {}
    projections: dict[int, list[int]] = {}
    for name in sorted(tensors):
        if m := _BLOCK.fullmatch(name):
            blocks.setdefault(int(m[1]), set()).add((int(m[2]), m[3]))
        elif m := _PROJECTION.fullmatch(name):
            projections.setdefault(int(m[1]), []).append(int(m[2]))
        else:
            raise CloverError(f"{where}: tensor {name!r} is not one of Medusa's heads ({{i}}.{{j}}.linear.weight, "
                              "{i}.{j}.linear.bias, {i}.{L}.weight)")
    heads = sorted(set(blocks) | set(projections))
    if not heads:
        raise CloverError(f"{where}: holds no Medusa head tensors")
    if heads != list(range(len(heads))):
        missing = min(set(range(max(heads) + 1)) - set(heads))
        raise CloverError(f"{where}: has tensors of head {max(heads)} but none of head {missing}")
    layers = None
    for i in heads:
        if len(projections.get(i, [])) != 1:
            raise CloverError(f"{where}: head {i} has {len(projections.get(i, []))} vocabulary projections "
                              f"({{i}}.{{L}}.weight), not one")
        depth = projections[i][0]
        if depth == 0:
            raise CloverError(f"{where}: head {i} has no ResBlock (medusa_num_layers 0), which these heads "
                              "do not run")
        want = {(j, part) for j in range(depth) for part in ("weight", "bias")}
        if blocks.get(i, set()) != want:
            odd = sorted(blocks.get(i, set()) ^ want)[0]
            raise CloverError(f"{where}: head {i}'s projection is {i}.{depth}.weight, but tensor "
                              f"{i}.{odd[0]}.linear.{odd[1]} is {'missing' if odd in want else 'extra'}")
        if layers is not None and depth != layers:
            raise CloverError(f"{where}: head {i} has {depth} ResBlocks but head 0 has {layers}")
        layers = depth
    return len(heads), layers


def _check(tensors: dict[str, np.ndarray], where: Path, k: int, layers: int, base: Llama) -> None:
    """Shapes against the base model (hidden size D, vocabulary V); each head's repeated blocks equal."""
    d, v = base.cfg.hidden_size, base.cfg.vocab_size
    for i in range(k):
        proj = tensors[f"{i}.{layers}.weight"]
        if proj.ndim != 2 or proj.shape[1] != d:
            raise CloverError(f"{where}: tensor {i}.{layers}.weight has shape {list(proj.shape)}: heads for hidden "
                              f"size {proj.shape[-1]}, but the base model's is {d}; these heads belong to another model")
        if proj.shape[0] != v:
            raise CloverError(f"{where}: tensor {i}.{layers}.weight scores {proj.shape[0]} tokens, but the base "
                              f"model's vocabulary has {v}; these heads belong to another model")
        for j in range(layers):
            for part, shape in (("weight", (d, d)), ("bias", (d,))):
                name = f"{i}.{j}.linear.{part}"
                if tensors[name].shape != shape:
                    raise CloverError(f"{where}: tensor {name} has shape {list(tensors[name].shape)}, expected "
                                      f"{list(shape)} for the base model's hidden size {d}")
                if j and not np.array_equal(tensors[name], tensors[f"{i}.0.linear.{part}"]):
                    raise CloverError(f"{where}: head {i}'s ResBlocks differ ({name} is not {i}.0.linear.{part}), "
                                      "but Medusa's code applies one block per head L times (it keeps only the "
                                      "last copy): these are not Medusa-1 heads")


def load(folder: Path, base: Llama):
    """Medusa-1 heads for `base`: our Medusa heads with `head_layers` L and a projection of their own each."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = read_tensors(folder, WEIGHTS)
    where = folder / next((n for n in WEIGHTS if (folder / n).is_file()), WEIGHTS[0])
    k, layers = _layout(tensors, where)
    stated = config.get("medusa_num_layers")
    if stated is not None and stated != layers:
        raise CloverError(f"{folder / CONFIG}: medusa_num_layers is {stated}, but the heads file holds {layers} "
                          "ResBlocks per head; the two do not belong together")
    for key, ours in (("hidden_size", base.cfg.hidden_size), ("vocab_size", base.cfg.vocab_size)):
        if isinstance(config.get(key), int) and config[key] != ours:
            raise CloverError(f"{folder / CONFIG}: {key} {config[key]}, but the base model's is {ours}; these "
                              "heads belong to another model")
    _check(tensors, where, k, layers, base)
    heads = registry.make_drafter(drafter_config(METHOD, k, head_layers=layers, own_lm_head=True), base)
    dtype = base.dtype
    for i in range(k):
        block = heads.blocks[i].linear
        block.kernel[...] = jnp.asarray(tensors[f"{i}.0.linear.weight"].T, dtype)
        block.bias[...] = jnp.asarray(tensors[f"{i}.0.linear.bias"], dtype)
        heads.lm_heads[i].kernel[...] = jnp.asarray(tensors[f"{i}.{layers}.weight"].T, dtype)
    return heads


def export(drafter, base: Llama, out: Path, base_name: str | None = None) -> Path:
    """Write Medusa heads as Medusa-1's medusa_lm_head.safetensors and config.json in `out`, the two
    replacing what is there together; `base_name` (the base model's Hub id or path) becomes
    base_model_name_or_path. Heads scoring with the base model's lm_head get a copy of it each."""
    hcfg = drafter.hcfg
    if hcfg.method != METHOD:
        raise CloverError(f"only Medusa heads export as {NAME}; these are {registry.title(hcfg.method)}'s")
    layers = hcfg.head_layers
    host = lambda a: np.asarray(jax.device_get(a))
    tensors = {}
    for i in range(hcfg.num_heads):
        block = drafter.blocks[i].linear
        dtype = block.kernel[...].dtype
        for j in range(layers):
            tensors[f"{i}.{j}.linear.weight"] = host(block.kernel[...].T)
            tensors[f"{i}.{j}.linear.bias"] = host(block.bias[...])
        projection = drafter.lm_heads[i].kernel[...].T if hcfg.own_lm_head else base.lm_head_weight()
        tensors[f"{i}.{layers}.weight"] = host(projection.astype(dtype))
    config = {"medusa_num_heads": hcfg.num_heads, "medusa_num_layers": layers,
              "hidden_size": base.cfg.hidden_size, "vocab_size": base.cfg.vocab_size,
              **({"base_model_name_or_path": base_name} if base_name else {})}
    out = Path(out)
    with replace_together(out, (WEIGHTS[0], CONFIG), remove=(WEIGHTS[1],)) as tmp:
        save_safetensors(tensors, tmp[WEIGHTS[0]])
        tmp[CONFIG].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
