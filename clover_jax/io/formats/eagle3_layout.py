"""What the published EAGLE formats share: our draft-model parameters under their tensor names, the draft
layer's config read from theirs, the draft vocabulary from d2t/t2d, and the checks against the base model.

Their tensors are PyTorch's: linear weights [out, in] (ours are kernels [in, out]), the draft layer's
q/k/v apart (ours fused, `layers.QKVProjection`), the layer under a prefix (SpecForge and the EAGLE
authors: `midlayer.`; speculators and EAGLE-1: `layers.0.`); EAGLE-3's input_layernorm and
hidden_norm sit inside the layer there, beside our drafter's other norms here. The draft vocabulary
is d2t [N] int64, target id = draft id + d2t[draft id], and t2d [V] bool, True at the target ids
drafted; ours is the ascending `DraftIds`, so a checkpoint's lm_head rows are put in that order.
`sglang_eagle3` and `speculators_eagle3` read their configs into an `Eagle3Config` and hand it here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.drafters import registry
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.draft_model import layer_keys
from clover_jax.errors import CloverError
from clover_jax.io.files import replace_together
from clover_jax.io.hf import save_safetensors
from clover_jax.model.config import ModelConfig
from clover_jax.model.layers import from_stored, stored_parts, to_stored
from clover_jax.drafters.eagle3 import eagle3_layers
from clover_jax.model.llama import Llama

# HF's LlamaConfig defaults, for configs that leave a key out (speculators writes only what differs).
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False}
IGNORED = ("rotary_emb.inv_freq",)  # buffers old checkpoints saved, which carry no weights
EAGLE3_IN_LAYER = ("input_layernorm", "hidden_norm")  # EAGLE-3's entry norms: inside the layer there


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 drafter's config as a format states it, in our terms."""

    where: Path  # the config file, for messages
    layer: dict  # the draft layer's config.json keys (hidden_size, heads, MLP, RoPE, vocab_size, ...)
    draft_vocab: int  # draft_vocab_size (the target's vocabulary size when the config has none)
    aux_layer_ids: tuple[int, ...] | None  # ours: outputs of decoder layers, 0-based; None: the authors' rule
    switches: tuple[str, ...]  # `Eagle3Config.SWITCHES` that are on
    prefix: str  # the draft layer's tensor prefix, "midlayer." or "layers.0."


def layer_ids(value, where: Path, key: str) -> tuple[int, ...] | None:
    """A config's list of layer ids (None when absent), or one line naming `key`."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise CloverError(f"{where}: {key} {value!r} is not a list of layer indices")
    return tuple(value)


def weights_file(folder: Path, names: tuple[str, ...]) -> Path:
    """The first of `names` present in `folder` (for messages; `weights.read_tensors` reads it)."""
    return next((folder / n for n in names if (folder / n).is_file()), folder / names[0])


def write_export(out: Path, tensors: dict[str, np.ndarray], config: dict, weights: str = "model.safetensors",
                 stale: tuple[str, ...] = ("pytorch_model.bin", "model.safetensors.index.json")) -> Path:
    """Write a drafter's tensors and config.json into `out`, the two replacing what is there together,
    and remove `stale` files a reader would otherwise pick up in their place (the EAGLE authors' loader
    reads pytorch_model.bin first)."""
    out = Path(out)
    with replace_together(out, (weights, "config.json"), remove=stale) as tmp:
        save_safetensors(tensors, tmp[weights], metadata={"format": "pt"})
        tmp["config.json"].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def tensor_name(path: tuple, prefix: str, in_layer: tuple[str, ...] = ()) -> tuple[str, bool]:
    """Our parameter path (one stored part, `layers.stored_parts`) -> (their tensor name, whether it is
    stored transposed). `in_layer`: our top-level parameters that sit inside their layer."""
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel"
    parts[-1] = "weight" if transpose else parts[-1]
    if parts[0] == "layer":
        return prefix + ".".join(parts[1:]), transpose
    return (prefix if parts[0] in in_layer else "") + ".".join(parts), transpose


def read_params(drafter, tensors: dict[str, np.ndarray], where: Path, prefix: str, in_layer: tuple[str, ...] = (),
                skip: tuple[str, ...] = ()) -> set[str]:
    """Fill `drafter`'s parameters from their published tensors (every one but the top-level names in
    `skip`), cast to each parameter's dtype; a missing or misshaped tensor is one line. Returns the
    tensor names read."""
    used, leaves = set(), []
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        if str(path[0]) in skip:
            continue
        shape = tuple(var[...].shape)
        parts = []
        for part, part_shape in stored_parts(path, shape):
            name, transpose = tensor_name(part, prefix, in_layer)
            expected = part_shape[::-1] if transpose else part_shape
            if name not in tensors:
                raise CloverError(f"{where}: lacks tensor {name} (shape {list(expected)})")
            if tuple(tensors[name].shape) != expected:
                raise CloverError(f"{where}: tensor {name} has shape {list(tensors[name].shape)}, expected "
                                  f"{list(expected)} for the draft layer's config and the base model")
            used.add(name)
            parts.append(tensors[name].T if transpose else tensors[name])
        leaves.append((path, var.replace(jnp.asarray(from_stored(parts, shape), var[...].dtype))))
    nnx.update(drafter, nnx.from_flat_state(leaves))
    return used


def write_params(drafter, prefix: str, in_layer: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """`read_params`'s inverse: every parameter of the drafter as its published tensors."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        for part, array in to_stored(path, np.asarray(jax.device_get(var[...]))):
            name, transpose = tensor_name(part, prefix, in_layer)
            array = array.T if transpose else array
            out[name] = np.ascontiguousarray(array)
    return out


