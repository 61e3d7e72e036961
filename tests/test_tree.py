"""Tree topology constants against hand-drawn trees, the constructors, the defaults and every error."""

import json

import numpy as np
import pytest

from clover_jax.drafters import HEADS
from clover_jax.drafters import registry
from clover_jax.errors import CloverError
from clover_jax.trees.spec import DEFAULT_TREES, accelerator_default, resolve_tree
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.static import EAGLE_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63, Tree, chain, from_widths, full
from clover_jax.plan.auto import auto_step_cost, auto_tree, cpu_chain_cost, step_cost_for
from clover_jax.trees.fit import fit, fit_to_hits

#            0 (root)
#          /    \
#   rank0 1      2 rank1
#        / \      \
#       3   4      5
#       |
#       6
SMALL = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _check_consistent(t: Tree):
    """Every derived constant agrees with `parents`, `depth` and `rank`."""
    n = t.num_nodes
    for i in range(1, n):
        p = t.parents[i]
        assert p < i and t.depth[i] == t.depth[p] + 1
        assert t.children[p, t.rank[i]] == i
        np.testing.assert_array_equal(t.ancestor_mask[i], t.ancestor_mask[p] | (np.arange(n) == i))
    assert t.num_children.sum() == n - 1
    for d, nodes in enumerate(t.depth_nodes, start=1):
        np.testing.assert_array_equal(nodes, np.arange(n)[t.level(d)])
        assert (t.depth[nodes] == d).all() and t.max_rank[d - 1] == t.rank[nodes].max() + 1


