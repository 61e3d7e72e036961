"""Medusa: K independent heads, head i = lm_head(h + SiLU(W_i h)); no head sees another's token, so a
depth's nodes share one distribution. Trained by cross-entropy on the data's tokens (`losses.cross_entropy`).

Medusa-1's published heads (`io.formats.medusa1`) are the same heads in two ways wider: a head applies its
ResBlock `head_layers` times (their medusa_num_layers; Medusa's code repeats one block, so the
applications share weights), and each head scores with a vocabulary projection of its own
(`own_lm_head`), initialised here as a copy of the base model's lm_head.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import DrafterConfig
from clover_jax.drafters.heads import Heads, ResBlock
from clover_jax.drafters.losses import cross_entropy
from clover_jax.drafters.registry import Method, register
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear, product
from clover_jax.model.llama import Llama


@dataclasses.dataclass(frozen=True)
class MedusaConfig(DrafterConfig):
    """Medusa's options, both Medusa-1's: `head_layers`, times each head applies its ResBlock (their
    medusa_num_layers; their code repeats one block, `[ResBlock(H)] * L`, so the applications share
    weights), and `own_lm_head`, each head scoring with a vocabulary projection of its own rather than
    the base model's frozen lm_head."""

    head_layers: int = 1
    own_lm_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.head_layers, int) or self.head_layers < 1:
            raise CloverError(f"head_layers={self.head_layers!r} must be an integer >= 1")
        if not isinstance(self.own_lm_head, bool):
            raise CloverError(f"own_lm_head={self.own_lm_head!r} must be true or false")


class MedusaHeads(Heads):
    """Head i: lm_head(h + SiLU(W_i h)), h the base model's last hidden state after the final norm (as
    Medusa's code feeds it; the paper's formula names no norm). No head sees a drafted token. With
    `hcfg.head_layers` L the block is applied L times; with `hcfg.own_lm_head` head i scores with
    `lm_heads[i]` (kernel [D, V]) instead of the base model's lm_head."""

    def __init__(self, hcfg: MedusaConfig, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base.cfg, [])
        d, v = base.cfg.hidden_size, base.cfg.vocab_size
        self.blocks = nnx.List([ResBlock(d, base.dtype, rngs) for _ in range(hcfg.num_heads)])
        # Each head's own vocabulary projection, a copy of the base model's lm_head to start; none when
        # the heads score with the base model's.
        own = [Linear(d, v, ("embed", "vocab"), dtype=base.dtype, rngs=rngs) for _ in range(hcfg.num_heads)
               if hcfg.own_lm_head]
        for head in own:
            head.kernel[...] = jnp.copy(base.lm_head_weight().T).astype(base.dtype)
        self.lm_heads = nnx.List(own)

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        return hidden_normed, cache

    def node_state(self, base, k, state, token):
        return state

    def node_hidden(self, base, k, state, token):
        for _ in range(self.hcfg.head_layers):
            state = self.blocks[k](state)
        return state

    def head_logits(self, base: Llama, k: int, hidden, vocab: DraftVocab | None = None):
        """Head k's logits of its lm_head inputs hidden [..., D]: [..., V] float32, or [..., N] over
        `vocab`'s tokens (their columns of the head's own projection, or the vocabulary's rows of the
        base model's lm_head)."""
        if not len(self.lm_heads):
            return base.logits(hidden) if vocab is None else vocab.logits(hidden)
        kernel = self.lm_heads[k].kernel[...]
        if vocab is not None:
            kernel = jnp.take(kernel, vocab.ids, axis=1)
        return product("...d,dn->...n", hidden, kernel.astype(hidden.dtype)).astype(jnp.float32)

    def node_logits(self, base, k, state, token, vocab=None):
        return self.head_logits(base, k, self.node_hidden(base, k, state, token), vocab)

    def expand(self, base, state, frontier, vocab=None):
        """One distribution per depth, from the context alone: [B, 1, V], no carry."""
        return self.node_logits(base, frontier.depth, state.context, None, vocab)[:, None], None, state

    def train_forward(self, base, tokens, hidden, hidden_normed, features=None, vocab=None, key=None, steps=None):
        """`unroll`'s lm_head inputs [K, B, T, D] and their logits [K, B, T, V or N], each head's through its
        own projection where it has one."""
        if not len(self.lm_heads):
            return super().train_forward(base, tokens, hidden, hidden_normed, features, vocab, key, steps)
        drafted = self.unroll(base, hidden, hidden_normed, tokens, steps)
        return drafted, jnp.stack([self.head_logits(base, k, drafted[k], vocab) for k in range(drafted.shape[0])])


register(Method("medusa", MedusaHeads, MedusaConfig, depth=4, tree="medusa_mc_sim_7b_63", loss=cross_entropy, title="Medusa"))
