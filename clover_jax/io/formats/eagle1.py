"""EAGLE-1 drafters as their authors publish them (`eagle/model/cnets1.py`, loaded by `ea_model.py`).

config.json: a one-layer LlamaForCausalLM (no draft_vocab_size), with "bias": false where the FC has no
bias. Weights: pytorch_model.bin (a pickle: read through its converted copy, `weights`) or
model.safetensors, holding fc.weight [D, 2D] (and fc.bias), layers.0.* without input_layernorm (their
first layer has none) and no final norm, plus embed_tokens.weight, the target's (checked, not read:
their loader replaces it by the target's). Their code feeds the draft the base model's state after its
final norm (`base_model.model`'s output) and scores its output with the lm_head alone: they load as our
EAGLE-1 with switch normed_features, and only such drafters export back (ours, trained on the state
before the norm, have no place in this format).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from clover_jax.drafters import registry
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io.formats.eagle3_layout import (
    draft_layer,
    layer_hf,
    layer_model_config,
    read_params,
    stored_dtype,
    unexpected,
    weights_file,
    write_export,
    write_params,
)
from clover_jax.io.formats.weights import read_config, read_tensors
from clover_jax.model.llama import Llama

NAME = "eagle1"
METHOD = "eagle"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
ARCHITECTURE = "LlamaForCausalLM"
SWITCH = "normed_features"
OTHER_FORMATS = ("draft_vocab_size", "speculators_model_type", "speculators_config", "medusa_num_heads")


def matches(folder: Path) -> bool:
    """A one-layer model config beside an EAGLE-1 weights file: safetensors holding fc.weight, or the pickle
    (whose names `load` checks on its converted copy)."""
    config = read_config(folder, strict=False)
    if not config or any(k in config for k in OTHER_FORMATS) or config.get("num_hidden_layers") != 1:
        return False
    if (folder / WEIGHTS[0]).is_file():
        try:
            with safe_open(str(folder / WEIGHTS[0]), framework="numpy") as f:
                return "fc.weight" in f.keys()
        except Exception:  # safetensors' own error types for a damaged header: not this format's file
            return False
    return (folder / WEIGHTS[1]).is_file()


def load(folder: Path, base: Llama):
    """The authors' EAGLE-1 drafter in `folder`, as our EAGLE-1 (switch normed_features) for `base`."""
    folder = Path(folder)
    where_config = folder / "config.json"
    config = read_config(folder)
    if config.get("architectures", [ARCHITECTURE]) != [ARCHITECTURE]:
        raise CloverError(f"{where_config}: architectures {config['architectures']!r}, but an EAGLE-1 drafter's "
                          f"config is [{ARCHITECTURE!r}]")
    bias = config.get("bias", True)
    if not isinstance(bias, bool):
        raise CloverError(f"{where_config}: bias {bias!r} is not true or false")
    if config.get("qkv_bias", False) is not False:
        raise CloverError(f"{where_config}: qkv_bias {config['qkv_bias']!r} (q/k/v biases in the draft layer) is "
                          "not implemented for EAGLE-1 drafters")
    cfg = layer_model_config({k: v for k, v in config.items() if k not in ("architectures", "bias", "qkv_bias")},
                             where_config, base)
    tensors = read_tensors(folder, WEIGHTS)
    where = weights_file(folder, WEIGHTS)
    d, v = base.cfg.hidden_size, base.cfg.vocab_size
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (v, d):
        raise CloverError(f"{where}: embed_tokens.weight has shape {list(embed.shape)}, but the base model's is "
                          f"{[v, d]}; this drafter belongs to another model")
    if not bias:
        if "fc.bias" in tensors:
            raise CloverError(f"{where}: holds fc.bias, but {where_config} says bias false; the two disagree")
        tensors = {**tensors, "fc.bias": np.zeros(d, np.float32)}  # no bias: a zero one is the same map
    hcfg = drafter_config(METHOD, draft_layer=draft_layer(cfg, base), switches=(SWITCH,))
    drafter = registry.make_drafter(hcfg, base)
    used = read_params(drafter, tensors, where, "layers.0.")
    unexpected(tensors, used | {"embed_tokens.weight"}, where)
    return drafter


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our EAGLE-1 drafter (switch normed_features) as the authors' code loads one: config.json and
    model.safetensors with fc, layers.0.* and the base model's embeddings, in the drafter's dtype."""
    hcfg = drafter.hcfg
    if hcfg.method != METHOD:
        raise CloverError(f"only EAGLE-1 drafters export as {NAME}; these are {registry.title(hcfg.method)}'s")
    if SWITCH not in hcfg.switches:
        raise CloverError("this EAGLE-1 drafter reads the base model's state before its final norm; the authors' "
                          f"format feeds the normed one, so it has no {NAME} export")
    tensors = write_params(drafter, "layers.0.")
    embedding = np.asarray(jax.device_get(base.embed_tokens.embedding[...]))
    tensors["embed_tokens.weight"] = embedding.astype(tensors["fc.weight"].dtype)
    config = {"architectures": [ARCHITECTURE], **layer_hf(drafter, base), "bias": True,
              "torch_dtype": stored_dtype(drafter)}
    return write_export(out, tensors, config)
