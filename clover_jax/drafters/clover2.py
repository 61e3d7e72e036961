"""Clover-2: the gated Attention Decoder before a two-layer Augmenting Block, head 0 through its own
linear, heads >= 1 one shared recurrent cell over [state; token embedding]; trained by distillation
(`distill_loss`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import DrafterConfig
from clover_jax.drafters.heads import Heads, eye_plus_uniform, gate_heads, last_layer_copies, token_embeddings
from clover_jax.drafters.losses import distill_steps, head_weights
from clover_jax.drafters.registry import Method, register
from clover_jax.errors import CloverError
from clover_jax.model.config import ModelConfig
from clover_jax.model.layers import Linear, RMSNorm
from clover_jax.model.llama import Llama

HIDDEN_WEIGHT = 10.0  # the SmoothL1 term's weight against the soft cross-entropy's


class GateDecoder(nnx.Module):
    """Clover-2's Attention Decoder: per attention head j, gate_j = cos(q_j, k_j); out = x + v * gate.
    q from RMSNorm(x), k and v from the token embedding, all linear with bias; no softmax, no output
    projection. Init as the authors': q, k = I + U(0, noise), v = U(0, noise), biases 0."""

    def __init__(self, cfg: ModelConfig, noise: float, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.q = Linear(d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.k = Linear(d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.v = Linear(d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.q.kernel[...] = eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.k.kernel[...] = eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.v.kernel[...] = (noise * jax.random.uniform(rngs.params(), (d, d), dtype)).astype(dtype)
        self.attn_heads = gate_heads(cfg)

    def __call__(self, x, e):
        split = lambda t: t.reshape(*t.shape[:-1], self.attn_heads, -1).astype(jnp.float32)
        q, k, v = split(self.q(self.norm(x))), split(self.k(e)), split(self.v(e))
        # Each norm clamped at eps as torch.cosine_similarity does; sqrt of a clamped square keeps the
        # gradient finite at a zero vector (padding rows), where d|x|/dx is 0/0.
        eps = self.norm.eps
        norm = lambda t: jnp.sqrt(jnp.maximum(jnp.sum(t * t, -1, keepdims=True), eps * eps))
        cos = jnp.sum(q * k, -1, keepdims=True) / (norm(q) * norm(k))
        return x + (v * cos).reshape(x.shape).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Clover2Config(DrafterConfig):
    """Clover-2's options: the token embedding its heads read, "lm_head" (a frozen copy of the lm_head's
    rows) or "input" (the input embedding table), and the scale of the uniform noise added to its
    identity initialisations."""

    embed_source: str = "lm_head"
    noise: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if self.embed_source not in ("lm_head", "input"):
            raise CloverError(f"embed_source={self.embed_source!r} must be 'lm_head' or 'input'")


class Clover2Heads(Heads):
    """Clover-2: x_t = AD_in(h_t, E[x_{t+1}]) -> 2-layer Augmenting Block (own cache) -> norm = s.
    Head 0: lm_head(head_norm(W0 s)); heads k >= 1 share one cell: s <- AD_cell(s, E[token]),
    logits = lm_head(head_norm(W2 [s; E[token]])). Both norms start as the base's final norm."""

    aug_layers = 2

    def __init__(self, hcfg: Clover2Config, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        super().__init__(hcfg, cfg, last_layer_copies(base, self.aug_layers, rngs))
        self.decoder_in = GateDecoder(cfg, hcfg.noise, dtype, rngs)
        self.decoder_cell = GateDecoder(cfg, hcfg.noise, dtype, rngs)
        self.aug_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.head_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.aug_norm.weight[...] = base.norm.scale()
        self.head_norm.weight[...] = base.norm.scale()
        self.w0 = Linear(d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.w0.kernel[...] = eye_plus_uniform(rngs.params(), d, d, hcfg.noise, dtype)
        self.w2 = Linear(2 * d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.w2.kernel[...] = eye_plus_uniform(rngs.params(), 2 * d, d, hcfg.noise, dtype)

    def _embed(self, base, token, dtype):
        return token_embeddings(base, self.hcfg.embed_source, False, token).astype(dtype)

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        x = self.decoder_in(hidden, self._embed(base, next_tokens, hidden.dtype))
        x, cache = self.run_aug(x, positions, mask, cache)
        return self.aug_norm(x), cache

    def node_state(self, base, k, state, token):
        # The root's token was fused into the context before the Augmenting Block.
        return state if k == 0 else self.decoder_cell(state, self._embed(base, token, state.dtype))

    def node_hidden(self, base, k, state, token):
        if k == 0:
            return self.head_norm(self.w0(state))
        e = self._embed(base, token, state.dtype)
        return self.head_norm(self.w2(jnp.concatenate([state, e], axis=-1)))


def distill_loss(head_hidden: jax.Array, head_logits: jax.Array, base_normed: jax.Array,
                 base_logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array, base_hidden=None):
    """Clover-2 distils the base model (`losses.distill_steps`): 10 x SmoothL1 between head k's lm_head
    input and the base model's normed hidden state at t+1+k plus the soft cross-entropy against its
    distribution there; head k weighted 0.7^k. Returns as `losses.cross_entropy_loss`."""
    per_head, masks, targets = distill_steps(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask,
                                             feature_weight=HIDDEN_WEIGHT, ce_weight=1.0)
    return jnp.sum(head_weights(head_hidden.shape[0]) * per_head), per_head, masks, targets


register(Method("clover2", Clover2Heads, Clover2Config, depth=5, tree="eagle_mc_sim_7b_63", loss=distill_loss,
                title="Clover-2"))
