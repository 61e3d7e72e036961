"""Acceptance and K/V compaction on hand-built inputs: greedy acceptance over a small tree, a subtree
accepting the part of a larger tree's path it holds (greedy and sampled), and the accepted path's K/V
moved to contiguous slots."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.engine.drafting import StepTree
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.engine.speculative import accept_greedy, accept_sample, compact
from clover_jax.model.cache import KVCache
from clover_jax.trees.static import Tree

def test_accept_greedy_hand_built():
    """Tree nodes: 0 root, 1 [0], 2 [1], 3 [0, 0], 4 [0, 1], 5 [1, 0]; every row drafts the same
    tokens and the base model's argmax per node (`target`) decides."""
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    tokens = jnp.asarray([[7, 3, 4, 1, 2, 6]] * 4, jnp.int32)
    target = np.array([
        [4, 2, 6, 0, 0, 9],  # node 2 (rank 1) then node 5; node 4 matches node 1's argmax but node 1 fails
        [3, 2, 0, 0, 8, 0],  # node 1 then node 4 (rank 1 at depth 2), bonus 8
        [5, 1, 0, 0, 0, 0],  # nothing: node 3 matches its parent's argmax, the parent does not match
        [3, 0, 0, 0, 0, 0],  # node 1 only; bonus = node 1's argmax
    ])  # fmt: skip
    noise = np.random.default_rng(0).uniform(0, 1, (4, 6, 10))
    logits = jnp.asarray(noise + 5 * np.eye(10)[target], jnp.float32)
    best, bonus, path = jax.jit(accept_greedy, static_argnums=3)(StepTree.of(tree), tokens, logits, tree.max_depth)
    np.testing.assert_array_equal(best, [5, 4, 0, 1])
    np.testing.assert_array_equal(bonus, [9, 8, 5, 0])
    np.testing.assert_array_equal(path, [[0, 2, 5], [0, 1, 4], [0, 0, 0], [0, 1, 1]])


@pytest.mark.parametrize("mode", ["greedy", "drawn", "chosen"])
def test_a_subtree_accepts_the_part_of_the_trees_path_it_holds(mode):
    """`tree.fit_to_hits`'s premise, exactly: on the same step (tokens, base logits, children's draw
    distributions and random keys), a tree whose nodes' children are rank prefixes of a larger tree's
    accepts the deepest node of the larger tree's accepted path that it holds; greedy, and sampling with
    drawn children (`draws`) or chosen ones (point masses)."""
    big = Tree.from_paths([list(p) for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)])
    sub = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
    b, v = 512, 6
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.5, (b, big.num_nodes, v)).astype(np.float32)
    q = rng.dirichlet(np.ones(v), (b, big.num_nodes)).astype(np.float32)
    tokens = np.zeros((b, big.num_nodes), np.int32)
    for node in range(big.num_nodes):  # a node's children: distinct tokens in rank order
        kids = big.children[node][big.children[node] >= 0]
        tokens[:, kids] = np.argsort(rng.uniform(size=(b, v)), axis=1)[:, : len(kids)]
    index = {(): 0} | {p: i + 1 for i, p in enumerate(big.paths)}
    held = [index[p] for p in ((),) + sub.paths]  # the big tree's node of each subtree node
    key = jax.random.split(jax.random.PRNGKey(1), b)

    def accept(tree, nodes):
        st, toks, lg = StepTree.of(tree), jnp.asarray(tokens[:, nodes]), jnp.asarray(logits[:, nodes])
        if mode == "greedy":
            return np.asarray(accept_greedy(st, toks, lg, tree.max_depth)[0])
        draws = jnp.asarray(q[:, nodes]) if mode == "drawn" else None
        return np.asarray(accept_sample(st, toks, lg, SamplingConfig(temperature=1.0), key, tree.max_rank, draws)[0])

    best_big, best_sub = accept(big, list(range(big.num_nodes))), accept(sub, held)
    for row in range(b):
        on_path = np.flatnonzero(big.ancestor_mask[best_big[row]])  # root .. best, in depth order
        want = max((held.index(n) for n in on_path if n in held), key=lambda i: sub.depth[i])
        assert best_sub[row] == want
    assert len(set(sub.depth[best_sub])) == 4  # steps stopping at every depth: the test is not vacuous


def test_compact_moves_the_path_to_contiguous_slots():
    """Every slot holds a distinct value; after compaction slots length + d hold what slot
    length + path[d] held, and every other slot is untouched."""
    layers, b, s, kv, h = 2, 2, 12, 1, 2
    slot_ids = (1000 * np.arange(layers)[:, None, None] + 100 * np.arange(b)[None, :, None]
                + np.arange(s)[None, None, :]).astype(np.float32)
    k = np.broadcast_to(slot_ids[:, :, None, :, None], (layers, b, kv, s, h)).copy()
    lengths = np.array([3, 6], np.int32)
    path = np.array([[0, 2, 5], [0, 1, 1]], np.int32)  # row 1: best at depth 1, padded with itself
    cache = KVCache(k=tuple(jnp.asarray(k)), v=tuple(jnp.asarray(-k)), lengths=jnp.asarray(lengths))
    out = jax.jit(compact)(cache, jnp.asarray(path))
    want = k.copy()
    for row in range(b):
        for d, node in enumerate(path[row]):
            want[:, row, :, lengths[row] + d] = k[:, row, :, lengths[row] + node]
    np.testing.assert_array_equal(np.stack(out.k), want)
    np.testing.assert_array_equal(np.stack(out.v), -want)
    np.testing.assert_array_equal(out.lengths, lengths)
