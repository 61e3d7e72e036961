"""EAGLE-1: the draft model fed the base model's last hidden state (before the final norm) and the next
token, FC([E(x); f]) into one decoder layer, scored by the base model's frozen norm and lm_head; trained
on its first step's feature and distribution (`eagle_loss`). The authors' published drafters feed the
state after the final norm and score with the lm_head alone (switch normed_features).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.draft_model import DraftLayer, EagleConfig, EagleDrafter, layer_config
from clover_jax.drafters.losses import distill_steps
from clover_jax.drafters.registry import Method, register
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear
from clover_jax.model.llama import Llama

EAGLE_CE_WEIGHT = 0.1  # SmoothL1 on the feature + 0.1 x cross-entropy


@dataclasses.dataclass(frozen=True)
class Eagle1Config(EagleConfig):
    """EAGLE-1's options (`EagleConfig`'s); its one switch, normed_features, as `Eagle` says."""

    SWITCHES = ("normed_features",)


class Eagle(EagleDrafter):
    """EAGLE-1: x = FC([E(x_{t+1}); f_t]) (2D -> D, bias) into one decoder layer without an input norm,
    f_t the base model's last hidden state before the final norm; the output predicts f_{t+1}, scored by
    the base model's frozen final norm and lm_head. Trained with uniform noise of width 0.2 on the
    target features (the authors' AddUniformNoise(std=0.2) also scales it by 512 / sequence length).
    With switch normed_features, as the authors' code runs (`cnets1.py`, fed `base_model.model`'s
    output), f_t is the state after the final norm and the output is scored by the lm_head alone."""

    feature_noise = 0.2

    def __init__(self, hcfg, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        super().__init__(hcfg, base, DraftLayer(layer_config(cfg, hcfg.draft_layer), d, dtype=dtype, rngs=rngs))
        self.fc = Linear(2 * d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.normed = "normed_features" in hcfg.switches

    def committed_feature(self, base, hidden, features):
        return base.norm(hidden) if self.normed else hidden  # base.norm(hidden) is the pass's own normed state

    def entry(self, base, tokens, feature):
        e = jax.lax.stop_gradient(base.embed_tokens(tokens, feature.dtype))
        x = self.fc(jnp.concatenate([e, feature], -1))
        return x, x

    def logits(self, base, out, vocab=None):
        normed = out if self.normed else base.norm(out)
        return base.logits(normed) if vocab is None else vocab.logits(normed)

    def train_forward(self, base, tokens, hidden, hidden_normed=None, features=None, vocab=None, key=None,
                      steps=None):
        if self.normed:
            raise CloverError("EAGLE-1 drafters fed the normed feature (switch normed_features, the authors' "
                              "published ones) draft but do not train here: eagle_loss regresses the feature "
                              "before the final norm")
        return super().train_forward(base, tokens, hidden, hidden_normed, features, vocab, key, steps)


def eagle_loss(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """EAGLE-1 on the training-time test's steps (`EagleDrafter.unroll`): at step k the draft layer's
    output predicts the base model's feature at t+1+k (before the final norm, base_hidden [B, T, D]):
    SmoothL1 to it plus 0.1 x the soft cross-entropy against the base model's distribution there
    (`losses.distill_steps`). EAGLE-1 trains the first step alone (on the target features); the deeper
    steps are scored (per-step losses, accuracy) but weighted 0. Returns as `losses.cross_entropy_loss`."""
    per_step, masks, targets = distill_steps(head_hidden, head_logits, base_hidden, base_logits, tokens, loss_mask,
                                             feature_weight=1.0, ce_weight=EAGLE_CE_WEIGHT)
    return per_step[0], per_step, masks, targets


# On accelerators it drafts EAGLE-2's dynamic tree, as the authors' EAGLE-2 release evaluates it (60
# nodes, top-k 10, depth 5).
register(Method("eagle", Eagle, Eagle1Config, depth=5, tree="eagle_mc_sim_7b_63", loss=eagle_loss, trained_steps=1,
                title="EAGLE-1", accelerator_tree="eagle2:60,10,5"))
