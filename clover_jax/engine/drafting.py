"""The tree driver: any drafter (`drafter.Drafter`) drafts any tree, level by level through `expand`.

`draft_tree` takes a static `Tree` or a `DynamicTree` (`dynamic:N,W`, `eagle2:N,K,D`) and returns one
result, `Drafted`: the N tree tokens, the step's topology as a `StepTree` (what verification and
acceptance read) and, when sampling drew the children, each node's draft distribution. Each level is a
`Frontier`: its tokens, parents, draft slots, ancestor mask over the slots, positions, and what the
parents handed down. A static tree's slots are its nodes; a dynamic tree expands a beam of W nodes per
depth in draft slots 1.. and keeps N - 1 of its candidates (`_allot`), so its drafter may need
1 + (depth - 1) x W draft slots (`draft_slots`). Children are a node's top-k (greedy) or draws without
replacement (sampling).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.drafters.base import Drafter, Frontier
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.engine.sampling import DRAW, SamplingConfig, draft_distribution, draw_without_replacement, top_k, use_keys
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.static import Tree


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


@flax.struct.dataclass
class Drafted:
    """One step's draft: what verification runs and acceptance tests."""

    tokens: jax.Array  # [B, N] int32, node 0 = the root
    tree: StepTree
    draws: jax.Array | None  # [B, N, V] the distribution each node's children were drawn from; None when chosen


