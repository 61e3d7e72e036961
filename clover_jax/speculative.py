"""The speculative step and loop: draft a tree, verify it in one base forward, accept, compact.

One step, all static shapes (N tree nodes, depth D, B sequences):
1. draft level by level: node states from their parents (regressive heads see the parent's token),
   children = top-k of the parent's head distribution at the ranks a static tree fixes, or, for a
   dynamic tree, the N - 1 best of a beam of candidates chosen per sequence (`draft_dynamic`); either
   way the step's topology is a `StepTree` of arrays;
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
from clover_jax.decode import Generator, prefill, stream_tokens
from clover_jax.draft_vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.heads import Heads
from clover_jax.model import Llama
from clover_jax.sampling import (ACCEPT, BONUS, DRAW, SamplingConfig, distribution, draw_without_replacement, sample,
                                 step_keys, top_k, use_keys)
from clover_jax.sharding import constrain_cache, place_draft_vocab, shard_module
from clover_jax.tree import DynamicTree, Tree


@flax.struct.dataclass
class SpecState:
    """What the speculative loop carries from one step to the next (the while_loop's state)."""

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
          sampling: SamplingConfig = SamplingConfig(), key: jax.Array | None = None,
          vocab: DraftVocab | None = None):
    """Tree tokens [B, N] (node 0 = root) drafted level by level from the heads, and per depth d the
    draft distributions [B, n_{d-1} or 1, V] the children of depth d-1's nodes were drawn from (None when
    greedy). Greedy takes each node's top-k; sampling draws a node's children without replacement from
    its head's distribution under `sampling` (Gumbel top-k), the i-th child being the i-th draw. With a
    draft vocabulary the heads score only its tokens (q is 0 on the others)."""
    tokens = [root[:, None]]
    state0 = heads.node_state(base, 0, context, root)
    states = [state0[:, None]]  # per depth: [B, n_d, D]
    dists = []
    for d in range(1, tree.max_depth + 1):
        prev, level = tree.level(d - 1), tree.level(d)
        if heads.token_dependent:
            logits = heads.node_logits(base, d - 1, states[-1], tokens[-1], vocab)  # [B, n_{d-1}, V or N]
        else:
            logits = heads.node_logits(base, d - 1, state0, root, vocab)[:, None]  # one distribution per depth
        if sampling.greedy:
            top = top_k(logits, tree.max_rank[d - 1])[1]  # [B, n_{d-1} or 1, k]
        else:
            q = distribution(logits, sampling)
            dists.append(q if vocab is None else vocab.expand(q, base.cfg.vocab_size))
            top = draw_without_replacement(q, use_keys(key, DRAW, d), tree.max_rank[d - 1])
        if vocab is not None:
            top = vocab.token(top)
        parent_idx = tree.parents[level] - prev.start  # index inside the previous level
        if not heads.token_dependent:
            parent_idx = np.zeros_like(parent_idx)
        new = top[:, parent_idx, tree.rank[level]]  # [B, n_d]
        tokens.append(new.astype(jnp.int32))
        parent_states = states[-1][:, tree.parents[level] - prev.start]
        states.append(heads.node_state(base, d, parent_states, new) if heads.token_dependent else parent_states)
    return jnp.concatenate(tokens, axis=1), (None if sampling.greedy else dists)


@flax.struct.dataclass
class StepTree:
    """One step's tree topology as arrays, shared by the batch (leading axis 1: a static Tree's
    constants) or one per sequence (leading axis B: a dynamic tree). Verification and acceptance read
    only this, so both kinds of tree go through the same code."""

    parents: jax.Array  # [B|1, N] int32 parent slot; -1 for the root and for empty slots
    depth: jax.Array  # [B|1, N] int32
    ancestors: jax.Array  # [B|1, N, N] bool, [i, j] iff j is i or an ancestor of i
    children: jax.Array  # [B|1, N, C] int32 child slots in the order acceptance tests them, -1 padded
    valid: jax.Array  # [B|1, N] bool: False for the slots a dynamic tree left empty

    @classmethod
    def of(cls, tree: Tree) -> "StepTree":
        """A static tree's constants, shared by the batch."""
        const = lambda x: jnp.asarray(x)[None]
        return cls(const(tree.parents), const(tree.depth), const(tree.ancestor_mask), const(tree.children),
                    jnp.ones((1, tree.num_nodes), bool))

    def at(self, field: jax.Array, node: jax.Array) -> jax.Array:
        """field[b, node[b]] per sequence, for a shared or a per-sequence tree."""
        rows = jnp.arange(node.shape[0]) if field.shape[0] > 1 else 0
        return field[rows, node]