def test_small_tree_literal_arrays():
    t = Tree.from_paths(SMALL)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (t.num_nodes, t.max_depth, t.num_leaves) == (7, 3, 3)
    np.testing.assert_array_equal(t.parents, [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(t.rank, [0, 0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(
        t.ancestor_mask.astype(int),
        [[1, 0, 0, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0, 0],
         [1, 0, 1, 0, 0, 0, 0],
         [1, 1, 0, 1, 0, 0, 0],
         [1, 1, 0, 0, 1, 0, 0],
         [1, 0, 1, 0, 0, 1, 0],
         [1, 1, 0, 1, 0, 0, 1]],
    )  # fmt: skip
    assert [d.tolist() for d in t.depth_nodes] == [[1, 2], [3, 4, 5], [6]]
    assert t.level(2) == slice(3, 6) and t.level(0) == slice(0, 1)
    assert t.max_rank == (2, 2, 1)
    np.testing.assert_array_equal(t.num_children, [2, 2, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(t.children, [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]])
    for a in (t.parents, t.depth, t.rank, t.ancestor_mask, t.children, t.num_children):
        assert a.dtype in (np.int32, np.bool_) and not a.flags.writeable
    assert all(d.dtype == np.int32 and not d.flags.writeable for d in t.depth_nodes)
    _check_consistent(t)


def test_unsorted_input_is_put_in_canonical_order():
    t = Tree.from_paths([(2, 0), [1], (2,), [0]])
    assert t.paths == ((0,), (1,), (2,), (2, 0))
    np.testing.assert_array_equal(t.parents, [-1, 0, 0, 0, 3])
    np.testing.assert_array_equal(t.rank, [0, 0, 1, 2, 0])
    np.testing.assert_array_equal(t.children, [[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [4, -1, -1], [-1, -1, -1]])
    assert t == Tree.from_paths([[0], [1], [2], [2, 0]])


def test_chain():
    t = chain(3)
    assert t.paths == ((0,), (0, 0), (0, 0, 0))
    np.testing.assert_array_equal(t.parents, [-1, 0, 1, 2])
    np.testing.assert_array_equal(t.ancestor_mask, np.tril(np.ones((4, 4), bool)))
    assert t.max_rank == (1, 1, 1) and t.children.shape == (4, 1)


def test_fitted_tree_holds_the_most_counted_paths_that_make_a_tree():
    """The most counted rank paths, each taken once its parent and next better sibling are in: (2,) is
    counted more than (1,) but waits for it; depth and node budget are kept; uncounted paths fill a
    budget the counts cannot, shallow and best-ranked first."""
    counts = {(0,): 50, (1,): 20, (2,): 25, (0, 0): 30, (0, 1): 5, (1, 0): 10, (0, 0, 0): 12}
    assert fit(counts, 6, 3).paths == ((0,), (1,), (2,), (0, 0), (0, 0, 0))
    assert fit(counts, 7, 3).paths == ((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0))
    assert fit(counts, 7, 2).paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))
    assert fit(counts, 3, 3).paths == ((0,), (0, 0))
    assert fit({}, 4, 2).paths == ((0,), (1,), (2,))
    with pytest.raises(CloverError, match="at least 2 nodes"):
        fit(counts, 1, 3)


def test_a_tree_fitted_to_decodings_hits_keeps_the_nodes_that_accepted_most(tmp_path):
    """fit_to_hits reads hits [N] of a decoded tree (root first, its steps) as the counts `fit` takes,
    its depth the decoded tree's; to_file writes what from_file reads, with where it came from."""
    run = full(3, 2)  # (0,) (1,) (2,) then (0, 0) .. (2, 2)
    hits = np.zeros(run.num_nodes, int)
    hits[0] = 100
    for path, h in {(0,): 50, (1,): 20, (2,): 25, (0, 0): 30, (0, 1): 5, (1, 0): 10}.items():
        hits[run.paths.index(path) + 1] = h
    fitted = fit_to_hits(run, hits, 6)
    assert fitted.paths == ((0,), (1,), (2,), (0, 0), (1, 0)) and fitted.max_depth == 2
    assert fit_to_hits(run, hits, run.num_nodes) == run
    out = tmp_path / "t.json"
    fitted.to_file(out, temperature=1.0, steps=100)
    assert Tree.from_file(str(out)) == fitted and json.loads(out.read_text())["temperature"] == 1.0


def test_full_and_widths():
    t = full(2, 2)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))
    np.testing.assert_array_equal(t.children, [[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]])
    w = from_widths([3, 2, 1])
    assert w.num_nodes == 1 + 3 + 6 + 6 and w.max_depth == 3 and w.max_rank == (3, 2, 1)
    assert w.num_leaves == 6
    _check_consistent(w)


@pytest.mark.parametrize(
    "paths, message",
    [
        ("[[0]]", r"must be a list of paths .* got str"),
        ({"paths": [[0]]}, r"must be a list of paths .* got dict"),
        ([], r"tree is empty"),
        ([[0], []], r"path \[\] is empty"),
        ([[0], 1], r"path 1 is not a list"),
        ([[0], [0, -1]], r"rank -1: ranks are integers >= 0"),
        ([[0], [0, 1.0]], r"rank 1\.0: ranks are integers"),
        ([[0], [True]], r"rank True"),
        ([[0], [1], [0]], r"path \[0\] appears twice"),
        ([[0], (0,)], r"path \[0\] appears twice"),
        ([[0], [1, 0]], r"path \[1, 0\] has no parent: add the path \[1\]"),
        ([[0], [2]], r"the root has children of ranks \[0, 2\] but not rank 1"),
        ([[0], [0, 1]], r"node \[0\] has children of ranks \[1\] but not rank 0"),
        ([[i] for i in range(5000)], r"5001 nodes, more than the 4096"),
    ],
)
def test_validation_errors(paths, message):
    with pytest.raises(CloverError, match=message):
        Tree.from_paths(paths)


def test_max_depth_error():
    Tree.from_paths(SMALL, max_depth=3)
    with pytest.raises(CloverError, match=r"path \[0, 0, 0\] has depth 3, more than the 2 heads"):
        Tree.from_paths(SMALL, max_depth=2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: chain(0), r"chain depth must be a positive integer, got 0"),
        (lambda: full(2, -1), r"tree depth must be a positive integer"),
        (lambda: from_widths([]), r"non-empty list"),
        (lambda: from_widths([2, 0]), r"tree width must be a positive integer, got 0"),
        (lambda: full(10, 5), r"111111 nodes, more than the 4096"),
    ],
)
def test_constructor_errors(call, message):
    with pytest.raises(CloverError, match=message):
        call()


