"""A Hugging Face `config.json` translated into `ModelConfig`'s fields and back, family by family.

Each family reads the fields its `transformers` config class defines, with that class's defaults
where a field is absent (Qwen3's head_dim is 128, Gemma 3's 256; Mistral's window is 4096, Qwen2's
and Qwen3's off unless use_sliding_window), and a field that would change the forward pass in a way
the decoder does not implement is refused in one line naming it. A config written back holds both
spellings of RoPE: transformers 4.x's (rope_theta, rope_scaling, Gemma 3's rope_local_base_freq) and
5.x's (rope_parameters, nested per layer type for Gemma 3).
"""

from __future__ import annotations

from typing import Any

from clover_jax.errors import CloverError

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

# Each family's transformers defaults for the fields a config.json may leave out. head_dim None:
# hidden_size / num_attention_heads; window None: no sliding window unless the config names one.
_DEFAULTS = {
    "llama": dict(head_dim=None, theta=10000.0, tied=False, window=None, max_pos=2048),
    "mistral": dict(head_dim=None, theta=10000.0, tied=False, window=4096, max_pos=131072),
    "qwen2": dict(head_dim=None, theta=10000.0, tied=False, window=4096, max_pos=32768),
    "qwen3": dict(head_dim=128, theta=10000.0, tied=False, window=4096, max_pos=32768),
    "gemma3_text": dict(head_dim=256, theta=1_000_000.0, tied=True, window=4096, max_pos=131072),
}
_GEMMA_LOCAL_THETA = 10000.0
_GEMMA_PATTERN = 6  # every sixth layer global, when neither layer_types nor sliding_window_pattern says

# Fields that change nothing about the forward pass in inference, or that are read below; any family.
_KNOWN = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "pretraining_tp", "attention_dropout", "_name_or_path", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "output_attentions", "pad_token_id", "bos_token_id", "eos_token_id", "model_type", "rope_scaling",
    "rope_theta", "rope_parameters", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "hidden_act", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
    "tokenizer_class", "generation_config", "quantization_config", "auto_map", "cache_implementation",
    "partial_rotary_factor", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
}
# The window fields there are read by the families whose transformers model reads them (Mistral windows
# every layer alike, whatever layer_types says; Llama has no window). Gemma 3 reads these too; in
# another family they name an architecture and are refused.
_GEMMA_KNOWN = {"sliding_window_pattern", "query_pre_attn_scalar", "hidden_activation", "rope_local_base_freq"}
# Fields that would change the forward pass if set to anything but their neutral value.
_NEUTRAL = {"quantization_config": None, "auto_map": None, "mlp_bias": False, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "use_bidirectional_attention": False}
_ARCHITECTURE_WORDS = ("rope", "attn", "attention", "norm", "layer", "moe", "expert")


def _need(hf: dict, key: str) -> Any:
    if hf.get(key) is None:
        raise CloverError(f"config: field {key} is missing; config.json is not a complete Hugging Face config")
    return hf[key]


def _refuse_unimplemented(hf: dict, model_type: str) -> None:
    for key, neutral in _NEUTRAL.items():
        if hf.get(key, neutral) != neutral:
            raise CloverError(f"config: unsupported field {key}={hf[key]!r} (only {key}={neutral!r} is supported)")
    if model_type == "gemma3_text":
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")  # Gemma 3 never reads hidden_act
        if act != "gelu_pytorch_tanh":
            raise CloverError(f"config: unsupported field hidden_activation={act!r} (Gemma 3's is gelu_pytorch_tanh)")
    elif hf.get("hidden_act", "silu") != "silu":
        raise CloverError(f"config: unsupported field hidden_act={hf['hidden_act']!r} (only hidden_act='silu' is supported)")
    if hf.get("attention_bias") and model_type != "qwen2":
        raise CloverError("config: unsupported field attention_bias=true (only Qwen2 has q/k/v bias)")
    known = _KNOWN | set(_NEUTRAL) | (_GEMMA_KNOWN if model_type == "gemma3_text" else set())
    unknown = sorted(k for k in hf if k not in known and not k.endswith("_token_id"))
    # Unknown keys are usually harmless metadata; only refuse the ones that name architecture.
    risky = [k for k in unknown if any(w in k for w in _ARCHITECTURE_WORDS)]
    if risky:
        raise CloverError(f"config: unsupported field {risky[0]}={hf[risky[0]]!r}; "
                          f"this is not a plain {model_type} decoder")


def _rope(params: dict, where: str) -> tuple[float, tuple | None]:
    """(theta, scaling) of one rope dict: rope_type default, linear or llama3 (see `ModelConfig.rope_scaling`)."""
    rope_type = params.get("type", params.get("rope_type", "default"))  # legacy rope_scaling "type" wins
    if params.get("partial_rotary_factor") not in (None, 1.0):
        raise CloverError(f"config: unsupported field partial_rotary_factor={params['partial_rotary_factor']!r} "
                          "(only 1.0 is supported: RoPE over the whole head)")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, ("linear", float(params["factor"]))
    if rope_type == "llama3":
        return theta, ("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    raise CloverError(f"config: unsupported field {where} type {rope_type!r} (supported: default, linear, llama3)")


def _ropes(hf: dict, model_type: str, default_theta: float) -> dict:
    """rope_theta, rope_scaling and rope_local_theta, read as transformers reads them."""
    if model_type != "gemma3_text":
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", default_theta))
        rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor"))
        theta, scaling = _rope(rope, "rope_scaling")
        return dict(rope_theta=theta, rope_scaling=scaling)
    nested = hf.get("rope_parameters") or {}
    full = dict(nested.get(FULL) or {})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    local = dict(nested.get(SLIDING) or {})
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", _GEMMA_LOCAL_THETA))
    for rope in (full, local):
        rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor"))
    theta, scaling = _rope(full, f"rope_parameters.{FULL}")
    local_theta, local_scaling = _rope(local, f"rope_parameters.{SLIDING}")
    if local_scaling is not None:
        raise CloverError(f"config: unsupported field rope_parameters.{SLIDING} type {local_scaling[0]!r} "
                          "(Gemma 3's local layers: default only)")
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)


