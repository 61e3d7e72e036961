"""EAGLE-1: the draft model fed the base model's last hidden state (before the final norm) and the next
token, FC([E(x); f]) into one decoder layer, scored by the base model's frozen norm and lm_head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.draft_model import DraftLayer, EagleDrafter
from clover_jax.model.layers import Linear
from clover_jax.model.llama import Llama


class Eagle(EagleDrafter):
    """EAGLE-1: x = FC([E(x_{t+1}); f_t]) (2D -> D, bias) into one decoder layer without an input norm,
    f_t the base model's last hidden state before the final norm; the output predicts f_{t+1}, scored by
    the base model's frozen final norm and lm_head. Trained with uniform noise of width 0.2 on the
    target features (the authors' AddUniformNoise(std=0.2) also scales it by 512 / sequence length)."""

    feature_noise = 0.2

    def __init__(self, hcfg, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        super().__init__(hcfg, base, DraftLayer(cfg, d, dtype=dtype, rngs=rngs))
        self.fc = Linear(2 * d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)

    def committed_feature(self, base, hidden, features):
        return hidden

    def entry(self, base, tokens, feature):
        e = jax.lax.stop_gradient(base.embed_tokens(tokens, feature.dtype))
        x = self.fc(jnp.concatenate([e, feature], -1))
        return x, x

    def logits(self, base, out, vocab=None):
        normed = base.norm(out)
        return base.logits(normed) if vocab is None else vocab.logits(normed)