def test_json_file(tmp_path):
    plain, wrapped = tmp_path / "plain.json", tmp_path / "wrapped.json"
    plain.write_text(json.dumps(SMALL))
    wrapped.write_text(json.dumps({"paths": SMALL}))
    assert Tree.from_file(str(plain)) == Tree.from_file(str(wrapped)) == Tree.from_paths(SMALL)
    with pytest.raises(CloverError, match=r"more than the 2 heads"):
        Tree.from_file(str(plain), max_depth=2)
    with pytest.raises(CloverError, match=r"cannot read tree file .*missing\.json"):
        Tree.from_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1")
    with pytest.raises(CloverError, match=r"tree file .*bad\.json is not valid JSON"):
        Tree.from_file(str(bad))
    bad.write_text('{"tree": [[0]]}')
    with pytest.raises(CloverError, match=r"object without a 'paths' key"):
        Tree.from_file(str(bad))


def test_hash_and_equality_follow_paths():
    a, b = Tree.from_paths(SMALL), Tree.from_paths(list(reversed(SMALL)))
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != chain(3) and a != SMALL
    assert len({a, b, chain(3)}) == 2
    assert repr(a) == "Tree(num_nodes=7, max_depth=3, leaves=3)"
    with pytest.raises(AttributeError):
        a.paths = ()


def test_tree_is_a_static_jit_argument():
    import jax
    import jax.numpy as jnp

    calls = []

    def f(x, tree):
        calls.append(tree)
        return x[jnp.asarray(tree.parents[1:])]

    g = jax.jit(f, static_argnums=1)
    x = jnp.arange(7)
    np.testing.assert_array_equal(g(x, Tree.from_paths(SMALL)), [0, 0, 1, 1, 2, 3])
    g(x, Tree.from_paths(list(reversed(SMALL))))  # equal tree: no retrace
    assert len(calls) == 1


def test_default_trees():
    sizes = {"medusa": (64, 4, 42), "clover": (62, 3, 41), "clover2": (26, 5, 15)}
    assert {m: registry.get(m).depth for m in HEADS} == {"medusa": 4, "clover": 3, "clover2": 5}
    for method, t in DEFAULT_TREES.items():
        assert (t.num_nodes, t.max_depth, t.num_leaves) == sizes[method]
        assert t.max_depth <= registry.get(method).depth
        _check_consistent(t)
    assert len(MEDUSA_MC_SIM_7B_63) == 63 and len(EAGLE_MC_SIM_7B_63) == 25
    assert DEFAULT_TREES["medusa"] == Tree.from_paths(MEDUSA_MC_SIM_7B_63)
    assert DEFAULT_TREES["clover2"] == Tree.from_paths(EAGLE_MC_SIM_7B_63)
    assert DEFAULT_TREES["clover2"].max_rank == (4, 3, 3, 3, 2)
    assert DEFAULT_TREES["medusa"].max_rank == (10, 10, 10, 2)


