"""The speculative step and loop: draft a static tree, verify it in one base forward, accept, compact.

One step, all static shapes (N tree nodes, depth D, B sequences):
1. draft level by level: node states from their parents (regressive heads see the parent's token),
   children = top-k of the parent's head distribution at the ranks the tree fixes;
2. verify: the N tree tokens go through the base model at positions `length + depth`, reading the
   cached prefix and their own ancestors (ancestor mask); their K/V land in slots length .. length+N-1;
3. accept (greedy): a node is accepted when every token on its path equals the base model's argmax at
   its parent; keep the deepest, plus the bonus token the base model predicts there;
4. compact: the accepted path's K/V move to contiguous slots; the Augmenting Block (if any) runs over
   the newly committed positions only, so its cache never holds rejected tokens.
Each sequence accepts its own number of tokens; the loop stops per sequence at EOS or its budget.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.cache import KVCache, causal_mask, tree_mask
from clover_jax.decode import Generator, prefill
from clover_jax.errors import CloverError
from clover_jax.heads import Heads
from clover_jax.model import Llama
from clover_jax.sampling import SamplingConfig, distribution, sample, step_keys, top_k
from clover_jax.sharding import constrain_cache, shard_module
from clover_jax.tree import Tree


@flax.struct.dataclass
class SpecState:
    cache: KVCache
    aug_cache: KVCache | None
    context: jax.Array  # [B, D] the heads' context state at the last committed position
    root: jax.Array  # [B] the base model's next token: the tree's root, not yet in the cache
    tokens: jax.Array  # [B, M + D + 1] generated tokens (a step may overshoot M; trimmed on the host)
    num_new: jax.Array  # [B]
    done: jax.Array  # [B]
    finite: jax.Array  # [B]
    keys: jax.Array  # [B, 2]
    step: jax.Array  # [] verification steps taken
    accept_hist: jax.Array  # [B, D + 1] steps that accepted d drafted tokens, per sequence

    def append(self, new: jax.Array, count: jax.Array, budgets, eos_ids) -> "SpecState":
        """Append new[b, :count[b]] to each live sequence, cut at its first EOS and at its budget."""
        b, t = new.shape
        j = jnp.arange(t)[None, :]
        live = ~self.done
        if eos_ids:
            is_eos = jnp.isin(new, jnp.asarray(eos_ids, jnp.int32)) & (j < count[:, None])
            first = jnp.where(is_eos.any(-1), jnp.argmax(is_eos, -1) + 1, t + 1)
            count = jnp.minimum(count, first)
            hit_eos = first <= t
        else:
            hit_eos = jnp.zeros((b,), bool)
        count = jnp.where(live, jnp.minimum(count, budgets - self.num_new), 0)
        cols = jnp.where(j < count[:, None], self.num_new[:, None] + j, self.tokens.shape[1])
        tokens = self.tokens.at[jnp.arange(b)[:, None], cols].set(new, mode="drop")
        num_new = self.num_new + count
        done = self.done | (live & hit_eos) | (num_new >= budgets)
        return self.replace(tokens=tokens, num_new=num_new, done=done)


def draft(base: Llama, heads: Heads, tree: Tree, context: jax.Array, root: jax.Array,
          sampling: SamplingConfig = SamplingConfig(), key: jax.Array | None = None):
    """Tree tokens [B, N] (node 0 = root) drafted level by level from the heads, and per depth d the
    draft distributions [B, n_{d-1} or 1, V] the children of depth d-1's nodes were drawn from (None when
    greedy). Greedy takes each node's top-k; sampling draws a node's children without replacement from
    its head's distribution under `sampling` (Gumbel top-k), the i-th child being the i-th draw."""
    tokens = [root[:, None]]
    state0 = heads.node_state(base, 0, context, root)
    states = [state0[:, None]]  # per depth: [B, n_d, D]
    dists = []
    for d in range(1, tree.max_depth + 1):
        prev, level = tree.level(d - 1), tree.level(d)
        if heads.token_dependent:
            logits = heads.node_logits(base, d - 1, states[-1], tokens[-1])  # [B, n_{d-1}, V]
        else:
            logits = heads.node_logits(base, d - 1, state0, root)[:, None]  # one distribution per depth
        if sampling.greedy:
            scores = logits
        else:
            q = distribution(logits, sampling)
            dists.append(q)
            scores = jnp.log(q) + jax.vmap(lambda k, x: jax.random.gumbel(k, x.shape))(
                jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, d), q)
        top = top_k(scores, tree.max_rank[d - 1])[1]  # [B, n_{d-1} or 1, k]
        parent_idx = tree.parents[level] - prev.start  # index inside the previous level
        if not heads.token_dependent:
            parent_idx = np.zeros_like(parent_idx)
        new = top[:, parent_idx, tree.rank[level]]  # [B, n_d]
        tokens.append(new.astype(jnp.int32))
        parent_states = states[-1][:, tree.parents[level] - prev.start]
        states.append(heads.node_state(base, d, parent_states, new) if heads.token_dependent else parent_states)
    return jnp.concatenate(tokens, axis=1), (None if sampling.greedy else dists)


