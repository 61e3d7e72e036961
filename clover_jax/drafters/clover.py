"""Clover: Medusa plus an Augmenting Block (one decoder layer over the prefix, its own KV cache), a
Regressive Connection (each head reads its parent's token, embedded by the normalised lm_head rows) and
an Attention Decoder (one query over the parent's state, key and value from the token). Trained as
Medusa, by cross-entropy on the data's tokens (`losses.cross_entropy`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import DrafterConfig
from clover_jax.drafters.heads import (
    Heads,
    ResBlock,
    eye_plus_uniform,
    gate_heads,
    last_layer_copies,
    token_embeddings,
)
from clover_jax.drafters.losses import cross_entropy
from clover_jax.drafters.registry import Method, register
from clover_jax.model.config import ModelConfig
from clover_jax.model.layers import Linear, RMSNorm
from clover_jax.model.llama import Llama


@dataclasses.dataclass(frozen=True)
class CloverConfig(DrafterConfig):
    """Clover's one option: the scale of the uniform noise added to its identity initialisations."""

    noise: float = 0.01


class CloverAttentionDecoder(nnx.Module):
    """Clover's Attention Decoder: q = W_Q norm(h), k = W_K e, v = W_V e, h + Attn(q, k, v).

    Each tree node attends to the one token embedding it is given, so the softmax over that single key
    is 1 and the output is v; q and k are computed as the paper writes them (identity + noise init),
    and Clover-2's cosine gate is what later gave them a role.
    """

    def __init__(self, cfg: ModelConfig, noise: float, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.q = Linear(d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.k = Linear(d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.v = Linear(d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.q.kernel[...] = eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.k.kernel[...] = eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.v.kernel[...] = jnp.zeros((d, d), dtype)
        self.attn_heads = gate_heads(cfg)

    def __call__(self, h, e):
        q, k, v = self.q(self.norm(h)), self.k(e), self.v(e)
        split = lambda x: x.reshape(*x.shape[:-1], self.attn_heads, -1)
        score = jnp.sum(split(q) * split(k), axis=-1, keepdims=True) / jnp.sqrt(split(q).shape[-1])
        weight = jax.nn.softmax(score[..., None], axis=-1)[..., 0]  # one key per query: exactly 1
        return h + (split(v) * weight.astype(v.dtype)).reshape(h.shape)


class CloverHeads(Heads):
    """Clover: Augmenting Block (1 layer, own cache) -> h_0; node state h_i = h_{i-1} + AD(h_{i-1},
    e_{i-1}) with e the normalised lm_head row of the node's token; logits of head i =
    lm_head(norm(h_i + SiLU(W_i h_i))), `norm` being the base model's final norm."""

    aug_layers = 1

    def __init__(self, hcfg: CloverConfig, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base.cfg, last_layer_copies(base, self.aug_layers, rngs))
        self.decoder = CloverAttentionDecoder(base.cfg, hcfg.noise, base.dtype, rngs)
        self.blocks = nnx.List([ResBlock(base.cfg.hidden_size, base.dtype, rngs) for _ in range(hcfg.num_heads)])

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        return self.run_aug(hidden, positions, mask, cache)

    def node_state(self, base, k, state, token):
        e = token_embeddings(base, "lm_head", True, token).astype(state.dtype)
        return self.decoder(state, e)

    def node_hidden(self, base, k, state, token):
        return base.norm(self.blocks[k](state))


register(Method("clover", CloverHeads, CloverConfig, depth=3, tree="medusa_mc_sim_7b_63", loss=cross_entropy,
                title="Clover"))