def test_resolve_tree_specs(tmp_path):
    assert resolve_tree(None, "clover2", 5) == DEFAULT_TREES["clover2"]
    assert resolve_tree("default", "clover", 3) == DEFAULT_TREES["clover"]
    assert resolve_tree("mc_sim_7b_63", "medusa", 4) == DEFAULT_TREES["medusa"]
    assert resolve_tree(None, "clover2", 3).max_depth == 3  # named trees are cut to the heads
    assert resolve_tree("medusa_mc_sim_7b_63", "clover2", 5) == DEFAULT_TREES["medusa"]
    assert resolve_tree("eagle_mc_sim_7b_63", "medusa", 2).num_nodes == 13
    assert resolve_tree("chain:4", "medusa", 4) == chain(4)
    assert resolve_tree("full:2x3", "clover2", 5) == full(2, 3)
    assert resolve_tree(" widths:4,2,1 ", "clover2", 5) == from_widths([4, 2, 1])
    assert resolve_tree(json.dumps(SMALL), "medusa", 4) == Tree.from_paths(SMALL)
    assert resolve_tree(json.dumps({"paths": SMALL}), "medusa", 4) == Tree.from_paths(SMALL)
    assert resolve_tree(SMALL, "medusa", 4) == Tree.from_paths(SMALL)
    assert resolve_tree(chain(2), "medusa", 4) == chain(2)
    f = tmp_path / "t.json"
    f.write_text(json.dumps(SMALL))
    assert resolve_tree(str(f), "clover", 3) == Tree.from_paths(SMALL)
    assert auto_tree(5, "cpu") == "chain:5" and auto_tree(4, "gpu") == auto_tree(4, "tpu") == "default"
    with pytest.raises(CloverError, match=r"^tree auto is a choice a generator's planner makes .* name one here"):
        resolve_tree("auto", "clover2", 5)  # the planner decides it (plan.factory.plan_tree), not the tree spec


def test_default_is_the_heads_fitted_tree_where_they_ship_one():
    """Heads with a fitted tree (tree.json) draft it by default and by `fitted`; `paper` is the method's
    paper tree whatever the heads ship; the fitted tree is checked against the heads like any other."""
    fitted = Tree.from_paths(SMALL)
    assert resolve_tree(None, "clover2", 5, fitted_tree=fitted) == fitted
    assert resolve_tree(" default", "clover2", 5, fitted_tree=fitted) == fitted
    assert resolve_tree("fitted", "clover2", 5, fitted_tree=fitted) == fitted
    assert resolve_tree("paper", "clover2", 5, fitted_tree=fitted) == DEFAULT_TREES["clover2"]
    assert resolve_tree("paper", "clover", 3) == resolve_tree("default", "clover", 3) == DEFAULT_TREES["clover"]
    assert resolve_tree("chain:2", "clover2", 5, fitted_tree=fitted) == chain(2)
    with pytest.raises(CloverError, match="no fitted tree"):
        resolve_tree("fitted", "clover2", 5)
    with pytest.raises(CloverError, match="more than the 2 heads"):
        resolve_tree("default", "clover2", 2, fitted_tree=fitted)


def test_auto_on_a_cpu_picks_the_chain_depth_the_held_out_tau_says_is_fastest():
    """With the heads' held-out chain tau by depth, a CPU's `auto` is the chain with the most tokens per
    unit of its step cost (CPU_CHAIN_COST, in plain steps); an accelerator's stays the paper tree."""
    weak = [1.38, 1.49, 1.52, 1.54, 1.55]  # SmolLM2's round-5 Clover-2: each draft past the first adds little
    assert auto_tree(5, "cpu", weak) == "chain:1"
    strong = [1.9, 2.7, 3.3, 3.5]  # heads right most of the time: depth 3 (2.10 tokens per plain step) beats 4 (2.05)
    assert auto_tree(4, "cpu", strong) == "chain:3"
    assert auto_tree(2, "cpu", strong) == "chain:2"  # entries past the heads are not used
    assert auto_tree(5, "gpu", weak) == "default"
    assert resolve_tree("default", "clover2", 5) == DEFAULT_TREES["clover2"]  # only auto reads the tau


def test_auto_on_a_cpu_decodes_plain_where_no_chain_is_modelled_to_pay():
    """Sampling adds the draws and the acceptance test to a speculative step (CPU_SAMPLING_COST): a
    chain:1 step is modelled at 1.39 plain steps then, against 1.29 greedy. Heads whose best depth
    writes fewer tokens than that cost get None (no drafting); heads that pay keep their chain, and an
    accelerator its paper tree."""
    assert (cpu_chain_cost(1), cpu_chain_cost(1, sampling=True), cpu_chain_cost(5, True)) == (1.29, 1.39, 1.95)
    weak = [1.38, 1.49, 1.52, 1.54, 1.55]  # 1.38 / 1.39 at one draft; deeper chains pay less
    assert auto_tree(5, "cpu", weak) == "chain:1" and auto_tree(5, "cpu", weak, sampling=True) is None
    assert auto_tree(5, "cpu", [1.29, 1.4]) is None  # exactly a step's cost is no gain
    assert auto_tree(4, "cpu", [1.9, 2.7, 3.3, 3.5], sampling=True) == "chain:3"
    assert auto_tree(5, "gpu", weak, sampling=True) == "default" and auto_tree(5, "cpu", sampling=True) is None
    assert auto_step_cost("chain:1", "cpu", sampling=True) == 1.39
    assert step_cost_for("auto", "auto", "chain:2", "cpu", sampling=True) == 1.53


