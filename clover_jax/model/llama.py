"""The base model (Llama, Mistral, Qwen2, Qwen3, Gemma 3) as a Flax NNX module.

It returns logits *and* the last hidden states before and after the final norm: Medusa and Clover
heads read the pre-norm state, Clover-2's distillation loss the post-norm one. The same forward serves
prefill, one-token decoding and tree verification; only the mask and the positions differ.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.model.cache import KVCache
from clover_jax.model.config import ModelConfig
from clover_jax.model.layers import DecoderLayer, Embed, Linear, RMSNorm


@flax.struct.dataclass
class ModelOutput:
    """One forward pass's result."""

    logits: jax.Array | None  # [B, T, V] float32 (None when the caller asked for hidden states only)
    hidden: jax.Array  # [B, T, D] last layer's output, before the final norm
    hidden_normed: jax.Array  # [B, T, D] after the final norm (what lm_head reads)
    cache: KVCache | None
    features: jax.Array | None = None  # [B, T, F, D] outputs of the F `feature_layers` asked for (else None)


class Llama(nnx.Module):
    """The decoder of every family `ModelConfig` reads (the families add to the Llama layer; see
    `layers.DecoderLayer`). Attribute names mirror HF's `model.*` and `lm_head`.

    The KV cache is full length in every layer, sliding-window ones too: a local layer reads all S
    slots under its window mask, so its cache costs what a global layer's does (Gemma 3 1B at 4K
    tokens: 22 local layers keep 3,584 slots each they will never read again). A ring of W slots would
    be written over by every tree the speculative step verifies, and the slots a rejected node took
    would no longer hold the accepted history still inside the next step's window."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        scale = cfg.hidden_size ** 0.5 if cfg.embed_scale else None  # HF's own expression
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs, scale=scale)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, local=cfg.is_local(i))
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_unit_offset)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        """The parameters' dtype (float32 or bfloat16), which the caches take too."""
        return self.embed_tokens.embedding.dtype

    def logits(self, hidden_normed: jax.Array) -> jax.Array:
        """The output projection, shared with every draft head. [..., D] -> [..., V] float32."""
        out = self.embed_tokens.attend(hidden_normed) if self.lm_head is None else self.lm_head(hidden_normed)
        return out.astype(jnp.float32)

    def lm_head_weight(self) -> jax.Array:
        """The output projection as [V, D] rows (the token embeddings of Clover's Regressive Connection)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...]
        return self.lm_head.kernel[...].T

    def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
                 cache: KVCache | None = None, with_logits: bool = True,
                 feature_layers: tuple[int, ...] = (), causal: bool = False) -> ModelOutput:
        """tokens, positions [B, T]; mask [B, T, S] over cache slots (or [B, T, T] without a cache).
        `with_logits=False` skips the [B, T, V] projection when only a few positions need it.
        `feature_layers` (static; Python indices, -1 the last layer): the decoder layers whose outputs
        come back as `features`, from this same pass (EAGLE-3 fuses a low, a middle and a high one).
        `causal` (static): no token reads a later one, whatever the mask says, so that a long forward
        attends in query blocks, each over the keys up to its last token (a prompt's prefill; a forward
        without a cache). Not for a forward that reads committed cache slots."""
        wanted = [i % len(self.layers) for i in feature_layers]
        x = self.embed_tokens(tokens, self.dtype)
        kept = {}
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions, mask, cache, i, causal)
            if i in wanted:
                kept[i] = x
        normed = self.norm(x)
        logits = self.logits(normed) if with_logits else None
        features = jnp.stack([kept[i] for i in wanted], axis=2) if wanted else None
        return ModelOutput(logits=logits, hidden=x, hidden_normed=normed, cache=cache, features=features)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for `batch` sequences of `max_len` slots."""
        c = self.cfg
        return KVCache.zeros(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, self.dtype)


def clamp_layers(layers, num_layers: int) -> tuple[int, ...]:
    """Layer indices clamped into 0..L-1."""
    return tuple(min(max(int(i), 0), num_layers - 1) for i in layers)


def causal_self_mask(batch: int, length: int) -> jax.Array:
    """[B, T, T] lower-triangular mask for a cache-free forward (training, reference checks)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
