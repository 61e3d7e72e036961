"""Model configuration, read from (and written back to) a Hugging Face `config.json`.

One frozen dataclass covers the Llama family: Llama-2 / Vicuna, Llama-3 (grouped-query attention,
`llama3` rope scaling), Mistral (no sliding window) and Qwen2 (bias on q/k/v). Anything outside that
shape is refused with one line naming the field, so a user never gets a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from clover_jax.errors import CloverError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Fields that change nothing about the forward pass in inference; read and ignored.
_IGNORED = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "pretraining_tp", "attention_dropout", "_name_or_path", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "output_attentions", "max_window_layers", "layer_types", "pad_token_id", "bos_token_id",
    "eos_token_id", "model_type", "use_sliding_window", "sliding_window", "rope_scaling",
    "rope_theta", "rope_parameters", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "hidden_act", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
    "tokenizer_class", "generation_config", "quantization_config", "auto_map", "cache_implementation",
}
# Fields that would change the forward pass if set to anything but their neutral value.
_NEUTRAL = {
    "quantization_config": None, "auto_map": None, "hidden_act": "silu", "mlp_bias": False,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. Letters: V vocab, D model dim, F MLP dim,
    N query heads, K kv heads, H head dim."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or None
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CloverError(
                f"config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix config.json"
            )

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A few-thousand-parameter model for tests."""
        base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=256)
        base.update(overrides)
        return cls(**base)

    @property
    def num_params(self) -> int:
        """Parameter count of the base model (embeddings and lm_head included)."""
        d, f, n, k, h = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * n * h * 2 + d * k * h * 2 + (n * h + 2 * k * h if self.qkv_bias else 0)
        layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a parsed Hugging Face config.json; an unsupported model type or setting is a one-line error."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CloverError(
                f"config: model_type={model_type!r} is not supported; "
                f"use a checkpoint of type {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key, neutral in _NEUTRAL.items():
            if hf.get(key, neutral) != neutral:
                raise CloverError(f"config: unsupported field {key}={hf[key]!r} (only {key}={neutral!r} is supported)")
        if hf.get("use_sliding_window", model_type == "mistral") and hf.get("sliding_window") is not None:
            if hf["sliding_window"] < hf.get("max_position_embeddings", math.inf):
                raise CloverError(
                    f"config: unsupported field sliding_window={hf['sliding_window']} "
                    "(sliding-window attention is not implemented; set it to null to run full attention)"
                )
        if hf.get("attention_bias") and model_type != "qwen2":
            raise CloverError("config: unsupported field attention_bias=true (only Qwen2 has q/k/v bias)")
        unknown = sorted(k for k in hf if k not in _IGNORED and not k.endswith("_token_id"))
        # Unknown keys are usually harmless metadata; only refuse the ones that name architecture.
        risky = [k for k in unknown if any(w in k for w in ("rope", "attn", "attention", "norm", "layer", "moe", "expert"))]
        if risky:
            raise CloverError(f"config: unsupported field {risky[0]}={hf[risky[0]]!r}; this model is not a plain Llama-family decoder")

        rope = dict(hf.get("rope_parameters") or {})
        if hf.get("rope_scaling"):
            rope.update(hf["rope_scaling"])
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("type", rope.get("rope_type", "default"))  # legacy rope_scaling "type" wins
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling = ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        else:
            raise CloverError(f"config: unsupported field rope_scaling type {rope_type!r} (supported: default, llama3)")

        n = int(hf["num_attention_heads"])
        d = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=d,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=n,
            num_kv_heads=int(hf.get("num_key_value_heads") or n),
            head_dim=int(hf.get("head_dim") or d // n),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """From `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CloverError(f"{path}: not found; point --model at a Hugging Face checkpoint directory")
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CloverError(f"{path}: cannot be read as JSON ({e})") from None
        return cls.from_hf_dict(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json that `transformers` loads back into the same architecture."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            _, factor, low, high, orig = self.rope_scaling
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, "factor": factor,
                    "low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": orig}
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        eos = list(self.eos_token_ids)
        out = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            # Both spellings, so transformers 4.x (rope_theta/rope_scaling) and 5.x read the same rope.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "rope_parameters": rope,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }
        if self.model_type == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        if self.model_type in ("mistral", "qwen2"):
            out.update(sliding_window=None, use_sliding_window=False)
        return out

    def fingerprint(self) -> str:
        """A short stable id of the architecture (weights are fingerprinted in checkpoint code)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [H/2] of the rotary embedding, with Llama-3 scaling applied (as HF does)."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if cfg.rope_scaling is not None:
        _, factor, low, high, orig = cfg.rope_scaling
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)