def test_step_cost_paces_the_chain_auto_picks_on_a_cpu():
    """--step-cost auto: the CPU's cost of the chain `auto` picked (1.15 + 0.14 per draft, in plain
    steps), and only when the tree is `auto`; no pacing on an accelerator, whose paper tree costs about
    one plain step; none never paces; a number is the cost; anything else is one error line."""
    assert auto_step_cost("chain:1", "cpu") == 1.29 and auto_step_cost("chain:5", "cpu") == 1.85
    assert auto_step_cost("default", "gpu") is None and auto_step_cost("chain:1", "tpu") is None
    assert step_cost_for("auto", "auto", "chain:1", "cpu") == 1.29
    assert step_cost_for("auto", "chain:1", "chain:1", "cpu") is None  # a tree asked for by name is not paced
    assert step_cost_for("auto", "auto", "default", "gpu") is None
    assert step_cost_for("none", "auto", "chain:1", "cpu") is None and step_cost_for(None, "auto", "chain:1") is None
    assert step_cost_for("1.5", "default", "chain:1") == 1.5 and step_cost_for(2, "auto", "chain:1") == 2.0
    for bad in ("0", "-1", "cheap", "nan"):
        with pytest.raises(CloverError, match=f"step_cost='{bad}': write auto, none, or a speculative step's cost"):
            step_cost_for(bad, "auto", "chain:1", "cpu")


def test_resolve_dynamic_trees():
    """dynamic:N: N slots (root included, like a static tree's node count), depth = the heads, beam 8
    unless the budget needs more candidates (or fewer suffice); eagle2:N,K,D the authors' parameters
    (tests/test_eagle2_tree.py), depth D + 1 at most as deep as heads draft."""
    t = resolve_tree("dynamic:26", "clover2", 5)
    assert t == DynamicTree("dynamic", 26, 5, 8) and (t.num_nodes, t.max_depth, t.candidates) == (26, 5, 40)
    assert t.top_p == 0.8 and t.min_ratio == 0.25  # Clover's sampler
    assert t.draft_slots == 1 + 4 * 8  # the root and the beams of depths 1..4: the deepest are not expanded
    assert resolve_tree("dynamic:10,5", "clover", 3) == DynamicTree("dynamic", 10, 3, 5)
    assert str(resolve_tree("dynamic:10,5", "clover", 3)) == "dynamic:10,5"
    assert resolve_tree(t, "clover2", 5) is t
    assert resolve_tree("eagle2:64", "medusa", 4) == DynamicTree.eagle2(64, 10, 3)
    assert resolve_tree("eagle2:4", "clover", 3) == DynamicTree("eagle2", 4, 3, 10)
    assert str(resolve_tree("eagle2:4,2", "clover", 3)) == "eagle2:4,2,2"


