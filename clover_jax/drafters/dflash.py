"""DFlash: a block drafter. One pass of a small draft model, conditioned on the base model's features,
drafts a whole block: every position of the block gets its distribution at once.

The draft model (the DFlash authors' `DFlashDraftModel`, layer for layer):
- context: the outputs of the base decoder layers `target_layer_ids` (0-based, as heads.json's
  `aux_layer_ids`; HF hidden state id + 1) at committed positions, concatenated, then `fc` (no bias) and
  `hidden_norm`. The same projected context feeds every draft layer, which projects its own keys and
  values of it (`k_norm` included), rotated to the context's positions; these live in the drafter's own
  KV cache and only committed positions are ever written there;
- the block: [the root token, mask_token_id x (b - 1)] at positions L .. L + b - 1 (L committed
  tokens), the base model's raw input embedding rows times `input_embedding_scale`;
- Qwen3-style layers (pre-norms, per-head q/k RMSNorm, SwiGLU): queries from the block only; keys and
  values from [cached context; block]; the block sees itself whole (not causal);
- the final `norm`, then the base model's lm_head scores block positions 1..b-1, times
  `output_multiplier`, tanh-softcapped by `final_logit_softcapping` where set.
Drafting: the root's `expand` runs the block and keeps its b - 1 output vectors; depth d's nodes all
share position d + 1's distribution ([B, 1, V], as Medusa's heads give), so chains, static and dynamic
trees draft from one pass. `depth` is b - 1.

Training (`train_forward`) runs, for every position t, the block whose root is token t + 1, reading the
context up to t: what decoding drafts after committing t + 1 tokens. Its loss weights block position k
(1-based) by exp(-(k - 1) / gamma), the paper's decay.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from clover_jax.drafters.base import Committed, Drafter, DrafterConfig, Frontier
from clover_jax.drafters.draft_model import ConfigKeys, layer_config
from clover_jax.drafters.losses import masked_mean, shift_left, targets_and_masks
from clover_jax.drafters.registry import Method, register
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.cache import KVCache
from clover_jax.model.config import ModelConfig
from clover_jax.model.layers import DecoderLayer, Linear, RMSNorm, _split_softmax, attend, product
from clover_jax.model.llama import Llama
from clover_jax.model.sharding import constrain_cache
from clover_jax.trees.static import MAX_NODES

# The paper's decay of the loss over block positions, by block size (16, 10, 8); other sizes take the
# nearest listed one's.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The authors' `build_target_layer_ids`: one draft layer reads the middle layer (L // 2); more read
    layers spread evenly from 1 to L - 3, as many as there are draft layers (clamped into tiny models)."""
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        span = num_target_layers - 4
        ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return tuple(min(max(int(i), 0), num_target_layers - 1) for i in ids)


@dataclasses.dataclass(frozen=True)
class DFlashConfig(DrafterConfig):
    """DFlash's options (num_heads is the block size less one): `draft_layers`, its decoder layers;
    `draft_layer`, their shape as config.json keys (`draft_model.DRAFT_LAYER_KEYS`; None: the base
    model's layer shape); `target_layer_ids`, the base decoder layers (0-based outputs) it reads (None:
    `default_layer_ids`); `mask_token_id` (None: the last token id); `input_embedding_scale`,
    `output_multiplier` and `final_logit_softcapping` (None or 0: off), as the authors' dflash_config
    names them."""

    draft_layers: int = 1
    draft_layer: dict | None = None
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads + 1 > MAX_NODES:
            raise CloverError(f"block size {self.num_heads + 1} is above the {MAX_NODES} nodes a step verifies: a chain "
                              f"through the whole block could not be checked; use a block of at most {MAX_NODES}")
        if not isinstance(self.draft_layers, int) or self.draft_layers < 1:
            raise CloverError(f"draft_layers={self.draft_layers!r} must be an integer >= 1")
        if self.draft_layer is not None:
            if not isinstance(self.draft_layer, dict):
                raise CloverError(f"draft_layer={self.draft_layer!r} must be a dict of config.json keys")
            object.__setattr__(self, "draft_layer", ConfigKeys(self.draft_layer))
        ids = self.target_layer_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise CloverError(f"target_layer_ids={ids!r} must be a list of decoder layer indices (0-based)")
            object.__setattr__(self, "target_layer_ids", tuple(ids))
        if self.mask_token_id is not None and (not isinstance(self.mask_token_id, int) or self.mask_token_id < 0):
            raise CloverError(f"mask_token_id={self.mask_token_id!r} must be a token id (an integer >= 0)")
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is None and name == "final_logit_softcapping":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CloverError(f"{name}={value!r} must be a finite number")
            object.__setattr__(self, name, float(value))