def path_to(tree: Tree, best: jax.Array) -> jax.Array:
    """[B, D+1] node indices root..best by depth, padded with best past its depth."""
    on_path = jnp.asarray(tree.ancestor_mask)[best]  # [B, N]
    depth = jnp.asarray(tree.depth)
    by_depth = on_path[:, None, :] & (depth[None, None, :] == jnp.arange(tree.max_depth + 1)[None, :, None])
    return jnp.where(by_depth.any(-1), jnp.argmax(by_depth, -1), best[:, None])


def accept_greedy(tree: Tree, tokens: jax.Array, logits: jax.Array):
    """(best node [B], bonus token [B], path [B, D+1] node indices root..best, padded with best).

    A node is accepted when each node on its path holds the base model's argmax at its parent."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
    parents = np.maximum(tree.parents, 0)
    match = (tokens == target[:, parents]).at[:, 0].set(True)
    anc = jnp.asarray(tree.ancestor_mask)
    accepted = jnp.all(jnp.where(anc[None], match[:, None, :], True), axis=-1)  # [B, N]
    score = jnp.where(accepted, jnp.asarray(tree.depth) + 1, 0)
    best = jnp.argmax(score, axis=-1)
    bonus = jnp.take_along_axis(target, best[:, None], axis=1)[:, 0]
    return best, bonus, path_to(tree, best)


def _normalise(x: jax.Array, fallback: jax.Array) -> jax.Array:
    total = x.sum(-1, keepdims=True)
    return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), fallback)


def accept_probability(p_token: jax.Array, q_token: jax.Array) -> jax.Array:
    """The chance a drafted token is kept: min(1, p/q) (speculative sampling's rule)."""
    return jnp.minimum(1.0, p_token / q_token)


def accept_sample(tree: Tree, tokens: jax.Array, logits: jax.Array, dists: list, sampling: SamplingConfig,
                  key: jax.Array):
    """Speculative sampling on a tree; returns what `accept_greedy` returns, and the emitted tokens have
    exactly the distribution plain sampling under `sampling` gives.

    From the root, depth by depth: the current node's children are tested in draw order; child c (its
    draw distribution q) is kept with probability min(1, p(c)/q(c)), p the base model's distribution at
    the node. On a rejection p becomes the residual max(p - q, 0) renormalised and q loses c
    (renormalised: the next child was drawn without replacement). A kept child becomes the current
    node, with p its own base distribution; when no child is kept (or at a leaf) the walk stops and the
    bonus token is drawn from p, residual included."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    take = lambda x, idx: x[rows, idx]
    uniform = lambda k, tag: jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, tag)))(k)
    children = jnp.asarray(tree.children)
    cur = jnp.zeros((b,), jnp.int32)
    p = distribution(logits[:, 0], sampling)
    active = jnp.ones((b,), bool)
    for d in range(1, tree.max_depth + 1):
        prev = tree.level(d - 1)
        q_level = dists[d - 1]  # [B, n_{d-1} or 1, V]
        q = take(q_level, jnp.clip(cur - prev.start, 0, q_level.shape[1] - 1))  # [B, V]
        moved = jnp.zeros((b,), bool)
        nxt = cur
        for r in range(tree.max_rank[d - 1]):
            child = children[cur, r]  # -1: cur has fewer children
            tok = take(tokens, jnp.maximum(child, 0))
            q_tok, p_tok = take(q, tok), take(p, tok)
            test = active & ~moved & (child >= 0) & (q_tok > 0)
            keep = test & (uniform(key, 1000 * d + r) < accept_probability(p_tok, q_tok))
            nxt = jnp.where(keep, child, nxt)
            moved = moved | keep
            reject = (test & ~keep)[:, None]
            p = jnp.where(reject, _normalise(jnp.maximum(p - q, 0.0), p), p)
            q = jnp.where(reject, _normalise(q.at[rows, tok].set(0.0), jnp.zeros_like(q)), q)
        p = jnp.where(moved[:, None], distribution(take(logits, nxt), sampling), p)
        cur, active = nxt, active & moved
    bonus = jax.vmap(lambda k, pr: jax.random.categorical(jax.random.fold_in(k, 999_999), jnp.log(pr)))(key, p)
    return cur, bonus.astype(jnp.int32), path_to(tree, cur)


def compact(cache: KVCache, path: jax.Array) -> KVCache:
    """Move the K/V of tree slots `length + path[b, d]` to slots `length + d` (the accepted path)."""
    src = cache.lengths[:, None] + path  # [B, D+1]

    def move(buf):  # [B, K, S, H]
        gathered = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)
        put = lambda b_buf, g, start: jax.lax.dynamic_update_slice(b_buf, g, (0, start, 0))
        return jax.vmap(put)(buf, gathered, cache.lengths)

    return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def update_context(base, heads: Heads, aug_cache, hidden, hidden_normed, next_tokens, count):
    """Context states for T newly committed positions [B, T, D] (aug cache written and advanced by
    count); returns (context at position count-1 [B, D], aug_cache)."""
    b, t, _ = hidden.shape
    if aug_cache is not None:
        positions = aug_cache.lengths[:, None] + jnp.arange(t)[None, :]
        mask = causal_mask(aug_cache.lengths, t, aug_cache.max_len)
    else:
        positions, mask = None, None
    ctx, aug_cache = heads.context(base, hidden, hidden_normed, next_tokens, positions, mask, aug_cache)
    if aug_cache is not None:
        aug_cache = aug_cache.advance(count)
    last = jnp.take_along_axis(ctx, (count - 1)[:, None, None], axis=1)[:, 0]
    return last, aug_cache


def generate_speculative(graphdefs, params, prompts, prompt_lens, budgets, keys, *, tree: Tree,
                         sampling: SamplingConfig, eos_ids: tuple[int, ...], max_new: int, cache_len: int,
                         mesh=None):
    """Speculative generation as one pure function (jit with the keyword args static)."""
    base = nnx.merge(graphdefs[0], params[0])
    heads = nnx.merge(graphdefs[1], params[1])
    b = prompts.shape[0]
    depth = tree.max_depth
    cache, hidden, hidden_normed, logits = prefill(base, prompts, prompt_lens, cache_len, mesh)
    root = sample(logits, step_keys(keys, 0), sampling)
    # The heads' context over the prompt: position t is paired with token t+1 (the root for the last).
    next_tokens = jnp.concatenate([prompts[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    next_tokens = next_tokens.at[jnp.arange(b), prompt_lens - 1].set(root)
    aug_cache = constrain_cache(heads.init_aug_cache(b, cache_len, base.dtype), mesh)
    context, aug_cache = update_context(base, heads, aug_cache, hidden, hidden_normed, next_tokens, prompt_lens)

    state = SpecState(
        cache=cache, aug_cache=aug_cache, context=context, root=root,
        tokens=jnp.zeros((b, max_new + depth + 1), jnp.int32), num_new=jnp.zeros((b,), jnp.int32),
        done=budgets <= 0, finite=jnp.isfinite(logits).all(-1), keys=keys, step=jnp.zeros((), jnp.int32),
        accept_hist=jnp.zeros((b, depth + 1), jnp.int32))
    state = state.append(root[:, None], jnp.ones((b,), jnp.int32), budgets, eos_ids)
    node_depth = jnp.asarray(tree.depth)
    ancestors = jnp.asarray(tree.ancestor_mask)

    def cond(s: SpecState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def body(s: SpecState):
        key = step_keys(s.keys, s.step + 1)
        tokens, dists = draft(base, heads, tree, s.context, s.root, sampling, key)  # [B, N]
        c = s.cache
        positions = c.lengths[:, None] + node_depth[None, :]
        out = base(tokens, positions, tree_mask(c.lengths, ancestors, cache_len), c)
        if sampling.greedy:
            best, bonus, path = accept_greedy(tree, tokens, out.logits)
        else:
            best, bonus, path = accept_sample(tree, tokens, out.logits, dists, sampling, key)
        accepted = node_depth[best]  # drafted tokens accepted, per sequence
        count = accepted + 1  # tokens committed to the cache (root + accepted) = tokens emitted
        live = ~s.done
        cache = compact(out.cache, path).advance(jnp.where(live, count, 0))
        path_tokens = jnp.take_along_axis(tokens, path, axis=1)  # [B, D+1]
        emitted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = emitted.at[jnp.arange(b), accepted].set(bonus)  # accepted drafts, then the bonus
        hidden = jnp.take_along_axis(out.hidden, path[:, :, None], axis=1)
        normed = jnp.take_along_axis(out.hidden_normed, path[:, :, None], axis=1)
        aug = s.aug_cache
        ctx, aug = update_context(base, heads, aug, hidden, normed, emitted, count)
        if aug is not None:  # finished sequences must not advance their aug cache
            aug = aug.replace(lengths=jnp.where(live, aug.lengths, s.aug_cache.lengths))
        path_logits = jnp.take_along_axis(out.logits, best[:, None, None], axis=1)[:, 0]
        s = s.replace(
            cache=cache, aug_cache=aug, context=jnp.where(live[:, None], ctx, s.context),
            root=jnp.where(live, bonus, s.root), step=s.step + 1,
            finite=s.finite & (jnp.isfinite(path_logits).all(-1) | s.done),
            accept_hist=s.accept_hist + (jax.nn.one_hot(accepted, depth + 1, dtype=jnp.int32) * live[:, None]))
        return s.append(emitted, count, budgets, eos_ids)

    return jax.lax.while_loop(cond, body, state)


class SpeculativeGenerator(Generator):
    """`Generator` with draft heads and a static tree; greedy decoding or lossless speculative sampling."""

    def __init__(self, model: Llama, heads: Heads, tree: Tree, **kwargs):
        super().__init__(model, **kwargs)
        if self.mesh is not None:
            shard_module(heads, self.mesh)
        if tree.max_depth > heads.num_heads:
            raise CloverError(f"tree depth {tree.max_depth} exceeds the {heads.num_heads} draft heads; "
                              "pick a shallower tree")
        self.heads = heads
        self.tree = tree
        head_graphdef, head_params = nnx.split(heads)
        self.graphdef = (self.graphdef, head_graphdef)
        self.params = (self.params, head_params)

    def _program(self):
        return generate_speculative

    def _static(self) -> dict:
        return {"tree": self.tree}

    def _slack(self) -> int:
        return self.tree.num_nodes + self.tree.max_depth + 1
