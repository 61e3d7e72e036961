"""EAGLE-3 drafters as SpecForge writes them for SGLang, and as the EAGLE-3 authors publish theirs.

SpecForge (`specforge/modeling/draft/llama3_eagle.py`, exported by `export/to_sglang.py`): config.json
with architectures ["LlamaForCausalLMEagle3"], the draft layer's Llama keys, vocab_size (the target's),
draft_vocab_size, optionally target_hidden_size and eagle_config.eagle_aux_hidden_state_layer_ids
(outputs of decoder layers, 0-based: SGLang captures the state entering layer id + 1); model.safetensors
with fc.weight [D, 3D], midlayer.* (hidden_norm, input_layernorm, self_attn q/k/v reading 2D, o_proj,
post_attention_layernorm, mlp), norm.weight, lm_head.weight [N, D], d2t and t2d; no embeddings (the
target's). Its fc_norm (an RMSNorm per feature layer before the FC) runs here; norm_output false (the
lm_head reading the un-normed output) does not.

The authors' (`eagle/model/cnets.py`, loaded by `ea_model.py`): architectures ["LlamaForCausalLM"] plus
draft_vocab_size; pytorch_model.bin (a pickle: read through its converted copy, `weights`) or
model.safetensors; the same names, or layers.0.* for midlayer.* in third-party copies, which may also
carry embed_tokens (ignored, as the authors' loader replaces it by the target's) or leave out lm_head
(the base model's rows then, for a draft vocabulary that is the whole one). Their config names no
feature layers: their code captures the states entering layers 2, L // 2 and L - 3 (`eagle3_layers`).
"""

from __future__ import annotations

from pathlib import Path

from clover_jax.drafters import registry
from clover_jax.errors import CloverError
from clover_jax.io.formats.eagle3_layout import (
    EAGLE3_IN_LAYER,
    Eagle3Config,
    export_vocab,
    exported_layers,
    layer_hf,
    layer_ids,
    load_eagle3,
    stored_dtype,
    weights_file,
    write_params,
    write_export,
)
from clover_jax.io.formats.weights import read_config, read_tensors
from clover_jax.model.llama import Llama

NAME = "sglang"
METHOD = "eagle3"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
SGLANG, AUTHORS = "LlamaForCausalLMEagle3", "LlamaForCausalLM"
# Config keys read here; the others describe the draft layer (`eagle3_layout.layer_model_config`).
OWN_KEYS = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "fc_norm", "norm_output",
            "norm_before_residual")


def matches(folder: Path) -> bool:
    """A config.json naming a draft vocabulary or an Eagle3 architecture, and not speculators'."""
    config = read_config(folder, strict=False)
    if "speculators_model_type" in config or "speculators_config" in config:
        return False
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return "draft_vocab_size" in config or any("Eagle3" in str(a) for a in archs)


def _config(folder: Path, base: Llama) -> Eagle3Config:
    where = folder / "config.json"
    config = read_config(folder)
    if not config:
        raise CloverError(f"{folder}: no config.json; an EAGLE-3 drafter's directory has one beside its weights")
    archs = config.get("architectures")
    if archs not in ([SGLANG], [AUTHORS]):
        raise CloverError(f"{where}: architectures {archs!r} is no EAGLE-3 drafter we read ([{SGLANG!r}] from "
                          f"SpecForge, or the authors' [{AUTHORS!r}] with draft_vocab_size)")
    if "draft_vocab_size" not in config and archs == [AUTHORS]:
        raise CloverError(f"{where}: a {AUTHORS} without draft_vocab_size is a model, not an EAGLE-3 drafter")
    d = base.cfg.hidden_size
    if config.get("target_hidden_size", d) != d:
        raise CloverError(f"{where}: target_hidden_size {config['target_hidden_size']}, but the base model's hidden "
                          f"size is {d}; this drafter belongs to another model")
    if config.get("norm_output", True) is not True:
        raise CloverError(f"{where}: norm_output {config['norm_output']!r} (SpecForge's lm_head reading the un-normed "
                          "output) is not implemented")
    if config.get("norm_before_residual", False) is not False:
        raise CloverError(f"{where}: norm_before_residual {config['norm_before_residual']!r}: SpecForge's EAGLE-3 layer "
                          "does not read it, so which residual these weights were trained with is unknown")
    eagle = config.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise CloverError(f"{where}: eagle_config {eagle!r} is not an object")
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise CloverError(f"{where}: eagle_config.use_aux_hidden_state {eagle['use_aux_hidden_state']!r} (drafting "
                          "from the last layer alone) is not EAGLE-3 as implemented here")
    aux = layer_ids(eagle.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_config.eagle_aux_hidden_state_layer_ids")
    n = config.get("draft_vocab_size", config.get("vocab_size"))
    if not isinstance(n, int) or isinstance(n, bool):
        raise CloverError(f"{where}: draft_vocab_size {n!r} is not a number of tokens")
    switches = ("fc_norm",) if config.get("fc_norm", False) is True else ()
    layer = {k: v for k, v in config.items() if k not in OWN_KEYS}
    return Eagle3Config(where, layer, n, aux, switches, "midlayer.")


def load(folder: Path, base: Llama):
    """The SpecForge/SGLang or authors' EAGLE-3 drafter in `folder`, as our EAGLE-3 drafter for `base`."""
    folder = Path(folder)
    config = _config(folder, base)
    tensors = read_tensors(folder, WEIGHTS)
    where = weights_file(folder, WEIGHTS)
    ours, theirs = (any(n.startswith(p) for n in tensors) for p in ("midlayer.", "layers.0."))
    if ours and theirs:
        raise CloverError(f"{where}: holds both midlayer.* and layers.0.* tensors; one draft layer is expected")
    prefix = "layers.0." if theirs else "midlayer."
    return load_eagle3(Eagle3Config(config.where, config.layer, config.draft_vocab, config.aux_layer_ids,
                                    config.switches, prefix), tensors, where, base)


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our EAGLE-3 drafter as SpecForge exports one for SGLang (`LlamaForCausalLMEagle3`, midlayer.*,
    no embeddings, d2t offsets and t2d), its feature layers in eagle_config, its tensors in its own dtype.
    Variants SpecForge has no key for are one line."""
    hcfg = drafter.hcfg
    if hcfg.method != METHOD:
        raise CloverError(f"only EAGLE-3 drafters export as {NAME}; these are {registry.title(hcfg.method)}'s")
    for switch in ("norm_before_residual", "norm_output"):
        if switch in hcfg.switches:
            raise CloverError(f"this EAGLE-3 drafter has {switch} on, which SpecForge's format does not express; "
                              "export it as speculators")
    tensors = write_params(drafter, "midlayer.", EAGLE3_IN_LAYER)
    tensors.update(export_vocab(drafter, base.cfg.vocab_size))
    config = {"architectures": [SGLANG], **layer_hf(drafter, base), "draft_vocab_size": int(drafter.ids[...].shape[0]),
              "target_hidden_size": base.cfg.hidden_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": exported_layers(drafter, base),
                               "use_aux_hidden_state": True},
              "torch_dtype": stored_dtype(drafter)}
    if "fc_norm" in hcfg.switches:
        config["fc_norm"] = True
    return write_export(out, tensors, config)
