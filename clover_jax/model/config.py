"""Model configuration, read from (and written back to) a Hugging Face `config.json`.

One frozen dataclass covers the decoders this package runs: Llama-2 / Vicuna, Llama-3 (grouped-query
attention, `llama3` rope scaling), Mistral and Qwen2 (q/k/v bias), both with or without a sliding
window, Qwen3 (q/k norms) and Gemma 3's text decoder. `hf_config.py` translates each family's
config.json; anything outside these shapes is refused with one line naming the field, so a user never
gets a silently wrong model.
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
from clover_jax.model import hf_config
from clover_jax.model.hf_config import LAYER_TYPES, SLIDING, SUPPORTED_MODEL_TYPES

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "rope_inv_freq"]


def _family(default):
    """A field a family adds to the Llama layer (see `ModelConfig.fingerprint`)."""
    return dataclasses.field(default=default, metadata={"family": True})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder. Letters: V vocab, D model dim, F MLP dim, N query heads,
    K kv heads, H head dim. The fields after `eos_token_ids` are what a family adds to a Llama; at
    their defaults the layer is a Llama's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings),
    # ("linear", factor) or None
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = _family(False)  # RMSNorm over each head's q and k (over H) before RoPE: Qwen3, Gemma 3
    norm_unit_offset: bool = _family(False)  # RMSNorm scales by (1 + w) in float32, w starting at 0: Gemma
    sandwich_norms: bool = _family(False)  # Gemma 3: norms on the attention's and the MLP's outputs, one before the MLP
    hidden_act: str = _family("silu")  # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU: Gemma)
    embed_scale: bool = _family(False)  # token embeddings times sqrt(D), in the embedding's dtype: Gemma
    query_pre_attn_scalar: float | None = _family(None)  # scores times its ** -0.5 (Gemma 3); None: H ** -0.5
    # W: a local layer's query at position q reads keys at positions k with q - k < W (and k <= q)
    sliding_window: int | None = _family(None)
    layer_types: tuple[str, ...] = _family(())  # per layer "full_attention" or "sliding_attention"; (): all full
    rope_local_theta: float | None = _family(None)  # RoPE base of local layers, unscaled (Gemma 3); None: the global RoPE

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CloverError(
                f"config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix config.json"
            )
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES) or self.sliding_window is None):
            raise ValueError(f"layer_types {self.layer_types} need one of {LAYER_TYPES} per layer and a sliding_window")

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A few-thousand-parameter model for tests."""
        base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=256)
        base.update(overrides)
        return cls(**base)

    def is_local(self, layer: int) -> bool:
        """Whether decoder layer `layer` attends within the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @property
    def num_params(self) -> int:
        """Parameter count of the base model (embeddings and lm_head included)."""
        d, f, n, k, h = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * n * h * 2 + d * k * h * 2 + (n * h + 2 * k * h if self.qkv_bias else 0) + (2 * h if self.qk_norm else 0)
        layer = attn + 3 * d * f + (4 if self.sandwich_norms else 2) * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a parsed Hugging Face config.json; an unsupported model type or setting is a one-line error."""
        return cls(**hf_config.read(hf))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """From `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CloverError(f"{path}: not found; a model is a Hugging Face checkpoint directory (config.json, "
                              "weights, tokenizer files)")
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CloverError(f"{path}: cannot be read as JSON ({e})") from None
        return cls.from_hf_dict(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json that `transformers` loads back into the same architecture."""
        return hf_config.write(self)

    def fingerprint(self) -> str:
        """A short stable id of the architecture (weights are fingerprinted in checkpoint code). The
        family fields count only where they differ from their defaults, so a Llama's id (kept in
        datasets and heads written before they existed) stays what it was."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if not f.metadata.get("family") or getattr(self, f.name) != f.default}
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [H/2] of the rotary embedding, with its scaling applied (as HF does); `local`:
    a sliding-window layer's, which Gemma 3 gives its own base (`rope_local_theta`) and no scaling."""
    h = cfg.head_dim
    own = local and cfg.rope_local_theta is not None
    theta, scaling = (cfg.rope_local_theta, None) if own else (cfg.rope_theta, cfg.rope_scaling)
    inv = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if scaling is not None and scaling[0] == "linear":
        inv = inv / scaling[1]
    elif scaling is not None:
        _, factor, low, high, orig = scaling
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)
