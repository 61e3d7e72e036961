"""EAGLE-3: the draft model fed a fusion (FC, 3D -> D) of a low, a middle and a high layer's hidden
states; attention over [norm(E(x)); norm(g)], its own norm and lm_head over a draft vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.drafters.draft_model import NO_LOGIT, DraftIds, DraftLayer, EagleDrafter
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear, RMSNorm
from clover_jax.model.llama import Llama, low_mid_high


class Eagle3(EagleDrafter):
    """EAGLE-3: committed features g = FC([low; mid; high]) (3D -> D, no bias) of the base layers
    `low_mid_high(L)`; attention reads [input_norm(E(x)); hidden_norm(g)] (2D), g the residual; a
    draft entry's g is its parent's output. Scored by a norm and lm_head of its own over the draft
    vocabulary `ids` (hcfg.draft_vocab tokens, 0: all; `set_vocab` picks them), initialised from the
    base model's final norm and lm_head rows."""

    def __init__(self, hcfg, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        super().__init__(hcfg, base, DraftLayer(cfg, 2 * d, dtype=dtype, rngs=rngs))
        self.feature_layers = low_mid_high(cfg.num_layers)
        self.fc = Linear(3 * d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.norm.weight[...] = jnp.copy(base.norm.weight[...])
        n = hcfg.draft_vocab or cfg.vocab_size
        self.lm_head = Linear(d, n, ("embed", "vocab"), dtype=dtype, rngs=rngs)
        self.ids = DraftIds(jnp.arange(n, dtype=jnp.int32))
        self.set_vocab(base, self.ids[...])

    def set_vocab(self, base: Llama, ids) -> None:
        """Draft from token ids [N] (in id order): their base lm_head rows become the draft lm_head."""
        ids = jnp.asarray(ids, jnp.int32)
        self.ids[...] = ids
        rows = jnp.take(base.lm_head_weight(), ids, axis=0)
        self.lm_head.kernel[...] = rows.T.astype(self.lm_head.kernel[...].dtype)

    def committed_feature(self, base, hidden, features):
        b, t = features.shape[:2]
        return self.fc(features.reshape(b, t, -1).astype(base.dtype))

    def entry(self, base, tokens, feature):
        e = jax.lax.stop_gradient(base.embed_tokens(tokens, feature.dtype))
        return jnp.concatenate([self.input_layernorm(e), self.hidden_norm(feature)], -1), feature

    def loss_vocab(self, base: Llama, vocab: DraftVocab | None) -> DraftVocab:
        """Its own draft vocabulary, whatever was asked: EAGLE-3 learns over the tokens it drafts."""
        return DraftVocab(ids=self.ids[...], rows=jnp.take(base.lm_head_weight(), self.ids[...], axis=0))

    def train_logits(self, base: Llama, out, vocab: DraftVocab | None):
        """Over its own draft vocabulary [..., N] when `vocab` is given (`loss_vocab`'s: the same ids),
        so training never spreads them over the whole vocabulary."""
        return self.logits(base, out) if vocab is None else self.lm_head(self.norm(out)).astype(jnp.float32)

    def drafting_vocab(self, base: Llama, vocab: DraftVocab | None) -> DraftVocab | None:
        """The engine's draft vocabulary cut to the tokens of its own (no other can be drafted), with
        its own lm_head's rows of them: a draft level then multiplies K rows, not all N of its own."""
        if vocab is None:
            return None
        where = np.full(base.cfg.vocab_size, -1, np.int64)
        where[np.asarray(self.ids[...])] = np.arange(self.ids[...].shape[0])
        ids = np.asarray(vocab.ids)
        rows = where[ids]
        if not (rows >= 0).any():
            raise CloverError("the draft vocabulary shares no token with these EAGLE-3 heads' own; "
                              "pass --draft-vocab 0 or auto")
        ids, rows = ids[rows >= 0], rows[rows >= 0]
        return DraftVocab(ids=jnp.asarray(ids, jnp.int32), rows=jnp.take(self.lm_head.kernel[...].T, rows, axis=0))

    def logits(self, base, out, vocab=None):
        """Over the whole vocabulary (NO_LOGIT off its own ids), or over `drafting_vocab`'s tokens."""
        if vocab is not None:
            return vocab.logits(self.norm(out))
        own = self.lm_head(self.norm(out)).astype(jnp.float32)  # [..., N]
        return jnp.full(own.shape[:-1] + (base.cfg.vocab_size,), NO_LOGIT, jnp.float32).at[..., self.ids[...]].set(own)