def draft_layer_config(base_cfg: ModelConfig, hcfg: DFlashConfig) -> ModelConfig:
    """The draft layers' config: Qwen3 layers (q/k norms, no q/k/v bias) of the base model's width, shaped
    as hcfg.draft_layer says (or as the base model's layers)."""
    cfg = layer_config(base_cfg, hcfg.draft_layer)
    return dataclasses.replace(cfg, model_type="qwen3", qk_norm=True, qkv_bias=False, num_layers=hcfg.draft_layers)


@flax.struct.dataclass
class DFlashState:
    """The drafter's state between steps."""

    cache: KVCache  # each draft layer's keys/values of the projected context: committed positions only
    block: jax.Array  # [B, b - 1, D] the last block's normed outputs at positions 1..b-1 (scored per depth)


class DFlashDrafter(nnx.Module, Drafter):
    """The DFlash draft model (the module docstring) behind the drafter interface. Parameters are named
    as the authors' checkpoints name them: fc, hidden_norm, layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj
    (q/k/v fused here), self_attn.{q,k}_norm, post_attention_layernorm, mlp.*}, norm."""

    def __init__(self, hcfg: DFlashConfig, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        ids = hcfg.target_layer_ids or default_layer_ids(cfg.num_layers, hcfg.draft_layers)
        if max(ids) >= cfg.num_layers:
            raise CloverError(f"DFlash target_layer_ids {list(ids)} name layers the {cfg.num_layers}-layer base model "
                              "does not have; this drafter belongs to a deeper model")
        mask = cfg.vocab_size - 1 if hcfg.mask_token_id is None else hcfg.mask_token_id
        if mask >= cfg.vocab_size:
            raise CloverError(f"DFlash mask_token_id {mask} is outside the base model's vocabulary (0..{cfg.vocab_size - 1}); "
                              "this drafter belongs to another model")
        self.hcfg = dataclasses.replace(hcfg, target_layer_ids=tuple(ids), mask_token_id=mask)  # heads.json names them
        self.feature_layers = tuple(ids)
        self.layer_cfg = lcfg = draft_layer_config(cfg, hcfg)
        self.fc = Linear(len(ids) * d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(d, lcfg.rms_norm_eps, dtype)
        self.layers = nnx.List([DecoderLayer(lcfg, dtype=dtype, rngs=rngs) for _ in range(hcfg.draft_layers)])
        self.norm = RMSNorm(d, lcfg.rms_norm_eps, dtype)

    @property
    def depth(self) -> int:
        """b - 1: the block's mask positions, the deepest tree it drafts."""
        return self.hcfg.num_heads

    @property
    def block_size(self) -> int:
        return self.hcfg.num_heads + 1

    # ------------------------------------------------------------------ the model's pieces

    def context(self, base: Llama, features) -> jax.Array:
        """[B, T, D] hidden_norm(fc([features of each target layer])) from features [B, T, F, D]. HF's
        hidden state after the last layer is the normed one, so the last layer's output is normed first."""
        b, t = features.shape[:2]
        features = features.astype(base.dtype)
        last = [i for i, layer in enumerate(self.feature_layers) if layer == base.cfg.num_layers - 1]
        for i in last:
            features = features.at[:, :, i].set(base.norm(features[:, :, i]))
        return self.hidden_norm(self.fc(features.reshape(b, t, -1)))

    def block_input(self, base: Llama, roots) -> jax.Array:
        """[..., b, D]: the embedded block [root, mask x (b - 1)] for roots [...] (raw embedding rows,
        without the base model's own embedding scale, times input_embedding_scale)."""
        table = jax.lax.stop_gradient(base.embed_tokens.embedding[...])
        tokens = jnp.concatenate([roots[..., None], jnp.full(roots.shape + (self.depth,), self.hcfg.mask_token_id,
                                                             roots.dtype)], -1)
        rows = jnp.take(table, tokens, axis=0)
        return (rows * jnp.asarray(self.hcfg.input_embedding_scale, rows.dtype)).astype(base.dtype)

    def scores(self, base: Llama, normed, vocab: DraftVocab | None = None) -> jax.Array:
        """Logits [..., V] (or [..., N] over `vocab`) of normed block outputs [..., D]: the base model's
        lm_head times output_multiplier, softcapped where set."""
        logits = base.logits(normed) if vocab is None else vocab.logits(normed).astype(jnp.float32)
        logits = logits * self.hcfg.output_multiplier
        cap = self.hcfg.final_logit_softcapping
        return jnp.tanh(logits / cap) * cap if cap else logits

    def layer_forward(self, i: int, x, attention):
        """Draft layer i on blocks x [..., b, D]: pre-norm attention (`attention(layer, h)`: q and the
        block's k/v of h [..., b, D] over the context, as [..., b, N, H]) and SwiGLU MLP, each around
        `mix_in` / `mix_out` (nothing in DFlash; DFlash 2's convolutions)."""
        layer = self.layers[i]
        h, later = self.mix_in(i, "attention", layer.input_layernorm(x))
        attn = attention(layer, h)
        x = x + self.mix_out(i, "attention", layer.self_attn.o_proj(attn.reshape(*attn.shape[:-2], -1)), later)
        h, later = self.mix_in(i, "mlp", layer.post_attention_layernorm(x))
        return x + self.mix_out(i, "mlp", layer.mlp(h), later)

    def mix_in(self, i: int, where: str, h):
        """What enters layer i's attention or MLP (`where`) of its normed input h, and what `mix_out`
        needs of it: h itself here."""
        return h, None

    def mix_out(self, i: int, where: str, out, later):
        """What layer i's attention or MLP output adds to the residual stream: the output itself here."""
        return out

    # ------------------------------------------------------------------ the engine's calls

    def init(self, base: Llama, batch: int, cache_len: int, mesh=None) -> DFlashState:
        c = self.layer_cfg
        cache = KVCache.zeros(c.num_layers, batch, cache_len, c.num_kv_heads, c.head_dim, base.dtype)
        return DFlashState(constrain_cache(cache, mesh), jnp.zeros((batch, self.depth, c.hidden_size), base.dtype))

    def commit(self, base: Llama, state: DFlashState, new: Committed, count, live) -> DFlashState:
        """Each layer's keys/values of the T new context entries, at positions lengths .. lengths + T - 1;
        the cache advances by count (the slots past it are written over before anything reads them)."""
        c = state.cache
        ctx = self.context(base, new.features)
        positions = c.lengths[:, None] + jnp.arange(ctx.shape[1])[None, :]
        cache = c
        for i, layer in enumerate(self.layers):
            _, k, v = layer.self_attn.project(ctx, positions)
            cache = cache.write(i, k, v)
        return state.replace(cache=cache.advance(jnp.where(live, count, 0)))

    def run_block(self, base: Llama, cache: KVCache, roots) -> jax.Array:
        """[B, b - 1, D] the normed outputs at block positions 1..b-1 of the blocks rooted at roots [B]
        (at position lengths), over every committed context entry and the block itself."""
        b = self.block_size
        x = self.block_input(base, roots)
        positions = cache.lengths[:, None] + jnp.arange(b)[None, :]
        seen = jnp.arange(cache.max_len)[None, None, :] < (cache.lengths + b)[:, None, None]
        mask = jnp.broadcast_to(seen, (roots.shape[0], b, cache.max_len))
        for i in range(len(self.layers)):
            def attention(layer, h, i=i):
                q, k, v = layer.self_attn.project(h, positions)
                return attend(q, k, v, mask, cache, i)
            x = self.layer_forward(i, x, attention)
        return self.norm(x[:, 1:])

    def expand(self, base: Llama, state: DFlashState, frontier: Frontier, vocab: DraftVocab | None = None):
        """The root runs the block; depth d's nodes share block position d + 1's logits [B, 1, V]."""
        if frontier.depth == 0:
            state = state.replace(block=self.run_block(base, state.cache, frontier.tokens[:, 0]))
        return self.level_logits(base, state.block[:, frontier.depth], frontier.tokens, vocab), None, state

    def level_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """The logits of a level's children from its block position's output out [B, D] and the level's
        tokens [B, F]: [B, 1, V or N], shared by the level (DFlash 2 scores each node's own)."""
        return self.scores(base, out[:, None], vocab)

    # ------------------------------------------------------------------ training

    def train_forward(self, base: Llama, tokens, hidden, hidden_normed=None, features=None,
                      vocab: DraftVocab | None = None, key=None, steps: int | None = None):
        """(outputs [K, B, T, D], logits [K, B, T, V or N]): at every position t the block rooted at token
        t + 1 (position t + 1) over the context at positions 0..t, its position k + 1 scoring token t + 2 + k;
        K = steps (default: b - 1). Every block is run whole, as decoding runs it."""
        bsz, t = tokens.shape
        b = self.block_size
        ctx = self.context(base, features)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bsz, t))
        block_pos = (pos[:, :, None] + 1 + jnp.arange(b)[None, None, :]).reshape(bsz, t * b)
        x = self.block_input(base, shift_left(tokens, 1))  # [B, T, b, D]
        before = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), T(context)]: context s <= t
        def attention(layer, h):
            _, kc, vc = layer.self_attn.project(ctx, pos)  # [B, K, T, H]
            q, kb, vb = layer.self_attn.project(h.reshape(bsz, t * b, -1), block_pos)
            return _block_attention(q, kc, vc, kb, vb, before, b)
        for i in range(len(self.layers)):
            x = self.layer_forward(i, x, attention)
        k = self.depth if steps is None else min(steps, self.depth)
        out = jnp.moveaxis(self.norm(x[:, :, 1 : k + 1]), 2, 0)  # [K, B, T, D]
        return out, self.train_logits(base, out, tokens, vocab)

    def train_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """[K, B, T, V or N] the logits training scores of the outputs out [K, B, T, D] of the blocks
        over windows tokens [B, T]: the shared ones decoding drafts from."""
        return self.scores(base, out, vocab)