def unexpected(tensors: dict[str, np.ndarray], used: set[str], where: Path, allowed: tuple[str, ...] = ()) -> None:
    """One line for a tensor neither read nor `allowed` (a part of a variant we do not run, or of
    another model)."""
    extra = sorted(n for n in tensors if n not in used and n not in allowed and not n.endswith(IGNORED))
    if extra:
        raise CloverError(f"{where}: has tensor {extra[0]} ({len(extra)} unread in all), which no part of this "
                          "drafter format as we read it holds; it is another variant or another model")


def layer_model_config(layer: dict, where: Path, base: Llama) -> ModelConfig:
    """The draft layer's ModelConfig from its config.json keys (LlamaConfig's defaults filled in),
    checked against the base model: same width and vocabulary, one decoder layer, and nothing the
    engine does not run (activation, biases, RoPE type: `ModelConfig.from_hf_dict`'s refusals)."""
    hf = {**LLAMA_DEFAULTS, **layer}
    d, v = base.cfg.hidden_size, base.cfg.vocab_size
    if hf.get("model_type", "llama") != "llama":
        raise CloverError(f"{where}: the draft layer is model_type {hf['model_type']!r}; only Llama draft layers "
                          "run here (a Qwen3 layer's q/k norms are not implemented)")
    hf["model_type"] = "llama"
    if hf["hidden_size"] != d:
        raise CloverError(f"{where}: hidden_size {hf['hidden_size']}, but the base model's is {d}; this drafter "
                          "belongs to another model (a draft width of its own is not implemented)")
    if hf["vocab_size"] != v:
        raise CloverError(f"{where}: vocab_size {hf['vocab_size']}, but the base model's vocabulary has {v}; this "
                          "drafter belongs to another model")
    if hf["num_hidden_layers"] != 1:
        raise CloverError(f"{where}: num_hidden_layers {hf['num_hidden_layers']}; draft models of one decoder "
                          "layer run here, not more")
    try:
        return ModelConfig.from_hf_dict(hf)
    except CloverError as e:
        raise CloverError(f"{where}: the draft layer's {e}") from None


def draft_layer(cfg: ModelConfig, base: Llama) -> dict | None:
    """`EagleConfig.draft_layer` for a draft layer config: its keys where any differs from the base
    model's layers, else None."""
    keys = layer_keys(cfg)
    return None if keys == layer_keys(base.cfg) else keys


def vocab_ids(tensors: dict[str, np.ndarray], n: int, v: int, where: Path) -> np.ndarray:
    """[N] the target id of each draft id (draft id + d2t[draft id]; identity without d2t, for a
    draft vocabulary that is the whole one), checked: in the vocabulary, distinct, and what t2d marks."""
    d2t = tensors.get("d2t")
    if d2t is None:
        if n != v:
            raise CloverError(f"{where}: no d2t tensor for a draft vocabulary of {n} of the {v} tokens")
        ids = np.arange(v, dtype=np.int64)
    else:
        if d2t.shape != (n,):
            raise CloverError(f"{where}: d2t has shape {list(d2t.shape)}, expected [{n}] (draft_vocab_size)")
        ids = np.arange(n, dtype=np.int64) + d2t.astype(np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= v))
        if bad.size:
            raise CloverError(f"{where}: d2t sends draft id {bad[0]} to target id {ids[bad[0]]}, outside the base "
                              f"model's vocabulary (0..{v - 1}); this drafter belongs to another model")
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            t = uniq[counts > 1][0]
            raise CloverError(f"{where}: d2t sends draft ids {list(np.flatnonzero(ids == t)[:2])} both to target "
                              f"id {t}; a draft vocabulary names each token once")
    t2d = tensors.get("t2d")
    if t2d is not None:
        if t2d.shape != (v,):
            raise CloverError(f"{where}: t2d has shape {list(t2d.shape)}, expected [{v}] (the base model's "
                              "vocabulary); this drafter belongs to another model")
        marked = np.zeros(v, bool)
        marked[ids] = True
        odd = np.flatnonzero(marked != t2d.astype(bool))
        if odd.size:
            t = odd[0]
            raise CloverError(f"{where}: t2d {'leaves out' if marked[t] else 'marks'} target id {t}, which d2t "
                              f"{'drafts' if marked[t] else 'does not draft'}; the two tensors disagree")
    return ids


