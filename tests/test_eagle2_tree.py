"""The engine's `eagle2` tree is the one EAGLE-2's authors draft: on the same drafter outputs it holds
the nodes (token paths) and parents that `eagle2_reference.eagle2_tree` (their `topK_genrate` in NumPy)
selects, for a drafter whose logits depend on the context and the whole path, at several budgets,
top-k and depths, per sequence; and for EAGLE-3's draft model run along each path, drafting deeper than
the steps it has (its logits read from drafting each path as a chain). The spec language gives the
authors' parameters their meaning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters.base import Committed, Frontier
from clover_jax.drafters.heads import Heads, make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.engine.decode import prefill
from clover_jax.engine.drafting import draft_tree
from clover_jax.model.config import ModelConfig
from clover_jax.model.llama import Llama
from clover_jax.plan.factory import LoadedDrafter
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.spec import resolve_tree
from conftest import draft_with_context
from eagle2_reference import eagle2_tree
from test_drafter import perturbed

VOCAB = 32
BUCKETS = 4099  # the path hashes' range: a prime, so paths rarely share a row of logits


def _step(h: int, token: int) -> int:
    return (h * 131 + token + 7) % BUCKETS


class PathHeads(Heads):
    """Heads whose logits at a node are table[h], h a hash of the context and the node's whole token
    path, so every node of a tree has logits of its own, as a draft model's nodes do. The context
    state's first entry seeds the hash."""

    def __init__(self, table, depth: int):
        super().__init__(drafter_config("clover", depth), ModelConfig.tiny(vocab_size=VOCAB), [])
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))

    def node_state(self, base, k, state, token):
        parent = state[..., 0].astype(jnp.int32) if k == 0 else state  # the root's parent: the context
        return (parent * 131 + token + 7) % BUCKETS

    def node_logits(self, base, k, state, token, vocab=None):
        return self.table[...][state]


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def table_log_probs(table: np.ndarray, seed: int):
    """`eagle2_tree`'s log_probs for PathHeads with context seed `seed`."""
    def log_probs(path):
        h = seed
        for t in path:
            h = _step(h, t)
        return log_softmax(table[h])
    return log_probs


def drafted_paths(tokens, st, b: int) -> dict[tuple[int, ...], tuple[int, ...] | None]:
    """Sequence b's drafted tree as {token path from the root: its parent's path (None: the root)}."""
    tokens, parents, anc, valid = (np.asarray(x)[b] for x in (tokens, st.parents, st.ancestors, st.valid))
    path = lambda i: tuple(int(t) for t in tokens[np.flatnonzero(anc[i])])  # slots in order: root first
    return {path(i): None if i == 0 else path(parents[i]) for i in np.flatnonzero(valid)}


def reference_paths(ref) -> dict[tuple[int, ...], tuple[int, ...] | None]:
    return {p: None if q < 0 else ref.paths[q] for p, q in zip(ref.paths, ref.parents)}


# (N, K, D): a small and a large budget, the whole pool, a single expansion, and the authors' defaults.
CONFIGS = [(5, 3, 3), (20, 3, 3), (31, 3, 3), (12, 4, 1), (60, 10, 7)]


@pytest.mark.parametrize("n, k, d", CONFIGS, ids=[f"eagle2:{n},{k},{d}" for n, k, d in CONFIGS])
def test_the_eagle2_tree_is_the_authors(n, k, d):
    """Two sequences, the same root, different contexts: each drafts the reference's tree, nodes and
    parents alike, filling the whole budget at most D + 1 deep, and the two trees differ."""
    table = np.random.default_rng(0).normal(0, 2.0, (BUCKETS, VOCAB)).astype(np.float32)
    heads = PathHeads(table, d + 1)
    tree = resolve_tree(f"eagle2:{n},{k},{d}", "clover", d + 1)
    assert tree == DynamicTree.eagle2(n, k, d) and tree.max_depth == d + 1
    seeds, roots = [3, 11], jnp.asarray([5, 5], jnp.int32)
    context = jnp.asarray(seeds, jnp.float32)[:, None]
    tokens, st, draws = jax.jit(draft_with_context, static_argnums=(0, 2))(None, heads, tree, context, roots)
    assert draws is None
    got = [drafted_paths(tokens, st, b) for b in range(2)]
    for b, seed in enumerate(seeds):
        want = eagle2_tree(table_log_probs(table, seed), 5, n, k, d)
        assert len(want.paths) == n and got[b] == reference_paths(want)
        assert max(len(p) for p in got[b]) - 1 <= d + 1
        depth = np.asarray(st.depth)[b][np.asarray(st.valid)[b]]
        assert sorted(depth) == sorted(len(p) - 1 for p in got[b])
    assert got[0] != got[1]


