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
ignores tokens, so its `expand` computes one distribution per depth. Training (`train_forward`) runs
the same three questions teacher-forced at every position (`unroll`). The architectures and
initialisations are the papers'; where they leave a detail open, the choice follows the authors' code
and is said in the docstring.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import Committed, Drafter, DrafterConfig, Frontier
from clover_jax.drafters import registry
from clover_jax.drafters.losses import shift_left
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.cache import KVCache, causal_mask
from clover_jax.model.config import ModelConfig
from clover_jax.model.layers import DecoderLayer, Linear
from clover_jax.model.llama import Llama, causal_self_mask
from clover_jax.model.sharding import constrain_cache


def eye_plus_uniform(key, n: int, m: int, noise: float, dtype) -> jax.Array:
    """Identity on the leading min(n, m) diagonal (for W2 [2D, D]: the rows reading s) plus U(0, noise),
    as the authors' `eye_with_uniform`."""
    return (jnp.eye(n, m, dtype=dtype) + noise * jax.random.uniform(key, (n, m), dtype)).astype(dtype)


def gate_heads(cfg: ModelConfig) -> int:
    """The decoders split D into the base model's attention-head count, as the authors' code asserts."""
    if cfg.hidden_size % cfg.num_heads:
        raise CloverError(f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
                          f"{cfg.num_heads}; the attention decoder cannot split it into heads")
    return cfg.num_heads


def last_layer_copies(base: Llama, n: int, rngs: nnx.Rngs) -> list[DecoderLayer]:
    """n Augmenting Block layers, each initialised as the base model's last layer: its weights and its
    kind (Gemma 3's last layer is a sliding-window one, and its copies keep the window and local RoPE)."""
    cfg = base.cfg
    local = cfg.is_local(cfg.num_layers - 1)
    layers = [DecoderLayer(cfg, dtype=base.dtype, rngs=rngs, local=local) for _ in range(n)]
    for layer in layers:
        nnx.update(layer, jax.tree.map(jnp.copy, nnx.state(base.layers[-1], nnx.Param)))
    return layers


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

    aug_layers = 0  # Augmenting Block layers (with a KV cache of their own) the heads build

    def __init__(self, hcfg: DrafterConfig, base_cfg: ModelConfig, aug: list[DecoderLayer]):
        self.hcfg = hcfg
        self.base_cfg = base_cfg
        self.aug = nnx.List(aug)

    @property
    def depth(self) -> int:
        """K: the number of heads, the deepest tree they draft."""
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

    def unroll(self, base: Llama, hidden, hidden_normed, tokens, steps: int | None = None) -> jax.Array:
        """Teacher-forced drafts at every position, for training: [K, B, T, D], entry [k, :, t] being the
        lm_head input of head k at position t, whose target is token t+2+k (the root is token t+1, and
        each depth is fed the true token of its parent). hidden/hidden_normed [B, T, D], tokens [B, T];
        `steps` (default: every head) cuts it to the first heads, K = steps."""
        b, t = tokens.shape
        depth = self.depth if steps is None else min(steps, self.depth)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        token = shift_left(tokens, 1)
        ctx, _ = self.context(base, hidden, hidden_normed, token, positions, causal_self_mask(b, t), None)
        state = self.node_state(base, 0, ctx, token)
        out = []
        for k in range(depth):
            out.append(self.node_hidden(base, k, state, token))
            if k + 1 < depth:
                token = shift_left(tokens, k + 2)
                state = self.node_state(base, k + 1, state, token)
        return jnp.stack(out)

    def train_forward(self, base: Llama, tokens, hidden, hidden_normed, features=None, vocab=None, key=None,
                      steps: int | None = None):
        """`unroll`'s lm_head inputs and their logits through the base model's frozen lm_head (over
        `vocab`'s rows when given); heads take neither features nor randomness."""
        drafted = self.unroll(base, hidden, hidden_normed, tokens, steps)
        return drafted, base.logits(drafted) if vocab is None else vocab.logits(drafted)


def make_heads(hcfg: DrafterConfig, base: Llama, seed: int = 0) -> Drafter:
    """`registry.make_drafter`: a freshly initialised drafter of hcfg's method for `base`."""
    return registry.make_drafter(hcfg, base, seed)
