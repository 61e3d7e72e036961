"""Draft heads: Medusa, Clover and Clover-2, drafters (`drafter.Drafter`) built on three questions.

Every head family answers three questions (k = depth of a tree node, 0 for the root):
- `context`: per-position context states from the base model's hidden states (and, for Clover-2, the
  next token), running the Augmenting Block over its own KV cache where the method has one;
- `node_state(k, parent_state, token)`: the state of a node at depth k holding `token`, from its
  parent's state (the root's parent state is the context) - the Regressive Connection;
- `node_hidden(k, state, token)`: the vector [.., D] the base model's frozen `lm_head` turns into
  logits over the node's children (`node_logits`); Clover-2's distillation loss reads it.
`init`/`commit`/`expand` (the drafter interface) are built on them here: the state is the Augmenting
Block's cache and the context at the last committed position, a node's carry is its state. Medusa
ignores tokens (`token_dependent = False`), so its `expand` computes one distribution per depth.
The architectures and initialisations are SPEC section 2's; where the papers leave a detail open, the
choice follows the authors' code and is said in the docstring.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.cache import KVCache, causal_mask
from clover_jax.config import ModelConfig
from clover_jax.draft_vocab import DraftVocab
from clover_jax.drafter import Committed, Drafter, Frontier
from clover_jax.errors import CloverError
from clover_jax.layers import DecoderLayer, Linear, RMSNorm
from clover_jax.model import Llama
from clover_jax.sharding import constrain_cache


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """Which heads (method, count) and their initialisation; saved beside the weights in heads.json."""

    method: str
    num_heads: int
    embed_source: str = "lm_head"  # Clover-2's token embedding: "lm_head" (frozen copy) or "input"
    noise: float = 0.01  # scale of the uniform noise added to identity initialisations
    draft_vocab: int = 0  # EAGLE-3: the tokens its own lm_head scores (0: the whole vocabulary)

    def __post_init__(self):
        from clover_jax import methods  # the registry names these classes: imported late

        methods.get(self.method)
        if self.num_heads < 1:
            raise CloverError(f"num_heads={self.num_heads} must be >= 1")
        if self.draft_vocab < 0:
            raise CloverError(f"draft_vocab={self.draft_vocab} must be >= 0 (0: the whole vocabulary)")
        if self.embed_source not in ("lm_head", "input"):
            raise CloverError(f"embed_source={self.embed_source!r} must be 'lm_head' or 'input'")

    @property
    def aug_layers(self) -> int:
        from clover_jax import methods

        return methods.get(self.method).aug_layers


def _eye_plus_uniform(key, n: int, m: int, noise: float, dtype) -> jax.Array:
    """Identity on the leading min(n, m) diagonal (for W2 [2D, D]: the rows reading s) plus U(0, noise),
    as the authors' `eye_with_uniform`."""
    return (jnp.eye(n, m, dtype=dtype) + noise * jax.random.uniform(key, (n, m), dtype)).astype(dtype)


def _gate_heads(cfg: ModelConfig) -> int:
    """The decoders split D into the base model's attention-head count, as the authors' code asserts."""
    if cfg.hidden_size % cfg.num_heads:
        raise CloverError(f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
                          f"{cfg.num_heads}; the attention decoder cannot split it into heads")
    return cfg.num_heads


def _copy_layer(src: DecoderLayer, dst: DecoderLayer) -> None:
    """Initialise an Augmenting Block layer from the base model's last layer (weights copied)."""
    nnx.update(dst, jax.tree.map(jnp.copy, nnx.state(src, nnx.Param)))