def load_eagle3(config: Eagle3Config, tensors: dict[str, np.ndarray], where: Path, base: Llama,
                allowed: tuple[str, ...] = ()):
    """Our EAGLE-3 drafter (`drafters.eagle3.Eagle3`, its registry depth) holding a published one: the
    draft layer as `config` gives it, the aux layers checked inside the base model and against fc's
    width, lm_head rows in ascending target-id order. No lm_head in the file: the base model's rows
    (a draft vocabulary that is the whole one only). `allowed`: tensors the format carries that we do
    not read (the target's embeddings, checked here, are always allowed)."""
    d, v, layers = base.cfg.hidden_size, base.cfg.vocab_size, base.cfg.num_layers
    cfg = layer_model_config(config.layer, config.where, base)
    n = config.draft_vocab
    if not 0 < n <= v:
        raise CloverError(f"{config.where}: draft_vocab_size {n}, but the base model's vocabulary has {v} tokens")
    ids = config.aux_layer_ids or eagle3_layers(layers)
    if any(not 0 <= i < layers for i in ids):
        raise CloverError(f"{config.where}: feature layers {list(ids)} (outputs of decoder layers, 0-based) are not "
                          f"all inside the base model's {layers} layers; this drafter belongs to another model")
    if layers - 1 in ids and layers > 1:
        raise CloverError(f"{config.where}: feature layers {list(ids)} name the last decoder layer ({layers - 1}), whose "
                          "output the published runtimes take after the final norm or not at all; this drafter "
                          "belongs to a deeper model")
    fc = tensors.get("fc.weight")
    if fc is not None and fc.ndim == 2 and fc.shape[1] != len(ids) * d:
        raise CloverError(f"{where}: fc.weight reads {fc.shape[1]} features, not {len(ids)} feature layers x the "
                          f"base model's hidden size {d}; this drafter belongs to another model")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (v, d):
        raise CloverError(f"{where}: embed_tokens.weight has shape {list(embed.shape)}, but the base model's is "
                          f"{[v, d]}; this drafter belongs to another model")
    targets = vocab_ids(tensors, n, v, where)
    hcfg = drafter_config("eagle3", draft_vocab=0 if n == v else n,
                          aux_layer_ids=tuple(int(i) for i in ids), draft_layer=draft_layer(cfg, base),
                          switches=config.switches)
    drafter = registry.make_drafter(hcfg, base)
    used = read_params(drafter, tensors, where, config.prefix, EAGLE3_IN_LAYER, skip=("lm_head",))
    order = np.argsort(targets, kind="stable")
    drafter.ids[...] = jnp.asarray(targets[order], jnp.int32)
    head = tensors.get("lm_head.weight")
    if head is None:
        if n != v:
            raise CloverError(f"{where}: lacks tensor lm_head.weight, which a draft vocabulary of {n} of the {v} "
                              "tokens scores with")
        drafter.set_vocab(base, drafter.ids[...])
    else:
        if tuple(head.shape) != (n, d):
            raise CloverError(f"{where}: tensor lm_head.weight has shape {list(head.shape)}, expected {[n, d]} "
                              "(draft_vocab_size x the base model's hidden size)")
        kernel = drafter.lm_head.kernel
        kernel[...] = jnp.asarray(head[order].T, kernel[...].dtype)
        used.add("lm_head.weight")
    unexpected(tensors, used | {"d2t", "t2d", "embed_tokens.weight"}, where, allowed)
    return drafter


def export_vocab(drafter, v: int) -> dict[str, np.ndarray]:
    """d2t [N] int64 offsets and t2d [V] bool of an EAGLE-3 drafter's ascending ids."""
    ids = np.asarray(jax.device_get(drafter.ids[...]), np.int64)
    t2d = np.zeros(v, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(ids.shape[0], dtype=np.int64), "t2d": t2d}


def layer_hf(drafter, base: Llama) -> dict:
    """The draft layer's config.json keys for an export: Llama's, one layer of the base model's width,
    q/k/v without bias (a drafter on a Qwen2 base, whose draft layer has them, is one line)."""
    cfg = drafter.layer.self_attn.cfg
    if cfg.qkv_bias:
        raise CloverError("this drafter's layer has q/k/v biases (its base model is Qwen2's), which the published "
                          "formats' Llama draft layer does not hold")
    hf = {"model_type": "llama", "hidden_size": base.cfg.hidden_size, "num_hidden_layers": 1, "hidden_act": "silu",
          "vocab_size": base.cfg.vocab_size, "max_position_embeddings": base.cfg.max_position_embeddings,
          "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, **layer_keys(cfg)}
    return hf


def stored_dtype(drafter) -> str:
    """The name config.json's torch_dtype gives the dtype a drafter's tensors are stored in (its own)."""
    return np.dtype(drafter.fc.kernel[...].dtype).name


def exported_layers(drafter, base: Llama) -> list[int]:
    """The drafter's feature layers (outputs of decoder layers, 0-based) for an export; one line when the
    last layer is among them, whose output the published runtimes do not hand a drafter before the
    final norm (SGLang and vLLM capture states entering a layer)."""
    last = base.cfg.num_layers - 1
    if last in drafter.feature_layers:
        raise CloverError(f"this EAGLE-3 drafter fuses the output of the base model's last layer ({last}), which the "
                          "published formats' runtimes do not capture; it has no export")
    return list(drafter.feature_layers)