def _windows(hf: dict, model_type: str, num_layers: int, default_window: int | None) -> dict:
    """sliding_window and layer_types, as each family's transformers model decides which layers are local."""
    if model_type == "llama":
        return {}
    window = hf.get("sliding_window", default_window)
    if model_type == "mistral":
        types = [SLIDING if window is not None else FULL] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        window = window if hf.get("use_sliding_window", False) else None
        first_local = hf.get("max_window_layers", 28)
        types = hf.get("layer_types") or [SLIDING if window is not None and i >= first_local else FULL
                                          for i in range(num_layers)]
    else:
        pattern = hf.get("sliding_window_pattern", _GEMMA_PATTERN)
        types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers:
        raise CloverError(f"config: layer_types has {len(types)} entries for num_hidden_layers={num_layers}; fix config.json")
    odd = [t for t in types if t not in LAYER_TYPES]
    if odd:
        raise CloverError(f"config: unsupported layer type {odd[0]!r} in layer_types (supported: {', '.join(LAYER_TYPES)})")
    if SLIDING not in types:
        return {}
    if window is None:
        raise CloverError("config: layer_types names sliding_attention layers but sliding_window is null; "
                          "set sliding_window (or use_sliding_window) in config.json")
    if int(window) < 1:
        raise CloverError(f"config: unsupported field sliding_window={window!r} (a window of at least 1 token)")
    return dict(sliding_window=int(window), layer_types=tuple(types))


def read(hf: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig`'s fields from a parsed config.json; an unsupported model type or setting is a one-line error."""
    model_type = hf.get("model_type")
    if model_type == "gemma3":
        raise CloverError("config: model_type='gemma3' is Gemma 3's image-and-text checkpoint (a vision tower "
                          "beside the decoder's weights); use a text-only Gemma 3 (model_type gemma3_text, as "
                          "the 270M and 1B models are)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CloverError(f"config: model_type={model_type!r} is not supported; "
                          f"use a checkpoint of type {', '.join(SUPPORTED_MODEL_TYPES)}")
    _refuse_unimplemented(hf, model_type)
    defaults = _DEFAULTS[model_type]
    n, d, layers = int(_need(hf, "num_attention_heads")), int(_need(hf, "hidden_size")), int(_need(hf, "num_hidden_layers"))
    eos = hf.get("eos_token_id")
    fields = dict(
        vocab_size=int(_need(hf, "vocab_size")),
        hidden_size=d,
        intermediate_size=int(_need(hf, "intermediate_size")),
        num_layers=layers,
        num_heads=n,
        num_kv_heads=int(hf.get("num_key_value_heads") or n),
        head_dim=int(hf.get("head_dim") or defaults["head_dim"] or d // n),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", defaults["max_pos"])),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", defaults["tied"])),
        qkv_bias=model_type == "qwen2",
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])),
    )
    fields.update(_ropes(hf, model_type, defaults["theta"]))
    fields.update(_windows(hf, model_type, layers, defaults["window"]))
    if model_type in ("qwen3", "gemma3_text"):
        fields.update(qk_norm=True)
    if model_type == "gemma3_text":
        fields.update(norm_unit_offset=True, sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=True,
                      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))
    return fields


def _rope_dict(theta: float, scaling: tuple | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling[0] == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling[1]}
    _, factor, low, high, orig = scaling
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}


def _number(x: float) -> int | float:
    """x as an int where it is one: transformers' strict config fields refuse 256.0 for an int."""
    return int(x) if float(x).is_integer() else x


def write(cfg) -> dict[str, Any]:
    """A config.json (for a `ModelConfig` cfg) that `transformers` loads back into the same architecture."""
    rope = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
    eos = list(cfg.eos_token_ids)
    types = list(cfg.layer_types) or [FULL] * cfg.num_layers
    out = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        # Both spellings, so transformers 4.x (rope_theta/rope_scaling) and 5.x read the same rope.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "rope_parameters": rope,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if cfg.model_type in ("llama", "qwen3", "gemma3_text"):
        out.update(attention_bias=False)
    if cfg.model_type == "llama":
        out.update(mlp_bias=False)
    if cfg.model_type == "mistral":
        out.update(sliding_window=cfg.sliding_window)
    if cfg.model_type in ("qwen2", "qwen3"):
        windowed = cfg.sliding_window is not None
        out.update(use_sliding_window=windowed, sliding_window=cfg.sliding_window, layer_types=types)
        if windowed:  # transformers 4.x reads the local layers off max_window_layers: the ones from it on
            out.update(max_window_layers=types.index(SLIDING))
    if cfg.model_type == "gemma3_text":
        del out["hidden_act"]
        out.update(
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_number(cfg.query_pre_attn_scalar),
            # transformers builds the local mask even when no layer reads it, so some window is needed
            sliding_window=cfg.sliding_window or _DEFAULTS["gemma3_text"]["window"], layer_types=types,
            rope_local_base_freq=cfg.rope_local_theta,
            rope_parameters={FULL: rope, SLIDING: _rope_dict(cfg.rope_local_theta, None)},
            attn_logit_softcapping=None, final_logit_softcapping=None, use_bidirectional_attention=False)
    return out