class ResBlock(nnx.Module):
    """Medusa's residual block x + SiLU(W x + b), W zero-initialised so a new head starts as lm_head."""

    def __init__(self, dim: int, dtype, rngs: nnx.Rngs):
        self.linear = Linear(dim, dim, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.linear.kernel[...] = jnp.zeros_like(self.linear.kernel[...])

    def __call__(self, x):
        return x + jax.nn.silu(self.linear(x))


def token_embeddings(base: Llama, source: str, normalise: bool, tokens: jax.Array | None = None) -> jax.Array:
    """Token embeddings the heads read (frozen): lm_head rows (Clover normalises them) or the input
    embedding table; [V, D], or [..., D] the rows of `tokens` [...]. The rows are gathered before they
    are normalised (each row on its own), so a draft level normalises its nodes' rows, not all V."""
    table = base.lm_head_weight() if source == "lm_head" else base.embed_tokens.embedding[...]
    table = jax.lax.stop_gradient(table if tokens is None else jnp.take(table, tokens, axis=0))
    if normalise:
        tf = table.astype(jnp.float32)
        table = (tf / (jnp.linalg.norm(tf, axis=-1, keepdims=True) + 1e-6)).astype(table.dtype)
    return table


@flax.struct.dataclass
class HeadsState:
    """The heads' drafting state between steps."""

    aug_cache: KVCache | None  # the Augmenting Block's own cache (None for Medusa)
    context: jax.Array  # [B, D] the context state at the last committed position


class Heads(nnx.Module, Drafter):
    """Shared plumbing and the drafter interface; subclasses define the three questions above."""

    token_dependent = True

    def __init__(self, hcfg: HeadsConfig, base_cfg: ModelConfig, aug: list[DecoderLayer]):
        self.hcfg = hcfg
        self.base_cfg = base_cfg
        self.aug = nnx.List(aug)

    @property
    def num_heads(self) -> int:
        """K: the deepest tree these heads can draft."""
        return self.hcfg.num_heads

    def init(self, base: Llama, batch: int, cache_len: int, mesh=None) -> HeadsState:
        """Empty state: no committed position yet."""
        aug = constrain_cache(self.init_aug_cache(batch, cache_len, base.dtype), mesh)
        return HeadsState(aug_cache=aug, context=jnp.zeros((batch, self.base_cfg.hidden_size), base.dtype))

    def commit(self, base: Llama, state: HeadsState, new: Committed, count, live) -> HeadsState:
        """The context over the T new positions (the Augmenting Block causal over its cache, written
        after each sequence's length); live sequences advance by count and keep the context at their
        last new position, the others stay as they were."""
        aug = state.aug_cache
        t = new.tokens.shape[1]
        positions = mask = None
        if aug is not None:
            positions = aug.lengths[:, None] + jnp.arange(t)[None, :]
            mask = causal_mask(aug.lengths, t, aug.max_len)
        ctx, aug = self.context(base, new.hidden, new.hidden_normed, new.tokens, positions, mask, aug)
        if aug is not None:
            aug = aug.advance(jnp.where(live, count, 0))
        last = jnp.take_along_axis(ctx, (count - 1)[:, None, None], axis=1)[:, 0]
        return HeadsState(aug_cache=aug, context=jnp.where(live[:, None], last, state.context))

    def expand(self, base: Llama, state: HeadsState, frontier: Frontier, vocab: DraftVocab | None = None):
        """Each frontier node's state from its parent's (the context at the root) and its token, and
        the logits over its children; the carry is the node's state."""
        parent = state.context[:, None] if frontier.carry is None else frontier.carry
        node = self.node_state(base, frontier.depth, parent, frontier.tokens)
        return self.node_logits(base, frontier.depth, node, frontier.tokens, vocab), node, state

    def init_aug_cache(self, batch: int, max_len: int, dtype) -> KVCache | None:
        """An empty KV cache for the Augmenting Block, or None for heads without one (Medusa)."""
        c = self.base_cfg
        if not len(self.aug):
            return None
        return KVCache.zeros(len(self.aug), batch, max_len, c.num_kv_heads, c.head_dim, dtype)

    def run_aug(self, x, positions, mask, cache: KVCache | None):
        """The Augmenting Block over x [B, T, D]: causal over the prefix through its own cache (decoding)
        or over the T positions themselves when `cache` is None (training)."""
        for i, layer in enumerate(self.aug):
            x, cache = layer(x, positions, mask, cache, i)
        return x, cache

    def context(self, base: Llama, hidden, hidden_normed, next_tokens, positions, mask, cache):
        """(context states [B, T, D] for T positions, updated aug cache); position t is paired with
        next_tokens[t], the token that follows it."""
        raise NotImplementedError

    def node_state(self, base: Llama, k: int, state, token):
        """The state of a depth-k node holding `token`, from its parent's state (the context for k=0)."""
        raise NotImplementedError

    def node_hidden(self, base: Llama, k: int, state, token):
        """The vector lm_head reads to score a node's children (head k)."""
        raise NotImplementedError

    def node_logits(self, base: Llama, k: int, state, token, vocab: DraftVocab | None = None):
        """Logits over the children of a node at depth k: [..., V], or [..., N] over a draft vocabulary."""
        hidden = self.node_hidden(base, k, state, token)
        return base.logits(hidden) if vocab is None else vocab.logits(hidden)

    def unroll(self, base: Llama, hidden, hidden_normed, tokens) -> jax.Array:
        """Teacher-forced drafts at every position, for training: [K, B, T, D], entry [k, :, t] being the
        lm_head input of head k at position t, whose target is token t+2+k (the root is token t+1, and
        each depth is fed the true token of its parent). hidden/hidden_normed [B, T, D], tokens [B, T]."""
        b, t = tokens.shape
        shifted = lambda n: jnp.concatenate([tokens[:, n:], jnp.zeros((b, min(n, t)), tokens.dtype)], axis=1)[:, :t]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        ctx, _ = self.context(base, hidden, hidden_normed, shifted(1), positions, mask, None)
        token = shifted(1)
        state = self.node_state(base, 0, ctx, token)
        out = []
        for k in range(self.num_heads):
            out.append(self.node_hidden(base, k, state, token))
            if k + 1 < self.num_heads:
                token = shifted(k + 2)
                state = self.node_state(base, k + 1, state, token)
        return jnp.stack(out)


class MedusaHeads(Heads):
    """Head i: lm_head(h + SiLU(W_i h)), h the base model's last hidden state after the final norm (as
    Medusa's code feeds it; SPEC's formula names no norm). No head sees a drafted token."""

    token_dependent = False

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
        self.q.kernel[...] = _eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.k.kernel[...] = _eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.v.kernel[...] = jnp.zeros((d, d), dtype)
        self.attn_heads = _gate_heads(cfg)

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

    def __init__(self, hcfg: HeadsConfig, base: Llama, *, rngs: nnx.Rngs):
        aug = [DecoderLayer(base.cfg, dtype=base.dtype, rngs=rngs)]
        _copy_layer(base.layers[-1], aug[0])
        super().__init__(hcfg, base.cfg, aug)
        self.decoder = CloverAttentionDecoder(base.cfg, hcfg.noise, base.dtype, rngs)
        self.blocks = nnx.List([ResBlock(base.cfg.hidden_size, base.dtype, rngs) for _ in range(hcfg.num_heads)])

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        return self.run_aug(hidden, positions, mask, cache)

    def node_state(self, base, k, state, token):
        e = token_embeddings(base, "lm_head", True, token).astype(state.dtype)
        return self.decoder(state, e)

    def node_hidden(self, base, k, state, token):
        return base.norm(self.blocks[k](state))


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
        self.q.kernel[...] = _eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.k.kernel[...] = _eye_plus_uniform(rngs.params(), d, d, noise, dtype)
        self.v.kernel[...] = (noise * jax.random.uniform(rngs.params(), (d, d), dtype)).astype(dtype)
        self.attn_heads = _gate_heads(cfg)

    def __call__(self, x, e):
        split = lambda t: t.reshape(*t.shape[:-1], self.attn_heads, -1).astype(jnp.float32)
        q, k, v = split(self.q(self.norm(x))), split(self.k(e)), split(self.v(e))
        # Each norm clamped at eps as torch.cosine_similarity does; sqrt of a clamped square keeps the
        # gradient finite at a zero vector (padding rows), where d|x|/dx is 0/0.
        eps = self.norm.eps
        norm = lambda t: jnp.sqrt(jnp.maximum(jnp.sum(t * t, -1, keepdims=True), eps * eps))
        cos = jnp.sum(q * k, -1, keepdims=True) / (norm(q) * norm(k))
        return x + (v * cos).reshape(x.shape).astype(x.dtype)


class Clover2Heads(Heads):
    """Clover-2: x_t = AD_in(h_t, E[x_{t+1}]) -> 2-layer Augmenting Block (own cache) -> norm = s.
    Head 0: lm_head(head_norm(W0 s)); heads k >= 1 share one cell: s <- AD_cell(s, E[token]),
    logits = lm_head(head_norm(W2 [s; E[token]])). Both norms start as the base's final norm."""

    def __init__(self, hcfg: HeadsConfig, base: Llama, *, rngs: nnx.Rngs):
        cfg, dtype, d = base.cfg, base.dtype, base.cfg.hidden_size
        aug = [DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(hcfg.aug_layers)]
        for layer in aug:
            _copy_layer(base.layers[-1], layer)
        super().__init__(hcfg, cfg, aug)
        self.decoder_in = GateDecoder(cfg, hcfg.noise, dtype, rngs)
        self.decoder_cell = GateDecoder(cfg, hcfg.noise, dtype, rngs)
        self.aug_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.head_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.aug_norm.weight[...] = jnp.copy(base.norm.weight[...])
        self.head_norm.weight[...] = jnp.copy(base.norm.weight[...])
        self.w0 = Linear(d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.w0.kernel[...] = _eye_plus_uniform(rngs.params(), d, d, hcfg.noise, dtype)
        self.w2 = Linear(2 * d, d, ("embed", "embed_out"), bias=True, dtype=dtype, rngs=rngs)
        self.w2.kernel[...] = _eye_plus_uniform(rngs.params(), 2 * d, d, hcfg.noise, dtype)

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


def make_heads(hcfg: HeadsConfig, base: Llama, seed: int = 0) -> Heads:
    """Freshly initialised heads for `base` (the Augmenting Block copied from its last layer), of the
    class the method registry names."""
    from clover_jax import methods

    return methods.get(hcfg.method).drafter(hcfg, base, rngs=nnx.Rngs(seed))
