"""EAGLE-1 and EAGLE-3: draft *models*, autoregressive on features, behind the drafter interface.

Both run one Llama decoder layer (`DraftLayer`) over entries: entry t pairs the token x_{t+1} with a
feature at t, and the layer's output o_t is the predicted feature at t+1, which scores x_{t+2}.
- committed entries (`commit`) take the base model's feature: EAGLE-1 its last hidden state before the
  final norm (after it in the authors' published drafters: switch normed_features), EAGLE-3 an FC
  fusion (3D -> D) of a low, a middle and a high layer's outputs (`eagle3.eagle3_layers`), both
  from verification's own forward pass; they go into the draft layer's own KV cache, written only for
  the committed (accepted) positions, so it never holds a rejected token;
- a tree node at depth k >= 1 is entry L - 1 + k (its position), holding its token and its parent's
  output o as the feature (the Frontier's carry); its K/V go to cache slot L - 1 + its draft slot and
  it reads the committed entries plus its ancestors' (`frontier.ancestors`, the mask verification
  uses). The root's entry is the last committed one, so the root's children come from `context`.
Scoring: EAGLE-1 through the base model's frozen final norm and lm_head; EAGLE-3 through a norm and an
lm_head of its own over a reduced draft vocabulary (`ids`, spread back over the whole vocabulary).
The entry: EAGLE-1 x = FC([E(x_{t+1}); f_t]) (2D -> D, bias; the layer has no input norm, as the
authors' first layer); EAGLE-3 attends over [input_norm(E(x_{t+1})); hidden_norm(g_t)] (q, k, v
project from 2D) with g_t the residual stream. E is the base model's input embedding, frozen.
The layer has the base model's layer shape unless `EagleConfig.draft_layer` gives one of its own
(published drafters have their own heads, MLP width and RoPE: `layer_config`), and `EagleConfig.switches`
turns on the published variants a drafter implements (its config's `SWITCHES`; any other is refused in one line).

Training (`train_forward`, `unroll`) is EAGLE-3's training-time test for both: step 0 runs the layer causally over the
target features; step j feeds each position its own step j-1 output and the true token j further
on, at position t + j, reading the step-0 entries up to t and its own chain (steps 1..j at t): exactly
the entries a chain drafted from root x_{t+1} reads in decoding.
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import Committed, Drafter, DrafterConfig, Frontier
from clover_jax.drafters.losses import shift_left
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.cache import KVCache, causal_mask, tree_mask
from clover_jax.model.config import ModelConfig, rope_inv_freq
from clover_jax.model.layers import MLP, Attention, QKVProjection, RMSNorm, apply_rope, attend_unrolled
from clover_jax.model.llama import Llama, causal_self_mask
from clover_jax.model.sharding import constrain_cache

NO_LOGIT = -1e9  # the logit of a token outside EAGLE-3's draft vocabulary: probability 0, finite log

# The config.json keys of a draft layer that a checkpoint sets apart from the base model's layers
# (`EagleConfig.draft_layer` holds all of them, or is None).
DRAFT_LAYER_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                    "rope_theta", "rope_scaling")


def layer_config(base_cfg: ModelConfig, draft_layer: dict | None) -> ModelConfig:
    """The draft layer's config: a Llama layer of the base's width with draft_layer's keys (every one of
    DRAFT_LAYER_KEYS; rope_scaling None or HF's dict), or with the base model's layer shape (draft_layer
    None). Either way a Llama layer, as the authors' drafters are for every base: what a family adds
    (Qwen3's and Gemma's q/k norms, Gemma's (1 + w) norms, GeGLU, score scalar and sliding window) is
    not in it. A missing or unknown key, or a value the engine does not run (a rope type it lacks), is
    one line."""
    if draft_layer is None:
        family = {f.name: f.default for f in dataclasses.fields(base_cfg) if f.metadata.get("family")}
        return dataclasses.replace(base_cfg, model_type="llama", **family)
    missing = [k for k in DRAFT_LAYER_KEYS if k not in draft_layer]
    unknown = sorted(set(draft_layer) - set(DRAFT_LAYER_KEYS))
    if missing or unknown:
        raise CloverError(f"draft_layer {'lacks' if missing else 'has unknown'} key {(missing or unknown)[0]!r}; "
                          f"it holds exactly {', '.join(DRAFT_LAYER_KEYS)}")
    hf = {"model_type": "llama", "vocab_size": base_cfg.vocab_size, "hidden_size": base_cfg.hidden_size,
          "num_hidden_layers": 1, "max_position_embeddings": base_cfg.max_position_embeddings, **draft_layer}
    return ModelConfig.from_hf_dict(hf)


def layer_keys(cfg: ModelConfig) -> dict:
    """`layer_config`'s inverse: the DRAFT_LAYER_KEYS of a layer config, as config.json writes them."""
    hf = cfg.to_hf_dict()
    return {k: hf[k] for k in DRAFT_LAYER_KEYS}


class ConfigKeys(dict):
    """config.json keys that hash: a drafter's config is a static part of its graph, which jit hashes."""

    def __hash__(self):
        return hash(json.dumps(self, sort_keys=True))


@dataclasses.dataclass(frozen=True)
class EagleConfig(DrafterConfig):
    """A draft model's options: `draft_layer`, its decoder layer's own config where a checkpoint gives it
    one unlike the base model's layers, as config.json keys (DRAFT_LAYER_KEYS; None: the base model's);
    `switches`, the published variants' switches that are on, by their checkpoint configs' names (each
    subclass's SWITCHES), e.g. ("norm_before_residual",); () for the drafters train.train makes."""

    SWITCHES: ClassVar[tuple[str, ...]] = ()
    draft_layer: dict | None = None
    switches: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if self.draft_layer is not None:
            if not isinstance(self.draft_layer, dict):
                raise CloverError(f"draft_layer={self.draft_layer!r} must be a dict of config.json keys")
            object.__setattr__(self, "draft_layer", ConfigKeys(self.draft_layer))
        if not isinstance(self.switches, (list, tuple)) or not all(isinstance(s, str) for s in self.switches):
            raise CloverError(f"switches={self.switches!r} must be a list of switch names")
        object.__setattr__(self, "switches", tuple(self.switches))
        odd = [s for s in self.switches if s not in self.SWITCHES]
        if odd:
            raise CloverError(f"{self.method} drafters have no switch {odd[0]!r} "
                              f"(theirs: {', '.join(self.SWITCHES) or 'none'})")


@flax.struct.dataclass
class EagleState:
    """The draft model's state between steps."""

    cache: KVCache  # the draft layer's own cache: committed entries only (slots [0, lengths))
    context: jax.Array  # [B, D] the layer's output at the last committed entry (scores the root's children)


class DraftLayer(nnx.Module):
    """A Llama decoder layer whose attention reads `width`-wide input (2D for EAGLE-3) while its
    residual stream stays D wide; the input norm is the caller's."""

    def __init__(self, cfg: ModelConfig, width: int, *, dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        if width != cfg.hidden_size:
            self.self_attn.qkv_proj = QKVProjection(dataclasses.replace(cfg, hidden_size=width), dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, attn_in, residual, positions, mask, cache: KVCache | None):
        """Decoding: attention over the cache's committed slots and the new entries (mask [B, T, S])."""
        attn, cache = self.self_attn(attn_in, positions, mask, cache, 0)
        return self._rest(residual + attn), cache

    def project(self, attn_in, positions):
        """q [B, T, N, H] and k, v [B, K, T, H] of T entries, rotated to their positions."""
        a = self.self_attn
        q, k, v = a.qkv_proj(attn_in)
        inv_freq = rope_inv_freq(a.cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

    def over(self, q, keys, values, mask, own_keys, own_values, residual):
        """Training: the layer's output for queries q over the first step's keys/values [B, K, T, H]
        (mask [B, T, T]) and each later step's at the query's own position (`layers.attend_unrolled`)."""
        b, t = q.shape[:2]
        attn = self.self_attn.o_proj(attend_unrolled(q, keys, values, mask, own_keys, own_values).reshape(b, t, -1))
        return self._rest(residual + attn)

    def _rest(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleDrafter(nnx.Module, Drafter):
    """The shared draft-model plumbing; subclasses say what a committed entry's feature is
    (`committed_feature`), how an entry enters the layer (`entry`) and how an output is scored
    (`logits`)."""

    chained = True
    feature_noise = 0.0  # width of the uniform noise added to target features in training

    def __init__(self, hcfg, base: Llama, layer: DraftLayer):
        self.hcfg = hcfg
        self.layer = layer

    @property
    def depth(self) -> int:
        """The chained draft steps: the deepest tree it drafts."""
        return self.hcfg.num_heads

    def committed_feature(self, base: Llama, hidden, features):
        """[B, T, D] the feature of committed entries from the base model's hidden [B, T, D] and
        feature layers' outputs [B, T, F, D]."""
        raise NotImplementedError

    def entry(self, base: Llama, tokens, feature):
        """(attention input, residual) of entries holding tokens [B, T] and features [B, T, D]."""
        raise NotImplementedError

    def logits(self, base: Llama, out, vocab: DraftVocab | None = None):
        """Logits over the children of entries with layer outputs out [..., D]: [..., V], or [..., N]
        over the engine's draft vocabulary."""
        raise NotImplementedError

    def output(self, out):
        """What an entry whose layer output is out [..., D] hands on, as its children's feature and what
        `logits` scores: the output itself, unless a variant normalises it (speculators' norm_output)."""
        return out

    def init(self, base: Llama, batch: int, cache_len: int, mesh=None) -> EagleState:
        c = self.layer.self_attn.cfg  # the draft layer's own heads (`layer_config`)
        cache = KVCache.zeros(1, batch, cache_len, c.num_kv_heads, c.head_dim, base.dtype)
        return EagleState(constrain_cache(cache, mesh), jnp.zeros((batch, c.hidden_size), base.dtype))

    def _run(self, base, tokens, feature, positions, mask, cache):
        attn_in, residual = self.entry(base, tokens, feature)
        out, cache = self.layer(attn_in, residual, positions, mask, cache)
        return self.output(out), cache

    def commit(self, base: Llama, state: EagleState, new: Committed, count, live) -> EagleState:
        """The T new entries, causal over the committed ones; only the first count[b] are kept (the
        cache advances by count: later slots are overwritten before anything reads them)."""
        c = state.cache
        t = new.tokens.shape[1]
        feature = self.committed_feature(base, new.hidden, new.features)
        positions = c.lengths[:, None] + jnp.arange(t)[None, :]
        out, cache = self._run(base, new.tokens, feature, positions, causal_mask(c.lengths, t, c.max_len), c)
        last = jnp.take_along_axis(out, (count - 1)[:, None, None], axis=1)[:, 0]
        return EagleState(cache.advance(jnp.where(live, count, 0)), jnp.where(live[:, None], last, state.context))

    def expand(self, base: Llama, state: EagleState, frontier: Frontier, vocab: DraftVocab | None = None):
        """The root scores from the context; a deeper level runs its nodes as entries L - 1 + depth in
        slots L - 1 + slot (a level's slots are contiguous, so one write at its first slot), reading the
        committed entries and its ancestors. The draft entries stay beyond the committed length."""
        if frontier.carry is None:
            out = state.context[:, None]
        else:
            c = state.cache
            at = c.lengths - 1
            here = c.replace(lengths=at + frontier.slots[:, 0])
            mask = tree_mask(at, frontier.ancestors, c.max_len)
            out, here = self._run(base, frontier.tokens, frontier.carry, frontier.positions - 1, mask, here)
            state = state.replace(cache=here.replace(lengths=c.lengths))
        return self.logits(base, out, vocab), out, state

    def unroll(self, base: Llama, hidden, features, tokens, noise=None, steps: int | None = None) -> jax.Array:
        """Training-time test: [K, B, T, D] the layer's output at step k and position t, the feature a
        chain drafted from root x_{t+1} predicts at depth k (scoring x_{t+2+k}); each step is fed the
        true tokens and the previous step's outputs. hidden [B, T, D], features [B, T, F, D] or None,
        tokens [B, T]; noise [B, T, D] is added to the target features (EAGLE-1's augmentation);
        `steps` (default: every step) cuts the unroll to its first steps, K = steps."""
        b, t = tokens.shape
        feature = self.committed_feature(base, hidden, features)
        if noise is not None:
            feature = feature + noise.astype(feature.dtype)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        causal = causal_self_mask(b, t)
        keys, values, outs = [], [], []  # step k reads step 0's keys causally, steps 1..k's at its own position
        for k in range(self.depth if steps is None else min(steps, self.depth)):
            attn_in, residual = self.entry(base, shift_left(tokens, k + 1), feature)
            q, kk, vv = self.layer.project(attn_in, pos + k)
            keys.append(kk)
            values.append(vv)
            feature = self.output(self.layer.over(q, keys[0], values[0], causal, keys[1:], values[1:], residual))
            outs.append(feature)
        return jnp.stack(outs)

    def train_forward(self, base: Llama, tokens, hidden, hidden_normed=None, features=None,
                      vocab: DraftVocab | None = None, key=None, steps: int | None = None):
        """(outputs [K, B, T, D], logits [K, B, T, V or N]) of `unroll` (its first `steps`) for training,
        over the whole vocabulary or the loss vocabulary `vocab` (`loss_vocab`); with a key, target
        features get U(-w/2, w/2) noise, w = feature_noise. The base model's normed states are not read."""
        noise = None
        if key is not None and self.feature_noise:
            noise = self.feature_noise * (jax.random.uniform(key, hidden.shape, jnp.float32) - 0.5)
        out = self.unroll(base, hidden, features, tokens, noise, steps)
        return out, self.train_logits(base, out, vocab)

    def train_logits(self, base: Llama, out, vocab: DraftVocab | None):
        """The logits training scores outputs out [..., D] by: `logits`'s unless a subclass says otherwise."""
        return self.logits(base, out, vocab)
