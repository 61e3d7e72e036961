"""EAGLE-3: the draft model fed a fusion (FC, 3D -> D) of a low, a middle and a high layer's hidden
states; attention over [norm(E(x)); norm(g)], its own norm and lm_head over a draft vocabulary; trained on
every step of the training-time test against the base distribution over that vocabulary (`eagle3_loss`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.drafters.base import DraftIds
from clover_jax.drafters.draft_model import NO_LOGIT, DraftLayer, EagleConfig, EagleDrafter, layer_config
from clover_jax.drafters.losses import base_distribution, masked_mean, shifted, soft_cross_entropy, targets_and_masks
from clover_jax.drafters.registry import Method, register
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear, RMSNorm
from clover_jax.model.llama import Llama, clamp_layers

EAGLE3_DECAY = 0.8  # training-time test step k weighted 0.8^k (the authors' main.py)


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's three feature layers of an L-layer model, as its authors define them: the decoder layers
    whose *outputs* it fuses, 0-based, 1, L // 2 - 1 and L - 4 (the authors' code captures the hidden
    states entering layers 2, L // 2 and L - 3; SpecForge's `eagle_aux_hidden_state_layer_ids` default),
    clamped into the model for the tiny ones tests build. For SmolLM2 (L = 30): 1, 14, 26."""
    return clamp_layers((1, num_layers // 2 - 1, num_layers - 4), num_layers)


def legacy_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers EAGLE-3 heads exported before heads.json named them were trained on, outputs of 2,
    L // 2 and L - 3: one above the authors' (`eagle3_layers`). Their heads.json is read with these."""
    return clamp_layers((2, num_layers // 2, num_layers - 3), num_layers)


@dataclasses.dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    """EAGLE-3's options, beside a draft model's (`EagleConfig`): `draft_vocab`, the tokens its own
    lm_head scores (0: the whole vocabulary); `aux_layer_ids`, the base decoder layers whose outputs
    (0-based) it fuses, as the checkpoint formats name them (`eagle_aux_hidden_state_layer_ids`; None:
    the authors' default, `eagle3_layers(L)`); and the published variants' switches, as `Eagle3` says."""

    SWITCHES = ("norm_before_residual", "fc_norm", "norm_output")
    draft_vocab: int = 0
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
            raise CloverError(f"draft_vocab={self.draft_vocab!r} must be an integer >= 0 (0: the whole vocabulary)")
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise CloverError(f"aux_layer_ids={ids!r} must be a list of decoder layer indices (0-based)")
            object.__setattr__(self, "aux_layer_ids", tuple(ids))


class Eagle3(EagleDrafter):
    """EAGLE-3: committed features g = FC([low; mid; high]) (3D -> D, no bias) of the base layers
    hcfg.aux_layer_ids (default `eagle3_layers(L)`, the authors' outputs of 1, L // 2 - 1, L - 4);
    attention reads [input_norm(E(x)); hidden_norm(g)] (2D), g the residual; a draft entry's g is its
    parent's output. Scored by a norm and lm_head of its own over the draft vocabulary `ids`
    (hcfg.draft_vocab tokens, 0: all; `set_vocab` picks them), initialised from the base model's final
    norm and lm_head rows. The published variants' switches (`Eagle3Config.SWITCHES`, as SpecForge and speculators
    name them): norm_before_residual, the residual is hidden_norm(g); fc_norm, each feature layer's
    output gets an RMSNorm of its own (`fc_norm`) before the FC; norm_output, an entry hands on (and
    scores) norm(o) rather than o."""

    own_vocab = True

    def __init__(self, hcfg: Eagle3Config, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        layer_cfg = layer_config(cfg, hcfg.draft_layer)
        super().__init__(hcfg, base, DraftLayer(layer_cfg, 2 * d, dtype=dtype, rngs=rngs))
        layers = hcfg.aux_layer_ids or eagle3_layers(cfg.num_layers)
        if max(layers) >= cfg.num_layers:
            raise CloverError(f"EAGLE-3 aux_layer_ids {list(layers)} name layers the {cfg.num_layers}-layer base "
                              "model does not have; these heads belong to a deeper model")
        self.feature_layers = tuple(layers)
        self.hcfg = dataclasses.replace(hcfg, aux_layer_ids=self.feature_layers)  # heads.json names them
        eps = layer_cfg.rms_norm_eps  # the published drafters' norms all take the layer config's epsilon
        self.fc = Linear(len(layers) * d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.fc_norm = (nnx.List([RMSNorm(d, eps, dtype) for _ in layers]) if "fc_norm" in hcfg.switches
                        else None)
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.hidden_norm = RMSNorm(d, eps, dtype)
        self.norm = RMSNorm(d, eps, dtype)
        self.norm.weight[...] = base.norm.scale()
        self.norm_before_residual = "norm_before_residual" in hcfg.switches
        self.norm_output = "norm_output" in hcfg.switches
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
        features = features.astype(base.dtype)
        if self.fc_norm is not None:
            features = jnp.stack([norm(features[:, :, i]) for i, norm in enumerate(self.fc_norm)], 2)
        return self.fc(features.reshape(b, t, -1))

    def entry(self, base, tokens, feature):
        e = jax.lax.stop_gradient(base.embed_tokens(tokens, feature.dtype))
        normed = self.hidden_norm(feature)
        return (jnp.concatenate([self.input_layernorm(e), normed], -1),
                normed if self.norm_before_residual else feature)

    def output(self, out):
        return self.norm(out) if self.norm_output else out

    def _scored(self, out):
        """What the lm_head reads of an entry's `output` out: norm(out), or out itself when the output is
        normed already (norm_output)."""
        return out if self.norm_output else self.norm(out)

    def loss_vocab(self, base: Llama, vocab: DraftVocab | None) -> DraftVocab:
        """Its own draft vocabulary, whatever was asked: EAGLE-3 learns over the tokens it drafts."""
        return DraftVocab(ids=self.ids[...], rows=jnp.take(base.lm_head_weight(), self.ids[...], axis=0))

    def train_logits(self, base: Llama, out, vocab: DraftVocab | None):
        """Over its own draft vocabulary [..., N] when `vocab` is given (`loss_vocab`'s: the same ids),
        so training never spreads them over the whole vocabulary."""
        return self.logits(base, out) if vocab is None else self.lm_head(self._scored(out)).astype(jnp.float32)

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
                              "pass draft_vocab=0 (or auto)", arguments=("draft_vocab",))
        ids, rows = ids[rows >= 0], rows[rows >= 0]
        return DraftVocab(ids=jnp.asarray(ids, jnp.int32), rows=jnp.take(self.lm_head.kernel[...].T, rows, axis=0))

    def logits(self, base, out, vocab=None):
        """Over the whole vocabulary (NO_LOGIT off its own ids), or over `drafting_vocab`'s tokens."""
        if vocab is not None:
            return vocab.logits(self._scored(out))
        own = self.lm_head(self._scored(out)).astype(jnp.float32)  # [..., N]
        return jnp.full(own.shape[:-1] + (base.cfg.vocab_size,), NO_LOGIT, jnp.float32).at[..., self.ids[...]].set(own)


def eagle3_loss(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """EAGLE-3's training-time test: step k (weighted 0.8^k) learns the base model's distribution at
    t+1+k restricted to the draft vocabulary (the tokens whose head logits are not `NO_LOGIT`), by soft
    cross-entropy, where the base model's own choice there is in that vocabulary. No feature loss.
    Training hands it logits over the draft vocabulary itself (`Eagle3.loss_vocab`), all of them
    finite, with the targets outside it already masked: the same loss where the data's tokens are the
    base model's own choices (self-distilled data). Returns as `losses.cross_entropy_loss`."""
    k_heads = head_logits.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    in_vocab = head_logits[0, :1, :1] > -1e8  # [1, 1, V]: the draft vocabulary
    p_base = base_distribution(jnp.where(in_vocab, base_logits, -1e9))
    base_drafted = jnp.take(in_vocab[0, 0], jnp.argmax(base_logits, -1)).astype(jnp.float32)  # [B, T]
    ce = soft_cross_entropy(head_logits, shifted(p_base, k_heads))  # [K, B, T]
    per_head = jax.vmap(masked_mean)(ce, masks * shifted(base_drafted, k_heads))
    return jnp.sum(EAGLE3_DECAY ** jnp.arange(k_heads, dtype=jnp.float32) * per_head), per_head, masks, targets


# On accelerators it drafts its authors' dynamic tree (their from_pretrained defaults: 60, 10, 7).
register(Method("eagle3", Eagle3, Eagle3Config, depth=7, tree="eagle_mc_sim_7b_63", loss=eagle3_loss, title="EAGLE-3",
                accelerator_tree="eagle2:60,10,7"))