def test_eagle3_drafts_the_authors_tree_deeper_than_its_steps():
    """EAGLE-3's draft model (3 chained steps) on eagle2:40,3,4 (the whole pool, 5 deep): the
    reference, reading each node's logits from drafting its path as a chain, selects the tree the
    engine drafted, for two prompts: the beam nodes' slots, ancestors and carried features are the ones
    a chain gives, past the trained steps too."""
    base = Llama(ModelConfig.tiny(), rngs=nnx.Rngs(1))
    drafter = perturbed("eagle3", base, 3)
    prompts = jnp.asarray([[1, 7, 8, 9, 5], [1, 3, 4, 22, 0]], jnp.int32)
    lens = jnp.asarray([5, 4], jnp.int32)

    @jax.jit
    def committed(base, drafter):  # the prompts committed to the drafter, and the roots
        out, logits = prefill(base, prompts, lens, 32, feature_layers=drafter.feature_layers)
        root = jnp.argmax(logits, -1).astype(jnp.int32)
        following = jnp.concatenate([prompts[:, 1:], jnp.zeros((2, 1), jnp.int32)], 1)
        following = following.at[jnp.arange(2), lens - 1].set(root)
        new = Committed(out.hidden, out.hidden_normed, following, out.features)
        return root, drafter.commit(base, drafter.init(base, 2, 32), new, lens, jnp.ones((2,), bool))

    root, state = committed(base, drafter)
    expand = jax.jit(lambda base, drafter, state, frontier: drafter.expand(base, state, frontier))
    chains = {}  # token path -> expand's (logits [2, 1, V], carry, state) at its last node, both rows drafting it

    def chain(path):
        """`test_drafter.chain_logits`, one level at a time from the path's parent's chain: node j in slot j."""
        if path not in chains:
            j = len(path) - 1
            carry, at = (None, state) if j == 0 else chain(path[:-1])[1:]
            frontier = Frontier(tokens=jnp.full((2, 1), path[-1], jnp.int32), parents=jnp.zeros((2, 1), jnp.int32),
                                slots=jnp.full((2, 1), j, jnp.int32),
                                ancestors=jnp.asarray(np.arange(6) <= j)[None, None],
                                positions=lens[:, None] + j, carry=carry, depth=j)
            chains[path] = expand(base, drafter, at, frontier)
        return chains[path]

    tree = resolve_tree("eagle2:40,3,4", "eagle3", 3)
    assert tree == DynamicTree.eagle2(40, 3, 4) and tree.max_depth == 5 > drafter.num_heads
    drafted, _ = jax.jit(draft_tree, static_argnums=3)(base, drafter, state, tree, root, lens)
    for b in range(2):
        want = eagle2_tree(lambda path: log_softmax(chain(path)[0][b, 0]), int(root[b]), 40, 3, 4)
        assert drafted_paths(drafted.tokens, drafted.tree, b) == reference_paths(want)
        assert max(len(p) for p in want.paths) - 1 == 5  # past the 3 trained steps


def test_eagle2_specs_take_the_authors_parameters():
    """eagle2:N,K,D: N nodes (root included), top-k K, D expansions after the root's; parts left out
    take the authors' 60, 10, 7, and heads limit the default depth to what they draft; the tree's name
    spells every parameter."""
    assert resolve_tree("eagle2", "eagle3", 7) == DynamicTree.eagle2() == DynamicTree("eagle2", 60, 8, 10)
    assert str(DynamicTree.eagle2()) == "eagle2:60,10,7"
    t = DynamicTree.eagle2()
    assert (t.candidates, t.draft_slots, t.max_depth) == (10 + 7 * 100, 1 + 7 * 10, 8)
    assert resolve_tree("eagle2:20,3", "eagle", 5) == DynamicTree.eagle2(20, 3, 7)  # a draft model: any depth
    assert resolve_tree("eagle2:20", "medusa", 4) == DynamicTree.eagle2(20, 10, 3)  # heads: 4 deep at most
    assert resolve_tree("eagle2", "medusa", 1) == DynamicTree.eagle2(11, 10, 0)  # the root's 10 children
    assert resolve_tree("eagle2:9,3,4", "eagle3", 3).max_depth == 5
    assert resolve_tree("chain:6", "eagle3", 3).max_depth == 6  # static trees too


def test_benchmark_rows_name_the_dynamic_tree_they_ran(monkeypatch):
    """A benchmark row's tree column spells a dynamic tree's every setting, and on an accelerator an
    EAGLE method's `default` row names the authors' tree it drafts, not 'default'."""
    from infer import benchmark

    base = Llama(ModelConfig.tiny(), rngs=nnx.Rngs(1))
    eagle3 = LoadedDrafter("eagle3", make_heads(drafter_config("eagle3", 3), base), None)
    clover2 = LoadedDrafter("clover2", make_heads(drafter_config("clover2", 3), base), None)
    plan = lambda drafter, spec: benchmark.planned(base, drafter, spec, "auto", "auto", False)[0]
    assert plan(eagle3, "eagle2") == "eagle2:60,10,7" and plan(clover2, "eagle2:26") == "eagle2:26,10,2"
    assert plan(clover2, "dynamic:26") == "dynamic:26,9"  # 3 heads: a beam of 9 fills 25 slots
    assert plan(eagle3, None) is None  # on this CPU: the paper tree
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert plan(eagle3, None) == plan(eagle3, "auto") == "eagle2:60,10,7"
    assert plan(clover2, None) is None and plan(clover2, "auto") is None