def draft_dynamic(base: Llama, heads: Heads, tree: DynamicTree, context: jax.Array, root: jax.Array,
                  sampling: SamplingConfig = SamplingConfig(), key: jax.Array | None = None,
                  vocab: DraftVocab | None = None):
    """Tree tokens [B, N], the StepTree of a dynamic tree (see `DynamicTree`) per sequence, and the
    distributions [B, N, V] each node's children were drawn from (None when they were chosen).

    A beam of W nodes per depth, ranked by joint path log-probability under the heads' distributions
    (softmax of the logits when greedy, `distribution` under the sampling setting otherwise); the D x W
    candidates are then given slots by the tree's rule, in depth-major order, so parents precede
    children and a node's children sit in decreasing probability.

    When sampling, Clover's sampler draws its children instead: the slots of a depth are allotted from
    the *sorted* probabilities of each frontier node's distribution (the j-th slot of node v scores
    P(v) q_v's j-th largest), which the draws do not change, and node v's j-th slot holds v's j-th draw
    without replacement (Gumbel top-k). A node's children are then a prefix of its draws whose length
    was fixed before drawing them, which is what keeps speculative sampling exact. EAGLE-2's global
    rerank compares nodes across depths by their drawn values, so eagle2 keeps chosen children (tested
    as point masses) when sampling. With a draft vocabulary the heads score only its tokens."""
    b, w, n, depth = root.shape[0], tree.beam, tree.num_nodes, tree.max_depth
    rows = jnp.arange(b)
    drawn = not sampling.greedy and tree.kind == "dynamic"
    state0 = heads.node_state(base, 0, context, root)
    f_tok, f_state = root[:, None], state0[:, None]  # the frontier: nodes of depth d-1
    f_logp, f_id = jnp.zeros((b, 1), jnp.float32), jnp.zeros((b, 1), jnp.int32)  # id 0 = root, c + 1 = candidate c
    cand_tok, cand_logp, cand_parent, frontier_q = [], [], [], []
    for d in range(1, depth + 1):
        if heads.token_dependent:
            logits = heads.node_logits(base, d - 1, f_state, f_tok, vocab)  # [B, F, V or N]
        else:
            logits = heads.node_logits(base, d - 1, state0, root, vocab)[:, None]  # one distribution per depth
        q = jax.nn.softmax(logits.astype(jnp.float32), -1) if sampling.greedy else distribution(logits, sampling)
        prob, tok = top_k(q, w)  # [B, F or 1, W], most likely first
        keep = prob > 0
        if tree.kind == "dynamic":  # Clover: the head's top-p nucleus, and at least min_ratio of its top-1
            keep &= (jnp.cumsum(prob, -1) - prob < tree.top_p) & (prob >= tree.min_ratio * prob[..., :1])
        slot_score = f_logp[:, :, None] + jnp.where(keep, jnp.log(prob), -jnp.inf)  # [B, F, W]
        if drawn:
            frontier_q.append(q if vocab is None else vocab.expand(q, base.cfg.vocab_size))
            tok = draw_without_replacement(q, use_keys(key, DRAW, d), w)  # in draw order
            prob = jnp.take_along_axis(q, tok, -1)
        if vocab is not None:
            tok = vocab.token(tok)
        f = slot_score.shape[1]
        score, idx = top_k(slot_score.reshape(b, f * w), w)  # the level's best W slots (-inf: none)
        parent = idx // w
        flat = lambda x: jnp.take_along_axis(jnp.broadcast_to(x, (b, f, w)).reshape(b, f * w), idx, 1)
        f_tok = flat(tok).astype(jnp.int32)
        cand_tok.append(f_tok)
        cand_logp.append(score)
        cand_parent.append(jnp.take_along_axis(f_id, parent, 1))
        if heads.token_dependent and d < depth:
            f_state = heads.node_state(base, d, jnp.take_along_axis(f_state, parent[:, :, None], 1), f_tok)
        # A node's own joint probability (its drawn token's, when drawn) ranks its children's slots.
        joint = jnp.where(score > -jnp.inf, flat(f_logp[:, :, None] + jnp.log(prob)), -jnp.inf)
        f_logp, f_id = joint, jnp.broadcast_to(1 + (d - 1) * w + jnp.arange(w, dtype=jnp.int32), (b, w))

    tok, logp, parent = (jnp.concatenate(x, 1) for x in (cand_tok, cand_logp, cand_parent))  # [B, D*W]
    ok = logp > -jnp.inf
    if tree.kind == "dynamic":  # depth by depth, each its most probable: deeper ones get what is left
        chosen = ok & (jnp.cumsum(ok, 1) <= n - 1)
    else:  # EAGLE-2: the global top N-1 by joint probability (a parent never ranks below its child)
        top = top_k(jnp.where(ok, logp, -jnp.inf), n - 1)[1]
        chosen = ok & jnp.zeros_like(ok).at[rows[:, None], top].set(True)
    slot = jnp.where(chosen, jnp.cumsum(chosen, 1), n)  # n: no slot (dropped by the scatters)
    parent_slot = jnp.take_along_axis(jnp.concatenate([jnp.zeros((b, 1), jnp.int32), slot], 1), parent, 1)
    cand_depth = jnp.broadcast_to(jnp.repeat(jnp.arange(1, depth + 1, dtype=jnp.int32), w), tok.shape)
    place = lambda vals, fill: jnp.full((b, n), fill, vals.dtype).at[rows[:, None], slot].set(vals, mode="drop")
    tokens = place(tok, 0).at[:, 0].set(root)
    parents = place(parent_slot, -1)
    node_depth = place(cand_depth, 0)
    valid = place(chosen, False).at[:, 0].set(True)

    eye = jnp.eye(n, dtype=bool)
    has_parent = (parents >= 0)[:, :, None]
    ancestors = jnp.broadcast_to(eye, (b, n, n))
    for _ in range(depth):  # each pass adds one more generation of ancestors
        ancestors = eye | (jax.vmap(lambda a, p: a[p])(ancestors, jnp.maximum(parents, 0)) & has_parent)
    is_child = parents[:, :, None] == jnp.arange(n)[None, None, :]  # [B, child, parent]
    sibling_rank = jnp.take_along_axis(jnp.cumsum(is_child, 1) - 1, jnp.maximum(parents, 0)[:, :, None], 2)[..., 0]
    children = jnp.full((b, n, w), -1, jnp.int32).at[
        rows[:, None], jnp.where(parents >= 0, parents, n), sibling_rank].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), mode="drop")
    draws = None
    if drawn:  # each node's distribution at its slot: the root's, then each depth's frontier nodes'
        v = frontier_q[0].shape[-1]
        draws = jnp.zeros((b, n, v), jnp.float32).at[:, 0].set(frontier_q[0][:, 0])
        for d in range(2, depth + 1):
            ids = (d - 2) * w + jnp.arange(w)  # candidates of depth d-1: the frontier of depth d
            draws = draws.at[rows[:, None], slot[:, ids]].set(
                jnp.broadcast_to(frontier_q[d - 1], (b, w, v)), mode="drop")
    return tokens, StepTree(parents, node_depth, ancestors, children, valid), draws