def test_default_on_an_accelerator_is_each_eagle_methods_own_dynamic_tree():
    """On a GPU or TPU, `default` (and `auto`, which stands for it there) is EAGLE-3's authors' tree for
    eagle3 and EAGLE-2's for eagle (EAGLE-1's draft model), fitted tree or not; on a CPU, and for the
    heads anywhere, it stays the fitted or paper tree."""
    fitted = Tree.from_paths(SMALL)
    for backend in ("gpu", "tpu"):
        assert resolve_tree("default", "eagle3", 7, backend=backend) == DynamicTree.eagle2(60, 10, 7)
        assert resolve_tree(None, "eagle", 5, backend=backend, fitted_tree=fitted) == DynamicTree.eagle2(60, 10, 5)
        assert resolve_tree(auto_tree(3, backend), "eagle3", 3, backend=backend) == DynamicTree.eagle2(60, 10, 7)
        assert resolve_tree("default", "clover2", 5, backend=backend) == DEFAULT_TREES["clover2"]
        assert resolve_tree("default", "medusa", 4, backend=backend, fitted_tree=fitted) == fitted
        assert resolve_tree("paper", "eagle3", 7, backend=backend) == Tree.from_paths(EAGLE_MC_SIM_7B_63)
    paper = Tree.from_paths(EAGLE_MC_SIM_7B_63)
    assert resolve_tree("default", "eagle3", 7, backend="cpu") == paper
    assert resolve_tree("default", "eagle", 5, backend="cpu", fitted_tree=fitted) == fitted
    assert resolve_tree(auto_tree(3, "cpu"), "eagle3", 3, backend="cpu") == chain(3)
    assert accelerator_default("eagle3", "gpu") == "eagle2:60,10,7"
    assert accelerator_default("eagle", "tpu") == "eagle2:60,10,5"
    assert accelerator_default("eagle3", "cpu") is accelerator_default("clover2", "gpu") is None
    assert resolve_tree("default", "eagle3", 7) == paper  # the suite runs on a CPU


@pytest.mark.parametrize(
    "spec, method, heads, message",
    [
        (None, "eagle-9", 4, r"unknown method 'eagle-9'"),
        (None, "medusa", 0, r"num_heads must be a positive integer"),
        ("dynamic:", "clover", 3, r"write dynamic:N \(N tree slots, root included\) or dynamic:N,W"),
        ("eagle2:9,2,1,1", "clover", 3, r"write eagle2, eagle2:N, eagle2:N,K or eagle2:N,K,D"),
        ("eagle2:a", "clover", 3, r"write eagle2, eagle2:N"),
        ("eagle2:9,2,1", "clover", 3, r"eagle2:9 cannot be filled by the 6 candidates of top-k 2 and depth 1"),
        ("eagle2:9,3,3", "clover", 3, r"eagle2:9,3,3 of depth 4 needs more than the 3 draft heads"),
        ("eagle2:9,0,3", "eagle3", 3, r"needs depth >= 0 and top-k >= 1, got 3 and 0"),
        ("eagle2:9,3,-1", "eagle3", 3, r"needs depth >= 0 and top-k >= 1, got -1 and 3"),
        ("eagle2:10,100,41", "eagle3", 3, r"eagle2:10,100,41 expands 4100 nodes a step, more than the 4095 supported"),
        ("dynamic:1", "clover", 3, r"needs 2\.\.4096 nodes"),
        ("dynamic:30,4", "clover", 3, r"dynamic:30 cannot be filled by 3 depths of 4 candidates"),
        (DynamicTree("eagle2", 9, 4, 4), "clover", 3, r"depth 4 needs more than the 3 draft heads"),
        ("chain:5", "medusa", 4, r"depth 5, more than the 4 heads"),
        ("full:2x3x1", "medusa", 4, r"write chain:D, full:WxD or widths"),
        ("chain:a", "medusa", 4, r"expected integers after 'chain:'"),
        ("[[0], [1]", "medusa", 4, r"tree spec is not valid JSON"),
        ("nope.json", "medusa", 4, r"cannot read tree file nope\.json"),
        ("mc_sim_7b_64", "medusa", 4, r"unknown tree spec 'mc_sim_7b_64'"),
        (3, "medusa", 4, r"must be a string, a list of paths or None, got int"),
        (SMALL, "clover", 2, r"more than the 2 heads"),
        (chain(4), "clover", 3, r"more than the 3 heads"),
    ],
)
def test_resolve_tree_errors(spec, method, heads, message):
    with pytest.raises(CloverError, match=message):
        resolve_tree(spec, method, heads)
