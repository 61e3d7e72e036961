"""Dynamic trees as drafting builds them: greedy, the paths a plain Python reference selects (EAGLE-2's
rerank as its authors write it, and Clover's per-depth beam), with consistent arrays; sampling, children
drawn into a shape settled before the draw."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.engine.sampling import SamplingConfig
from clover_jax.model.config import ModelConfig
from clover_jax.trees.dynamic import DynamicTree
from conftest import TableHeads, draft_with_context
from eagle2_reference import eagle2_tree

def reference_dynamic(probs: np.ndarray, root: int, tree: DynamicTree) -> set[tuple[int, ...]]:
    """The token paths `DynamicTree`'s docstring selects, written out in plain Python (float64); eagle2's
    are its authors' (`eagle2_reference`), the log-probabilities at depth d those of table d."""
    if tree.kind == "eagle2":
        ref = eagle2_tree(lambda path: np.log(probs[len(path) - 1, path[-1]]), root, tree.num_nodes, tree.beam,
                          tree.max_depth - 1)
        return {path[1:] for path in ref.paths[1:]}
    frontier, candidates = [((root,), 0.0)], []
    for d in range(tree.max_depth):
        level = []
        for path, logp in frontier:
            q = probs[d, path[-1]]
            order = np.argsort(-q, kind="stable")[: tree.beam]
            mass = 0.0
            for t in order:
                keep = mass < tree.top_p and q[t] >= tree.min_ratio * q[order[0]]
                mass += q[t]
                if keep:
                    level.append((path + (int(t),), logp + np.log(q[t])))
        frontier = sorted(level, key=lambda c: -c[1])[: tree.beam]
        candidates += frontier
    return {path[1:] for path, _ in candidates[: tree.num_nodes - 1]}


@pytest.mark.parametrize("kind", ["dynamic", "eagle2"])
def test_dynamic_tree_matches_a_plain_python_reference(kind):
    """Per sequence (different roots), the drafted tree holds exactly the reference's paths, within its
    budget, and its arrays are one consistent tree: parents precede children one depth up, ancestors
    follow the parents, children are listed by decreasing probability, empty slots are masked."""
    depth, vocab, n, beam = 3, 12, 9, 3
    rng = np.random.default_rng(0)
    table = rng.normal(0, 2.0, (depth, vocab, vocab))
    heads = TableHeads(ModelConfig.tiny(vocab_size=vocab), table)
    probs = np.exp(table) / np.exp(table).sum(-1, keepdims=True)
    tree = DynamicTree(kind, n, depth, beam)
    roots = np.arange(vocab, dtype=np.int32)
    tokens, st, draws = jax.jit(draft_with_context, static_argnums=(0, 2))(
        None, heads, tree, jnp.zeros((vocab, 4)), jnp.asarray(roots))
    tokens, parents, node_depth, anc, children, valid = map(
        np.asarray, (tokens, st.parents, st.depth, st.ancestors, st.children, st.valid))
    assert draws is None  # greedy: children are chosen, not drawn
    assert tokens.shape == (vocab, n) and valid.sum(1).max() <= n
    for b, root in enumerate(roots):
        assert tokens[b, 0] == root and valid[b, 0] and parents[b, 0] == -1
        paths = set()
        for i in np.flatnonzero(valid[b])[1:]:
            p = parents[b, i]
            assert 0 <= p < i and valid[b, p] and node_depth[b, i] == node_depth[b, p] + 1
            assert (anc[b, i] == (np.eye(n, dtype=bool)[i] | anc[b, p])).all()
            chain = np.flatnonzero(anc[b, i])
            paths.add(tuple(tokens[b, chain[1:]]))
        assert paths == reference_dynamic(probs, int(root), tree)
        for i in range(n):
            kids = [c for c in children[b, i] if c >= 0]
            assert kids == [c for c in np.flatnonzero(valid[b] & (parents[b] == i))]
            q = [probs[node_depth[b, i], tokens[b, i], tokens[b, c]] for c in kids]
            assert q == sorted(q, reverse=True)


def test_sampled_dynamic_tree_draws_children_into_a_fixed_shape():
    """Sampling with Clover's sampler: how many children a node gets is settled before its children are
    drawn (here the root's, from its sorted probabilities alone), so it is the same under every key;
    the children themselves are draws without replacement (distinct, varying with the key), and the
    distribution returned at each node is the one they were drawn from."""
    depth, vocab = 2, 12
    table = np.random.default_rng(1).normal(0, 1.0, (depth, vocab, vocab))
    heads = TableHeads(ModelConfig.tiny(vocab_size=vocab), table)
    tree = DynamicTree("dynamic", 6, depth, 4)
    run = jax.jit(draft_with_context, static_argnums=(0, 2, 5))
    root = jnp.full((64,), 3, jnp.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 64))
    tokens, st, draws = run(None, heads, tree, jnp.zeros((64, 4)), root, SamplingConfig(temperature=1.0), keys)
    tokens, children = np.asarray(tokens), np.asarray(st.children)
    kids = (children[:, 0] >= 0).sum(1)
    assert (kids == kids[0]).all() and kids[0] >= 1
    first = [tuple(tokens[b, children[b, 0, : kids[0]]]) for b in range(64)]
    assert all(len(set(f)) == len(f) for f in first) and len(set(first)) > 1
    q_root = np.exp(table[0, 3]) / np.exp(table[0, 3]).sum()
    np.testing.assert_allclose(np.asarray(draws)[:, 0], np.broadcast_to(q_root, (64, vocab)), rtol=1e-5)