def path_to(st: StepTree, best: jax.Array, max_depth: int) -> jax.Array:
    """[B, D+1] node indices root..best by depth, padded with best past its depth."""
    on_path = st.at(st.ancestors, best)  # [B, N]
    by_depth = on_path[:, None, :] & (st.depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    return jnp.where(by_depth.any(-1), jnp.argmax(by_depth, -1), best[:, None])


def accept_greedy(st: StepTree, tokens: jax.Array, logits: jax.Array, max_depth: int):
    """(best node [B], bonus token [B], path [B, D+1] node indices root..best, padded with best).

    A node is accepted when each node on its path holds the base model's argmax at its parent."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
    at_parent = jnp.take_along_axis(target, jnp.broadcast_to(jnp.maximum(st.parents, 0), target.shape), 1)
    match = ((tokens == at_parent) & st.valid).at[:, 0].set(True)
    accepted = jnp.all(jnp.where(st.ancestors, match[:, None, :], True), axis=-1)  # [B, N]
    best = jnp.argmax(jnp.where(accepted, st.depth + 1, 0), axis=-1)
    bonus = jnp.take_along_axis(target, best[:, None], axis=1)[:, 0]
    return best, bonus, path_to(st, best, max_depth)


def _normalise(x: jax.Array, fallback: jax.Array) -> jax.Array:
    total = x.sum(-1, keepdims=True)
    return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), fallback)


def accept_probability(p_token: jax.Array, q_token: jax.Array) -> jax.Array:
    """The chance a drafted token is kept: min(1, p/q) (speculative sampling's rule)."""
    return jnp.minimum(1.0, p_token / q_token)


def level_draws(tree: Tree, dists: list):
    """For a static tree drafted by sampling: node -> the distribution [B, V] its children were drawn from."""
    def q_of(d: int, node: jax.Array) -> jax.Array:
        q_level = dists[d - 1]  # [B, n_{d-1} or 1, V]
        return q_level[jnp.arange(node.shape[0]), jnp.clip(node - tree.level(d - 1).start, 0, q_level.shape[1] - 1)]
    return q_of


def accept_sample(st: StepTree, tokens: jax.Array, logits: jax.Array, sampling: SamplingConfig, key: jax.Array,
                  ranks, draws=None):
    """Speculative sampling on a tree; returns what `accept_greedy` returns, and the emitted tokens have
    exactly the distribution plain sampling under `sampling` gives.

    From the root, depth by depth: the current node's children are tested in order; child c is kept
    with probability min(1, p(c)/q(c)), p the base model's distribution at the node and q the one c was
    drawn from (`draws(d, node)`, children drawn without replacement in test order). On a rejection p
    becomes the residual max(p - q, 0) renormalised and q loses c (renormalised: the next child was
    drawn without it). Without `draws` (a dynamic tree, whose children are chosen, not drawn) each child
    is tested as a draw from a point mass on itself: kept with probability p(c), else removed from p,
    which is sequential sampling from p whatever chose the children. A kept child becomes the current
    node, with p its own base distribution; when no child is kept (or at a leaf) the walk stops and the
    bonus token is drawn from p, residual included. ranks[d-1]: children tested at depth d at most."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    take = lambda x, idx: x[rows, idx]
    uniform = lambda d, r: jax.vmap(jax.random.uniform)(use_keys(key, ACCEPT, d, r))
    cur = jnp.zeros((b,), jnp.int32)
    p = distribution(logits[:, 0], sampling)
    active = jnp.ones((b,), bool)
    for d in range(1, len(ranks) + 1):
        q = None if draws is None else draws(d, cur)  # [B, V]
        moved = jnp.zeros((b,), bool)
        nxt = cur
        for r in range(ranks[d - 1]):
            child = st.at(st.children, cur)[:, r]  # -1: cur has fewer children
            tok = take(tokens, jnp.maximum(child, 0))
            q_tok = jnp.ones((b,)) if q is None else take(q, tok)
            test = active & ~moved & (child >= 0) & (q_tok > 0)
            keep = test & (uniform(d, r) < accept_probability(take(p, tok), q_tok))
            nxt = jnp.where(keep, child, nxt)
            moved = moved | keep
            reject = (test & ~keep)[:, None]
            drawn_from = jax.nn.one_hot(tok, p.shape[-1], dtype=p.dtype) if q is None else q
            p = jnp.where(reject, _normalise(jnp.maximum(p - drawn_from, 0.0), p), p)
            if q is not None:
                q = jnp.where(reject, _normalise(q.at[rows, tok].set(0.0), jnp.zeros_like(q)), q)
        p = jnp.where(moved[:, None], distribution(take(logits, nxt), sampling), p)
        cur, active = nxt, active & moved
    bonus = jax.vmap(jax.random.categorical)(use_keys(key, BONUS), jnp.log(p))
    return cur, bonus.astype(jnp.int32), path_to(st, cur, len(ranks))


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


def generate_speculative(graphdefs, params, prompts, prompt_lens, budgets, keys, *, tree: Tree | DynamicTree,
                         sampling: SamplingConfig, eos_ids: tuple[int, ...], max_new: int, cache_len: int,
                         mesh=None, stream=None):
    """Speculative generation as one pure function (jit with the keyword args static). params: the base
    model's and the heads' states, and the draft vocabulary (None: the whole vocabulary); stream: a host
    callback given the tokens after each step (`decode.stream_tokens`)."""
    base = nnx.merge(graphdefs[0], params[0])
    heads = nnx.merge(graphdefs[1], params[1])
    vocab = params[2]
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
    dynamic = isinstance(tree, DynamicTree)
    static_tree = None if dynamic else StepTree.of(tree)
    ranks = (tree.beam,) * depth if dynamic else tree.max_rank

    def cond(s: SpecState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def body(s: SpecState):
        key = step_keys(s.keys, s.step + 1)
        if dynamic:
            tokens, st, node_q = draft_dynamic(base, heads, tree, s.context, s.root, sampling, key, vocab)
            draws = None if node_q is None else (lambda d, node: node_q[jnp.arange(b), node])
        else:
            tokens, dists = draft(base, heads, tree, s.context, s.root, sampling, key, vocab)  # [B, N]
            st, draws = static_tree, (None if sampling.greedy else level_draws(tree, dists))
        c = s.cache
        out = base(tokens, c.lengths[:, None] + st.depth, tree_mask(c.lengths, st.ancestors, cache_len), c)
        if sampling.greedy:
            best, bonus, path = accept_greedy(st, tokens, out.logits, depth)
        else:
            best, bonus, path = accept_sample(st, tokens, out.logits, sampling, key, ranks, draws)
        accepted = st.at(st.depth, best)  # drafted tokens accepted, per sequence
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
        return stream_tokens(stream, s.append(emitted, count, budgets, eos_ids), mesh)

    return jax.lax.while_loop(cond, body, state)


class SpeculativeGenerator(Generator):
    """`Generator` with draft heads and a static or dynamic tree; greedy decoding or lossless speculative
    sampling; the heads score the whole vocabulary or a draft vocabulary (`draft_vocab.DraftVocab`)."""

    def __init__(self, model: Llama, heads: Heads, tree: Tree | DynamicTree, *,
                 draft_vocab: DraftVocab | None = None, **kwargs):
        super().__init__(model, **kwargs)
        if self.mesh is not None:
            shard_module(heads, self.mesh)
            if draft_vocab is not None:
                draft_vocab = place_draft_vocab(draft_vocab, self.mesh)
        if tree.max_depth > heads.num_heads:
            raise CloverError(f"tree depth {tree.max_depth} exceeds the {heads.num_heads} draft heads; "
                              "pick a shallower tree")
        self.heads = heads
        self.tree = tree
        self.draft_vocab = draft_vocab
        head_graphdef, head_params = nnx.split(heads)
        self.graphdef = (self.graphdef, head_graphdef)
        self.params = (self.params, head_params, draft_vocab)

    def _program(self):
        return generate_speculative

    def _static(self) -> dict:
        return {"tree": self.tree}

    def _slack(self) -> int:
        return self.tree.num_nodes + self.tree.max_depth + 1