def _block_attention(q, kc, vc, kb, vb, before, b: int) -> jax.Array:
    """Training's attention of T blocks of b queries each, q [B, T*b, N, H]: block t reads the context
    keys/values kc/vc [B, K, T, H] where before[t] says and its own b keys/values kb/vb [B, K, T*b, H]
    whole. Returns [B, T, b, N, H]."""
    bsz, _, n, h = q.shape
    kv, t = kc.shape[1], kc.shape[2]
    q6 = q.reshape(bsz, t, b, kv, n // kv, h)
    kb, vb = (x.reshape(bsz, kv, t, b, h) for x in (kb, vb))
    scale = 1.0 / np.sqrt(h)
    s_ctx = product("btjkgh,bksh->bktjgs", q6, kc.astype(q.dtype)).astype(jnp.float32) * scale
    s_ctx = jnp.where(before[None, None, :, None, None, :], s_ctx, jnp.finfo(jnp.float32).min)
    s_own = product("btjkgh,bktih->bktjgi", q6, kb.astype(q.dtype)).astype(jnp.float32) * scale
    p_ctx, p_own = _split_softmax(s_ctx, s_own)
    out = (product("bktjgs,bksh->btjkgh", p_ctx.astype(q.dtype), vc.astype(q.dtype))
           + product("bktjgi,bktih->btjkgh", p_own.astype(q.dtype), vb.astype(q.dtype)))
    return out.reshape(bsz, t, b, n, h)


def block_gamma(block_size: int) -> float:
    """The loss decay of a block size: the paper's gamma for 16, 10 and 8, else the nearest one's."""
    return PAPER_GAMMA[min(PAPER_GAMMA, key=lambda s: (abs(s - block_size), s))]


def dflash_loss(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """Cross-entropy on the data's token t+2+k at block position k + 1, weighted exp(-k / gamma) (the
    paper's exp(-(k - 1) / gamma) over 1-based positions; `block_gamma` of the block K + 1 long)."""
    k_steps = head_logits.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_steps)
    ce = optax.softmax_cross_entropy_with_integer_labels(head_logits.astype(jnp.float32), targets)
    per_step = jax.vmap(masked_mean)(ce, masks)
    weights = jnp.exp(-jnp.arange(k_steps, dtype=jnp.float32) / block_gamma(k_steps + 1))
    return jnp.sum(weights * per_step), per_step, masks, targets


register(Method("dflash", DFlashDrafter, DFlashConfig, depth=15, tree="medusa_mc_sim_7b_63", loss=dflash_loss,
                title="DFlash"))
