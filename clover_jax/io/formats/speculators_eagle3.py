"""EAGLE-3 drafters in vLLM's `speculators` format (`src/speculators/models/eagle3/`), which vLLM serves.

config.json: architectures ["Eagle3Speculator"] (or ["Eagle3DraftModel"], the class name speculators 0.9
saves under), speculators_model_type "eagle3", speculators_config
{algorithm, proposal_methods, default_proposal_method, verifier {name_or_path, architectures}},
transformer_layer_config (the draft layer's LlamaConfig, written with only the keys that differ from
its defaults), draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids and the switches
norm_before_residual (the residual is the normed hidden state), fc_norm (an RMSNorm per feature layer
before the FC), norm_output (each step hands on, and scores, the normed output), all three run here,
and norm_before_fc (one RMSNorm over the concatenated features), refused. Tensors (safetensors):
embed_tokens (the target's: checked, not read), fc, layers.0.* (input_layernorm and hidden_norm inside
the layer), norm, lm_head, d2t, t2d; verifier_norm/verifier_lm_head when present are the target's too.

What every transformers or speculators config carries and changes nothing in the drafting (NEUTRAL_KEYS,
the proposal methods' vLLM acceptance settings) is read past; tie_word_embeddings true and a
sliding-window draft layer shorter than the base model's context (speculators' trainer's default) are
refused by name.

Its feature layer ids are Hugging Face hidden_states indices (vLLM captures the state entering layer
id; id L is the last layer's output): the output of decoder layer id - 1 in our terms. Without them it
uses [2, L // 2, L - 3], the authors' layers (`eagle3_layers`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

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
    write_export,
    write_params,
)
from clover_jax.io.formats.weights import read_config, read_tensors
from clover_jax.model.llama import Llama

NAME = "speculators"
METHOD = "eagle3"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
ARCHITECTURE = "Eagle3Speculator"
ARCHITECTURES = (ARCHITECTURE, "Eagle3DraftModel")  # the name vLLM reads; the class speculators 0.9 saves
SWITCHES = ("norm_before_residual", "fc_norm", "norm_output")  # speculators' names, which are ours
# Top-level keys read here, or that change nothing about drafting (training settings, bookkeeping).
NEUTRAL_KEYS = ("architectures", "speculators_model_type", "speculators_version", "speculators_config",
                "transformer_layer_config", "draft_vocab_size", "target_hidden_size",
                "eagle_aux_hidden_state_layer_ids", "embed_requires_grad", "torch_dtype", "dtype",
                "transformers_version", "auto_map", "_name_or_path", "has_no_defaults_at_init",
                "tie_word_embeddings")


def matches(folder: Path) -> bool:
    """A config.json of the speculators library (its model type, its config block or its architecture)."""
    config = read_config(folder, strict=False)
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    named = any(a in archs for a in ARCHITECTURES)
    return "speculators_model_type" in config or "speculators_config" in config or named


def _config(folder: Path, base: Llama) -> Eagle3Config:
    where = folder / "config.json"
    config = read_config(folder)
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise CloverError(f"{where}: speculators_model_type {kind!r} is not one we read (eagle3)")
    if config.get("architectures", [ARCHITECTURE]) not in [[a] for a in ARCHITECTURES]:
        raise CloverError(f"{where}: architectures {config['architectures']!r}, but a speculators EAGLE-3 drafter "
                          f"is [{ARCHITECTURES[0]!r}] or [{ARCHITECTURES[1]!r}]")
    if config.get("tie_word_embeddings", False) is not False:
        raise CloverError(f"{where}: tie_word_embeddings {config['tie_word_embeddings']!r} (an lm_head tied to the "
                          "embeddings, which speculators never writes) is not implemented")
    if config.get("norm_before_fc", False) is not False:
        raise CloverError(f"{where}: norm_before_fc {config['norm_before_fc']!r} (one RMSNorm over the concatenated "
                          "features) is not implemented")
    # Unknown keys are mostly bookkeeping; the ones that name a part of the model are a variant we lack.
    odd = sorted(k for k in config if k not in NEUTRAL_KEYS + SWITCHES + ("norm_before_fc",)
                 and any(w in k for w in ("norm", "layer", "attn", "attention", "rope", "residual", "fc", "embed")))
    if odd:
        raise CloverError(f"{where}: unknown field {odd[0]}={config[odd[0]]!r}; this speculators drafter is a "
                          "variant we do not read")
    for key in SWITCHES:
        if not isinstance(config.get(key, False), bool):
            raise CloverError(f"{where}: {key} {config[key]!r} is not true or false")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CloverError(f"{where}: no transformer_layer_config object (the draft layer's config)")
    if "model_type" not in layer:
        raise CloverError(f"{where}: transformer_layer_config names no model_type, which speculators reads as "
                          "Qwen3's (q/k norms in the draft layer): not implemented")
    window = layer.get("sliding_window")
    if "sliding_attention" in (layer.get("layer_types") or ()) and not (
            isinstance(window, int) and window >= base.cfg.max_position_embeddings):
        raise CloverError(f"{where}: transformer_layer_config.layer_types has a sliding_attention draft layer (a "
                          f"window of {window!r} tokens, shorter than the base model's context), which is not "
                          "implemented; train it with full attention in its draft layer (speculators' "
                          "--full-attention-indices 0)")
    d = base.cfg.hidden_size
    if config.get("target_hidden_size") not in (None, d):
        raise CloverError(f"{where}: target_hidden_size {config['target_hidden_size']}, but the base model's hidden "
                          f"size is {d}; this drafter belongs to another model")
    states = layer_ids(config.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_aux_hidden_state_layer_ids")
    if states is not None and min(states) < 1:
        raise CloverError(f"{where}: eagle_aux_hidden_state_layer_ids {list(states)} names hidden state 0, the "
                          "embeddings, which the base model does not hand a drafter")
    n = config.get("draft_vocab_size", 32000)  # speculators' default
    if not isinstance(n, int) or isinstance(n, bool):
        raise CloverError(f"{where}: draft_vocab_size {n!r} is not a number of tokens")
    aux = None if states is None else tuple(i - 1 for i in states)
    switches = tuple(k for k in SWITCHES if config.get(k, False))
    return Eagle3Config(where, dict(layer), n, aux, switches, "layers.0.")


def load(folder: Path, base: Llama):
    """The speculators EAGLE-3 drafter in `folder`, as our EAGLE-3 drafter for `base`."""
    folder = Path(folder)
    config = _config(folder, base)
    return load_eagle3(config, read_tensors(folder, WEIGHTS), weights_file(folder, WEIGHTS), base,
                       allowed=("verifier_norm.weight", "verifier_lm_head.weight"))


def export(drafter, base: Llama, out: Path, base_name: str | None = None) -> Path:
    """Write our EAGLE-3 drafter as speculators saves an `Eagle3Speculator` (layers.0.*, the base model's
    embeddings, d2t offsets and t2d, its switches, its feature layers as hidden_states indices), its
    tensors in its own dtype; `base_name` (the base model's Hub id or path) names the verifier, which
    vLLM loads the target by."""
    hcfg = drafter.hcfg
    if hcfg.method != METHOD:
        raise CloverError(f"only EAGLE-3 drafters export as {NAME}; these are {registry.title(hcfg.method)}'s")
    tensors = write_params(drafter, "layers.0.", EAGLE3_IN_LAYER)
    tensors.update(export_vocab(drafter, base.cfg.vocab_size))
    embedding = np.asarray(jax.device_get(base.embed_tokens.embedding[...]))
    tensors["embed_tokens.weight"] = embedding.astype(tensors["fc.weight"].dtype)
    verifier = {"name_or_path": base_name, "architectures": base.cfg.to_hf_dict()["architectures"]}
    config = {"architectures": [ARCHITECTURE], "speculators_model_type": "eagle3",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy",
                                                           "speculative_tokens": drafter.depth}],
                                     "verifier": verifier},
              "transformer_layer_config": layer_hf(drafter, base),
              "draft_vocab_size": int(drafter.ids[...].shape[0]), "target_hidden_size": base.cfg.hidden_size,
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in exported_layers(drafter, base)],
              **{k: k in hcfg.switches for k in SWITCHES}, "norm_before_fc": False,
              "torch_dtype": stored_dtype(drafter)}
    return write_export(out, tensors, config)