def path_to(st: StepTree, best: jax.Array, max_depth: int) -> jax.Array:
    """[B, D+1] node indices root..best by depth, padded with best past its depth."""
    on_path = st.at(st.ancestors, best)  # [B, N]
    by_depth = on_path[:, None, :] & (st.depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    return jnp.where(by_depth.any(-1), jnp.argmax(by_depth, -1), best[:, None])


def _root(root: jax.Array, lengths: jax.Array, slots: int) -> Frontier:
    """The first level: the root alone, in slot 0 of `slots`, at position `lengths`."""
    b = root.shape[0]
    zeros = jnp.zeros((b, 1), jnp.int32)
    root_only = jnp.zeros((1, 1, slots), bool).at[..., 0].set(True)
    return Frontier(tokens=root[:, None], parents=zeros, slots=zeros, ancestors=root_only, positions=lengths[:, None],
                    carry=None, depth=0)


def _child_level(frontier: Frontier, carry, tokens, parents, slots, ancestors) -> Frontier:
    """The next level: its nodes' tokens, parents (indices into `frontier`), slots and ancestors."""
    handed = jax.tree.map(lambda c: jnp.take_along_axis(c, parents.reshape(*parents.shape, *(1,) * (c.ndim - 2)), 1),
                          carry)
    return Frontier(tokens=tokens.astype(jnp.int32), parents=parents, slots=slots, ancestors=ancestors,
                    positions=jnp.broadcast_to(frontier.positions[:, :1] + 1, tokens.shape), carry=handed,
                    depth=frontier.depth + 1)


def _draft_q(logits, sampling: SamplingConfig, vocab: DraftVocab | None, base):
    """(q over what the drafter scores, q over the base model's whole vocabulary) under the sampling setting."""
    q = draft_distribution(logits, sampling)
    return q, (q if vocab is None else vocab.expand(q, base.cfg.vocab_size))


def draft_tree(base, drafter: Drafter, state, tree: Tree | DynamicTree, root: jax.Array, lengths: jax.Array,
               sampling: SamplingConfig = SamplingConfig(), key: jax.Array | None = None,
               vocab: DraftVocab | None = None):
    """(Drafted, drafter state) for one step. root [B]: the tree's root token, not yet in the cache;
    lengths [B]: committed tokens (the root's position); key [B, 2]: the step's keys when sampling.
    With a draft vocabulary the drafter scores only its tokens (q is 0 on the others)."""
    if isinstance(tree, DynamicTree):
        return _draft_dynamic(base, drafter, state, tree, root, lengths, sampling, key, vocab)
    return _draft_static(base, drafter, state, tree, root, lengths, sampling, key, vocab)


def _draft_static(base, drafter, state, tree: Tree, root, lengths, sampling, key, vocab):
    """Level by level: node i's children are ranks 0.. of its distribution, top-k or draws in order."""
    frontier = _root(root, lengths, tree.num_nodes)
    tokens, dists = [root[:, None]], []
    for d in range(1, tree.max_depth + 1):
        prev, level = tree.level(d - 1), tree.level(d)
        logits, carry, state = drafter.expand(base, state, frontier, vocab)  # [B, n_{d-1} or 1, V or N]
        if sampling.greedy:
            top = top_k(logits, tree.max_rank[d - 1])[1]
        else:
            q, q_full = _draft_q(logits, sampling, vocab, base)
            dists.append(jnp.broadcast_to(q_full, (q_full.shape[0], prev.stop - prev.start, q_full.shape[-1])))
            top = draw_without_replacement(q, use_keys(key, DRAW, d), tree.max_rank[d - 1])
        if vocab is not None:
            top = vocab.token(top)
        parent_idx = tree.parents[level] - prev.start  # index inside the previous level
        new = top[:, parent_idx if logits.shape[1] > 1 else np.zeros_like(parent_idx), tree.rank[level]]
        tokens.append(new)
        b, nodes = root.shape[0], np.arange(level.start, level.stop)
        frontier = _child_level(frontier, carry, new, jnp.broadcast_to(jnp.asarray(parent_idx, jnp.int32), new.shape),
                                jnp.broadcast_to(jnp.asarray(nodes, jnp.int32), (b, len(nodes))),
                                jnp.asarray(tree.ancestor_mask[level])[None])
    draws = None
    if dists:  # leaves draw nothing: zeros
        b, v = root.shape[0], dists[0].shape[-1]
        leaves = tree.level(tree.max_depth)
        draws = jnp.concatenate(dists + [jnp.zeros((b, leaves.stop - leaves.start, v), jnp.float32)], 1)
    return Drafted(jnp.concatenate(tokens, axis=1), StepTree.of(tree), draws), state


def _draft_dynamic(base, drafter, state, tree: DynamicTree, root, lengths, sampling, key, vocab):
    """A beam of W nodes per depth, ranked by joint path log-probability under the drafter's
    distributions (softmax of the logits when greedy, `distribution` under the sampling setting
    otherwise): each beam node proposes its W most likely children and the best W of all of them form
    the next beam. The candidates (each depth's beam for `dynamic`, every proposed child for `eagle2`)
    then get slots by the tree's rule (`_allot`), in depth-major order, so parents precede children
    and a node's children sit in decreasing probability. Each candidate knows its parent as a candidate
    index, beam nodes their own; the drafter's cache holds only the beam nodes it expands.

    When sampling, Clover's sampler draws its children instead: the slots of a depth are allotted from
    the *sorted* probabilities of each frontier node's distribution (the j-th slot of node v scores
    P(v) q_v's j-th largest), which the draws do not change, and node v's j-th slot holds v's j-th draw
    without replacement (Gumbel top-k). A node's children are then a prefix of its draws whose length
    was fixed before drawing them, which is what keeps speculative sampling exact. EAGLE-2's global
    rerank compares nodes across depths by their drawn values, so eagle2 keeps chosen children (tested
    as point masses) when sampling."""
    b, w, depth = root.shape[0], tree.beam, tree.max_depth
    pooled = tree.kind == "eagle2"  # every proposed child is a candidate, not only the next beam
    drawn = not sampling.greedy and tree.kind == "dynamic"
    rows = jnp.arange(b)[:, None]
    frontier = _root(root, lengths, tree.draft_slots)
    f_logp = jnp.zeros((b, 1), jnp.float32)  # each frontier node's joint log-probability
    f_cand = jnp.full((b, 1), -1, jnp.int32)  # each frontier node's candidate index (-1: the root)
    cands, frontier_q, frontier_cand, offset = [], [], [], 0
    for d in range(1, depth + 1):
        logits, carry, state = drafter.expand(base, state, frontier, vocab)  # [B, F or 1, V or N]
        if sampling.greedy:
            q = jax.nn.softmax(logits.astype(jnp.float32), -1)
        else:
            q, q_full = _draft_q(logits, sampling, vocab, base)
        prob, tok = top_k(q, w)  # [B, F or 1, W], most likely first
        keep = prob > 0
        if tree.kind == "dynamic":  # Clover: the head's top-p nucleus, and at least min_ratio of its top-1
            keep &= (jnp.cumsum(prob, -1) - prob < tree.top_p) & (prob >= tree.min_ratio * prob[..., :1])
        f = f_logp.shape[1]
        slot_score = (f_logp[:, :, None] + jnp.where(keep, jnp.log(prob), -jnp.inf)).reshape(b, f * w)
        if drawn:
            frontier_q.append(q_full)
            frontier_cand.append(f_cand)
            tok = draw_without_replacement(q, use_keys(key, DRAW, d), w)  # in draw order
            prob = jnp.take_along_axis(q, tok, -1)
        if vocab is not None:
            tok = vocab.token(tok)
        spread = lambda x: jnp.broadcast_to(x, (b, f, w)).reshape(b, f * w)  # per proposed child [B, F*W]
        child_tok, child_parent = spread(tok).astype(jnp.int32), spread(f_cand[:, :, None])
        score, idx = top_k(slot_score, w)  # the next beam: the best W children (-inf: none)
        pick = lambda x: jnp.take_along_axis(x, idx, 1)
        if pooled:
            cands.append((child_tok, slot_score, child_parent))
            beam_cand = offset + idx
        else:
            cands.append((pick(child_tok), score, pick(child_parent)))
            beam_cand = jnp.broadcast_to(offset + jnp.arange(w, dtype=jnp.int32), (b, w))
        offset += cands[-1][0].shape[1]
        if d == depth:  # the deepest candidates are never expanded
            break
        # A node's own joint probability (its drawn token's, when drawn) ranks its children's slots.
        f_logp = jnp.where(score > -jnp.inf, pick(spread(f_logp[:, :, None] + jnp.log(prob))), -jnp.inf)
        f_cand = beam_cand
        parent = idx // w  # each beam node's parent: its index in this frontier
        slots = jnp.broadcast_to(1 + (d - 1) * w + jnp.arange(w, dtype=jnp.int32), (b, w))
        own = jax.nn.one_hot(slots, tree.draft_slots, dtype=bool)
        parent_anc = jnp.take_along_axis(jnp.broadcast_to(frontier.ancestors, (b,) + frontier.ancestors.shape[1:]),
                                         parent[:, :, None], 1)
        frontier = _child_level(frontier, carry, pick(child_tok), parent, slots, parent_anc | own)

    tok, logp, parent = (jnp.concatenate(x, 1) for x in zip(*cands))  # [B, candidates]
    cand_depth = jnp.concatenate([jnp.full(c[0].shape, d, jnp.int32) for d, c in enumerate(cands, 1)], 1)
    tokens, st, slot = _allot(tree, root, tok, logp, parent, cand_depth)
    draws = None
    if drawn:  # each expanded node's distribution at its slot (the root's at slot 0)
        v = frontier_q[0].shape[-1]
        node_slot = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), slot], 1)
        draws = jnp.zeros((b, tree.num_nodes, v), jnp.float32)
        for q_d, cand in zip(frontier_q, frontier_cand):
            draws = draws.at[rows, node_slot[rows, cand + 1]].set(
                jnp.broadcast_to(q_d, cand.shape + (v,)), mode="drop")
    return Drafted(tokens, st, draws), state


