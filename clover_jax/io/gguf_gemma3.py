"""Gemma 3's text decoder in a GGUF file (llama.cpp's `gemma3` architecture), read back as a Hugging
Face `Gemma3ForCausalLM` checkpoint: its config.json fields and its tensors' names and values.

What llama.cpp's converter (`convert_hf_to_gguf.py`, class Gemma3Model) changed, and what is undone:
- Every RMSNorm weight (the four of each layer, the q and k norms, the final norm) is stored as 1 + w,
  the scale Gemma's norm applies, where Hugging Face keeps w; 1 is subtracted here. The released
  weights are bfloat16, so each w read back is a bfloat16 number while the stored 1 + w often is not
  (tests/test_gemma3_real.py checks this on the real file).
- q and k rows are stored as Hugging Face has them: that class is not the Llama converter that
  permutes them, and llama.cpp runs Gemma's RoPE in the rotate-half (NEOX) layout Hugging Face uses.
- What the metadata leaves out, llama.cpp's loader fixes for every gemma3 file, so it is written here
  the same way: every sixth layer global and the others local (a window of
  `attention.sliding_window` tokens; none when the file gives no window); local layers' RoPE base
  10000, unscaled (or `rope.freq_base_swa` where a file gives one); scores scaled by head_dim ** -0.5,
  but by (hidden / heads) ** -0.5 in the 27B model (62 layers), as Gemma's own code does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from clover_jax.errors import CloverError

MODEL_TYPE = "gemma3_text"
# Our (Hugging Face) tensor names per GGUF tensor name, with {i} the layer. llama.cpp's ffn_norm is
# Gemma's pre-feedforward norm; its post_attention_norm is the norm on the attention's output.
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
PATTERN = 6  # llama.cpp's set_swa_pattern(6): layer i is local unless (i + 1) % 6 == 0
LOCAL_ROPE_BASE = 10000.0
_LAYERS_27B = 62


def config(get: Callable, cfg: dict, pad_token_id: int | None, path: Path) -> dict:
    """A complete Hugging Face config.json for a Gemma 3 text model, from the fields `hf_config` read from
    any GGUF (`cfg`), the tokenizer's padding id and the gemma3 metadata (`get(key, default)` reads
    `gemma3.KEY`)."""
    if int(get("attention.value_length") or cfg["head_dim"]) != cfg["head_dim"]:
        raise CloverError(f"{path}: GGUF attention.value_length differs from key_length; not a Gemma 3 model")
    if not cfg["tie_word_embeddings"]:
        raise CloverError(f"{path}: a gemma3 GGUF with its own output.weight; Gemma 3 ties it to the embedding")
    layers = cfg["num_hidden_layers"]
    window = int(get("attention.sliding_window") or 0)
    types = ["sliding_attention" if window and (i + 1) % PATTERN else "full_attention" for i in range(layers)]
    full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        full = {"rope_type": "linear", "rope_theta": cfg["rope_theta"], "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise CloverError(f"{path}: GGUF rope scaling {scaling!r} is not Gemma 3's (linear, or none)")
    local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", LOCAL_ROPE_BASE))}
    softcap = get("final_logit_softcapping")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        **cfg,
        "model_type": MODEL_TYPE,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(str(np.float32(cfg["rms_norm_eps"]))),  # the file's float32 as it was written: 1e-06
        "query_pre_attn_scalar": (cfg["hidden_size"] // cfg["num_attention_heads"] if layers == _LAYERS_27B
                                  else cfg["head_dim"]),
        # transformers builds a local mask even where no layer reads it: without a window, the context's
        "sliding_window": window or cfg["max_position_embeddings"],
        "layer_types": types,
        # Both spellings of the two RoPEs, so transformers 4.x (rope_theta, rope_scaling,
        # rope_local_base_freq) and 5.x (rope_parameters per layer type) read the same ones.
        "rope_scaling": full if scaling == "linear" else None,
        "rope_local_base_freq": local["rope_theta"],
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "pad_token_id": pad_token_id,
        "torch_dtype": "float32",
    }


def is_norm(gguf_name: str) -> bool:
    """Whether a GGUF tensor is an RMSNorm weight, which the file holds as 1 + w."""
    return gguf_name.endswith("norm.weight")


def check_complete(names: set[str], cfg: dict, path: Path) -> None:
    """Refuse, in one line, a file missing any tensor of a Gemma 3 layer: transformers would start it
    from random values without a word."""
    want = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}" for i in range(cfg["num_hidden_layers"]) for name in LAYER_TENSORS.values()}
    missing = sorted(want - names)
    if missing:
        raise CloverError(f"{path}: tensor {missing[0]} is missing ({len(missing)} in all); "
                          "the file is not a complete Gemma 3 model")
