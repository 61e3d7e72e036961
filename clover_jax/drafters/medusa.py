"""Medusa: K independent heads, head i = lm_head(h + SiLU(W_i h)); no head sees another's token, so a
depth's nodes share one distribution. Trained by cross-entropy on the data's tokens (`losses.cross_entropy`).
"""

from __future__ import annotations

from flax import nnx

from clover_jax.drafters.heads import Heads, HeadsConfig, ResBlock
from clover_jax.model.llama import Llama


class MedusaHeads(Heads):
    """Head i: lm_head(h + SiLU(W_i h)), h the base model's last hidden state after the final norm (as
    Medusa's code feeds it; the paper's formula names no norm). No head sees a drafted token."""

    def __init__(self, hcfg: HeadsConfig, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base.cfg, [])
        self.blocks = nnx.List([ResBlock(base.cfg.hidden_size, base.dtype, rngs) for _ in range(hcfg.num_heads)])

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        return hidden_normed, cache

    def node_state(self, base, k, state, token):
        return state

    def node_hidden(self, base, k, state, token):
        return self.blocks[k](state)

    def expand(self, base, state, frontier, vocab=None):
        """One distribution per depth, from the context alone: [B, 1, V], no carry."""
        return self.node_logits(base, frontier.depth, state.context, None, vocab)[:, None], None, state