def _allot(tree: DynamicTree, root, tok, logp, parent, cand_depth):
    """Slots for the candidates (tokens, joint log-probabilities, parent candidate indices (-1: the
    root), depths [B, C], parents before children): the tree's rule picks N - 1; returns (tokens
    [B, N], StepTree, each candidate's slot [B, C], N where it got none)."""
    b, n = root.shape[0], tree.num_nodes
    rows = jnp.arange(b)
    ok = logp > -jnp.inf
    if tree.kind == "dynamic":  # depth by depth, each its most probable: deeper ones get what is left
        chosen = ok & (jnp.cumsum(ok, 1) <= n - 1)
    else:  # EAGLE-2: the global top N-1; a child never scores above its parent, and ties go to the earlier
        top = top_k(jnp.where(ok, logp, -jnp.inf), n - 1)[1]
        chosen = ok & jnp.zeros_like(ok).at[rows[:, None], top].set(True)
    slot = jnp.where(chosen, jnp.cumsum(chosen, 1), n)  # n: no slot (dropped by the scatters)
    parent_slot = jnp.take_along_axis(jnp.concatenate([jnp.zeros((b, 1), jnp.int32), slot], 1), parent + 1, 1)
    place = lambda vals, fill: jnp.full((b, n), fill, vals.dtype).at[rows[:, None], slot].set(vals, mode="drop")
    tokens = place(tok, 0).at[:, 0].set(root)
    parents = place(parent_slot, -1)
    valid = place(chosen, False).at[:, 0].set(True)
    ancestors, children = _closure(parents, tree.max_depth), _children(parents, tree.beam)
    return tokens, StepTree(parents, place(cand_depth, 0), ancestors, children, valid), slot


def _closure(parents: jax.Array, depth: int) -> jax.Array:
    """[B, N, N] ancestor mask of per-sequence parents [B, N] (-1: none), one generation per pass."""
    n = parents.shape[1]
    eye = jnp.eye(n, dtype=bool)
    has_parent = (parents >= 0)[:, :, None]
    ancestors = jnp.broadcast_to(eye, parents.shape + (n,))
    for _ in range(depth):
        ancestors = eye | (jax.vmap(lambda a, p: a[p])(ancestors, jnp.maximum(parents, 0)) & has_parent)
    return ancestors


def _children(parents: jax.Array, width: int) -> jax.Array:
    """[B, N, W] each node's children in slot order (decreasing probability), -1 padded."""
    b, n = parents.shape
    is_child = parents[:, :, None] == jnp.arange(n)[None, None, :]  # [B, child, parent]
    sibling_rank = jnp.take_along_axis(jnp.cumsum(is_child, 1) - 1, jnp.maximum(parents, 0)[:, :, None], 2)[..., 0]
    return jnp.full((b, n, width), -1, jnp.int32).at[
        jnp.arange(b)[:, None], jnp.where(parents >= 0, parents, n), sibling_rank].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), mode="drop")
