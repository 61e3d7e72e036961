"""Tree topology for speculative decoding: static trees as host-side NumPy constants built once, and
the settings of a dynamic tree (chosen per step under a fixed node budget; drafted in drafting.py).

A tree is written as Medusa and EAGLE write it: a list of paths, each path the sequence of child ranks
from the root (rank r = the r-th best candidate of the parent's draft distribution), e.g.
`[[0], [1], [0, 0]]`. Node 0 is the root (the last accepted token, depth 0); nodes 1..N-1 are the paths
sorted by (depth, then lexicographic), so every parent precedes its children and the nodes of one depth
are a contiguous range. Letters: N nodes, D max depth, P leaves, C max children of one node.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import numbers
import os
from typing import NamedTuple

import jax
import numpy as np

from clover_jax import methods
from clover_jax.errors import CloverError
from clover_jax.files import write_text

# The ancestor mask is N x N and the verifier runs all N nodes in one forward: past this it is no tree
# anyone would verify in one step, and `full:10x5` would silently allocate gigabytes.
MAX_NODES = 4096

# Medusa's `mc_sim_7b_63` (FasterDecoding/Medusa, medusa/model/medusa_choices.py): 63 paths, depth 4.
MEDUSA_MC_SIM_7B_63 = (
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
    [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
    [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
    [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1],
    [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
)  # fmt: skip

# EAGLE's `mc_sim_7b_63` (SafeAILab/EAGLE, eagle/model/choices.py), the static tree of the Clover-2
# code (XiaoBin1992/clover): 25 paths + root = 26 nodes, depth 5.
EAGLE_MC_SIM_7B_63 = (
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
    [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
    [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
)  # fmt: skip

NAMED_TREES = {"medusa_mc_sim_7b_63": MEDUSA_MC_SIM_7B_63, "eagle_mc_sim_7b_63": EAGLE_MC_SIM_7B_63}


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _show(path) -> str:
    return "[" + ", ".join(str(r) for r in path) + "]"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Tree:
    """The constants a drafter and a verifier need; hashable by `paths`, so a static jit argument."""

    paths: tuple[tuple[int, ...], ...]  # N-1 paths in canonical order; node i >= 1 is paths[i - 1]
    parents: np.ndarray  # [N] int32, parent node of each node; the root's is -1
    depth: np.ndarray  # [N] int32, 0 for the root
    rank: np.ndarray  # [N] int32, child rank within the parent (top-k index); 0 for the root
    ancestor_mask: np.ndarray  # [N, N] bool, [i, j] iff j is i or an ancestor of i (root included)
    retrieve: np.ndarray  # [P, D+1] int32, root-to-leaf node indices per leaf (node order), -1 padded
    depth_nodes: tuple[np.ndarray, ...]  # D arrays of int32 node indices, for depth 1..D (ascending)
    max_rank: tuple[int, ...]  # [D] top-k each depth needs: 1 + the largest rank at depth 1..D
    num_children: np.ndarray  # [N] int32
    children: np.ndarray  # [N, C] int32, each node's children ordered by rank, -1 padded

    @property
    def num_nodes(self) -> int:
        """N, root included: the number of tokens the verifier runs per step."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        """D: the most draft tokens one step can accept (the heads it needs)."""
        return len(self.depth_nodes)

    @property
    def draft_slots(self) -> int:
        """S: the draft slots a drafter's own cache needs past the prefix (one per node)."""
        return self.num_nodes

    @property
    def num_leaves(self) -> int:
        """P: the number of root-to-leaf candidate paths."""
        return self.retrieve.shape[0]

    def level(self, d: int) -> slice:
        """The contiguous node range of depth d (0 = the root .. D), as a static slice."""
        if not 0 <= d <= self.max_depth:
            raise ValueError(f"depth {d} outside 0..{self.max_depth}")
        if d == 0:
            return slice(0, 1)
        nodes = self.depth_nodes[d - 1]
        return slice(int(nodes[0]), int(nodes[-1]) + 1)

    def truncated(self, max_depth: int) -> Tree:
        """The same tree without the nodes deeper than max_depth."""
        return Tree.from_paths([p for p in self.paths if len(p) <= max_depth])

    def __eq__(self, other) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Tree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, leaves={self.num_leaves})"

    @classmethod
    def from_paths(cls, paths, max_depth: int | None = None) -> Tree:
        """Validate Medusa-style paths (any order) and derive every constant; max_depth = heads."""
        canon = _validate(paths, max_depth)
        n = len(canon) + 1
        index = {(): 0, **{p: i + 1 for i, p in enumerate(canon)}}
        parents = np.array([-1] + [index[p[:-1]] for p in canon], np.int32)
        depth = np.array([0] + [len(p) for p in canon], np.int32)
        rank = np.array([0] + [p[-1] for p in canon], np.int32)
        d_max = int(depth.max())
        mask = np.zeros((n, n), bool)
        mask[0, 0] = True
        for i in range(1, n):  # parents precede children, so each row extends a finished one
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        num_children = np.bincount(parents[1:], minlength=n).astype(np.int32)
        children = np.full((n, int(num_children.max())), -1, np.int32)
        for i in range(1, n):  # canonical order visits siblings by increasing rank
            children[parents[i], rank[i]] = i
        leaves = np.flatnonzero(num_children == 0)
        retrieve = np.full((len(leaves), d_max + 1), -1, np.int32)
        for row, leaf in enumerate(leaves):
            chain = np.flatnonzero(mask[leaf])  # ancestors have smaller indices and depths
            retrieve[row, : len(chain)] = chain
        depth_nodes = tuple(_frozen(np.flatnonzero(depth == d).astype(np.int32))
                            for d in range(1, d_max + 1))  # fmt: skip
        max_rank = tuple(int(rank[nodes].max()) + 1 for nodes in depth_nodes)
        return cls(canon, _frozen(parents), _frozen(depth), _frozen(rank), _frozen(mask), _frozen(retrieve),
                   depth_nodes, max_rank, _frozen(num_children), _frozen(children))

    @classmethod
    def from_file(cls, path: str, max_depth: int | None = None) -> Tree:
        """Read a JSON file holding a list of paths, or `{"paths": [...]}`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise CloverError(f"cannot read tree file {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CloverError(f"tree file {path} is not valid JSON: {e}") from None
        if isinstance(data, dict):
            if "paths" not in data:
                raise CloverError(f"tree file {path} holds an object without a 'paths' key")
            data = data["paths"]
        return cls.from_paths(data, max_depth)

    def to_file(self, path, **about) -> None:
        """Write `{"paths": [...], **about}` (what `from_file` reads; `about` says where it came from),
        whole or not at all."""
        write_text(path, json.dumps({"paths": [list(p) for p in self.paths], **about}) + "\n")


def _validate(paths, max_depth: int | None) -> tuple[tuple[int, ...], ...]:
    """Check the paths and return them as tuples in canonical (depth, lexicographic) order."""
    if not isinstance(paths, (list, tuple)):
        raise CloverError(f"a tree must be a list of paths such as [[0], [1], [0, 0]], "
                          f"got {type(paths).__name__}")
    if not paths:
        raise CloverError("the tree is empty: give at least one path, such as [[0]]")
    if len(paths) >= MAX_NODES:
        raise CloverError(f"the tree has {len(paths) + 1} nodes, more than the {MAX_NODES} supported")
    seen = set()
    for p in paths:
        if not isinstance(p, (list, tuple)):
            raise CloverError(f"tree path {p!r} is not a list of child ranks")
        if not p:
            raise CloverError("tree path [] is empty: the root is implicit, paths start at depth 1")
        for r in p:
            if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0:
                raise CloverError(f"tree path {list(p)!r} has rank {r!r}: ranks are integers >= 0")
        t = tuple(int(r) for r in p)
        if t in seen:
            raise CloverError(f"tree path {_show(t)} appears twice")
        seen.add(t)
    canon = tuple(sorted(seen, key=lambda t: (len(t), t)))
    for t in canon:
        if len(t) > 1 and t[:-1] not in seen:
            raise CloverError(f"tree path {_show(t)} has no parent: add the path {_show(t[:-1])}")
        if max_depth is not None and len(t) > max_depth:
            raise CloverError(f"tree path {_show(t)} has depth {len(t)}, more than the {max_depth} heads")
    ranks: dict[tuple[int, ...], list[int]] = {}
    for t in canon:
        ranks.setdefault(t[:-1], []).append(t[-1])
    for parent, rs in ranks.items():
        missing = sorted(set(range(max(rs) + 1)) - set(rs))
        if missing:
            who = "the root" if not parent else f"node {_show(parent)}"
            raise CloverError(f"{who} has children of ranks {_show(sorted(rs))} but not rank {missing[0]}: "
                              "child ranks must be 0, 1, 2, ... with none skipped")  # fmt: skip
    return canon


def chain(depth: int) -> Tree:
    """One path of rank-0 nodes: greedy drafting, depth + 1 nodes."""
    return from_widths([1] * _positive(depth, "chain depth"))


def full(width: int, depth: int) -> Tree:
    """Every node above depth `depth` has `width` children."""
    return from_widths([_positive(width, "tree width")] * _positive(depth, "tree depth"))


def from_widths(widths) -> Tree:
    """Each node at depth d-1 gets widths[d-1] children (ranks 0..w-1): a full tree of varying width."""
    if not isinstance(widths, (list, tuple)) or not widths:
        raise CloverError(f"tree widths must be a non-empty list of positive integers, got {widths!r}")
    widths = [_positive(w, "tree width") for w in widths]
    n = 1 + sum(math.prod(widths[:d]) for d in range(1, len(widths) + 1))
    if n > MAX_NODES:
        raise CloverError(f"tree widths {widths} give {n} nodes, more than the {MAX_NODES} supported")
    paths = [p for d in range(1, len(widths) + 1) for p in itertools.product(*map(range, widths[:d]))]
    return Tree.from_paths(paths)


def fit(counts: dict, num_nodes: int, max_depth: int, within: Tree | None = None) -> Tree:
    """The static tree of `num_nodes` nodes (root included), at most `max_depth` deep, whose nodes draft
    the data's tokens most often, by `counts` {rank path: how often that path drafted the data's tokens,
    over the positions a step could start at} (`train.losses.path_counts`, from heads' held-out drafts).

    A step accepts one token per depth whose node drafted the data's token, and at most one node of a
    depth can, so its tokens per step are 1 + the sum of its nodes' hit rates: the best tree holds the
    most often counted paths. They are taken greedily, each once its parent and its next better sibling
    are in (child ranks 0, 1, 2, ... with none skipped), which keeps the set a tree. This is how
    Medusa fits its sparse trees to its heads' accuracies, here with joint counts in place of a product
    of per-head accuracies: a regressive head's hits at depth d depend on those above it. `within`:
    take only its paths (counts from decoding on it say nothing of the others)."""
    nodes = _positive(num_nodes, "num_nodes")
    depth = _positive(max_depth, "max_depth")
    if nodes < 2:
        raise CloverError(f"a fitted tree needs at least 2 nodes (root included), got {nodes}")

    def entry(path):  # most counted first; ties to the shallower, then better-ranked path
        return (-counts.get(path, 0), len(path), path)

    allowed = None if within is None else set(within.paths)
    frontier, chosen = [], []

    def offer(path):
        if len(path) <= depth and (allowed is None or path in allowed):
            heapq.heappush(frontier, entry(path))

    offer((0,))
    while frontier and len(chosen) < nodes - 1:
        _, _, path = heapq.heappop(frontier)
        chosen.append(path)
        offer(path[:-1] + (path[-1] + 1,))
        offer(path + (0,))
    return Tree.from_paths(chosen, depth)


def fit_to_hits(tree: Tree, hits, num_nodes: int) -> Tree:
    """The `num_nodes`-node tree (as `fit` picks it) that decoding on `tree` says accepts the most:
    hits [N], the steps whose accepted path held each of its nodes (`GenerationOutput.node_hits` summed).

    Any subtree whose nodes' children are rank prefixes of `tree`'s accepts, on the same step, the
    longest part of `tree`'s accepted path that it holds: children are tested in rank order, and
    whether child r is kept depends only on children 0..r (greedy: the base model's token; sampling:
    the same draws and tests, children drawn in order without replacement). So a node's hits count
    the steps it would accept in any such subtree, the counts `fit` wants, here from real decoding,
    sampled or greedy, on the prompts that matter, rather than replayed from greedy text."""
    if num_nodes > tree.num_nodes:
        raise CloverError(f"cannot fit {num_nodes} nodes from the hits of a {tree.num_nodes}-node tree: fit fewer "
                          "nodes, or decode on a larger tree")
    counts = dict(zip(tree.paths, (int(h) for h in np.asarray(hits)[1:])))
    return fit(counts, num_nodes, tree.max_depth, within=tree)


def _positive(x, what: str) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < 1:
        raise CloverError(f"{what} must be a positive integer, got {x!r}")
    return int(x)


# A dynamic tree's selection rule: Clover's sampler, or EAGLE-2's expand-then-rerank.
DYNAMIC_KINDS = ("dynamic", "eagle2")


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A tree chosen afresh each step, per sequence, from the heads' own probabilities, under a fixed
    budget of `num_nodes` slots (root included) so every step keeps one static shape.

    Drafting expands a beam level by level: at depth d the `beam` best nodes of depth d-1 (by joint
    path probability, the product of the draft probabilities along the path) each propose their
    `beam` most likely children, and the best `beam` of those form the next level. Then the budget is
    filled from these candidates:
    - `kind="dynamic"` (Clover's sampler): candidates outside a head's top-p nucleus (`top_p`) or below
      `min_ratio` of that head's top-1 probability are dropped, and depths take the budget in order,
      each keeping its most probable candidates: deeper heads use what shallower ones left;
    - `kind="eagle2"` (EAGLE-2): no filter; the global top num_nodes-1 candidates by joint probability.
    Either way a node's parent ranks ahead of it, so the chosen set is a tree. Slots the rule leaves
    empty are masked out of verification and never accepted."""

    kind: str  # "dynamic" or "eagle2"
    num_nodes: int  # N: slots per step, the root included (what the verifier runs, like Tree.num_nodes)
    max_depth: int  # D: heads used
    beam: int  # W: nodes kept per depth, and children proposed per node
    top_p: float = 0.8
    min_ratio: float = 0.25

    def __post_init__(self):
        if self.kind not in DYNAMIC_KINDS:
            raise CloverError(f"dynamic tree kind {self.kind!r}: use one of {', '.join(DYNAMIC_KINDS)}")
        if self.num_nodes < 2 or self.num_nodes > MAX_NODES:
            raise CloverError(f"a dynamic tree needs 2..{MAX_NODES} nodes (root included), got {self.num_nodes}")
        if self.max_depth < 1 or self.beam < 1:
            raise CloverError(f"a dynamic tree needs depth >= 1 and beam >= 1, got {self.max_depth} and {self.beam}")
        if self.num_nodes - 1 > self.max_depth * self.beam:
            raise CloverError(f"{self.kind}:{self.num_nodes} cannot be filled by {self.max_depth} depths of "
                              f"{self.beam} candidates: raise the beam (write {self.kind}:{self.num_nodes},W) "
                              "or lower the budget")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_ratio <= 1:
            raise CloverError(f"dynamic tree filters top_p={self.top_p}, min_ratio={self.min_ratio} must lie in (0, 1]")

    @property
    def candidates(self) -> int:
        """Candidate nodes drafted per step (D x W), of which num_nodes - 1 are verified."""
        return self.max_depth * self.beam

    @property
    def draft_slots(self) -> int:
        """S: the draft slots a drafter's own cache needs past the prefix: the root and every candidate."""
        return 1 + self.candidates

    def __str__(self) -> str:
        return f"{self.kind}:{self.num_nodes},{self.beam}"

    @classmethod
    def parse(cls, kind: str, arg: str, depth: int) -> DynamicTree:
        """`dynamic:N` or `dynamic:N,W` (likewise eagle2): N slots, beam W (default: 8, fewer when N - 1 is
        smaller, more when D x 8 candidates could not fill N - 1 slots), depth = the heads available."""
        try:
            nums = [int(x) for x in arg.split(",")] if arg else []
        except ValueError:
            nums = []
        if len(nums) not in (1, 2):
            raise CloverError(f"tree spec {kind}:{arg}: write {kind}:N (N tree slots, root included) or {kind}:N,W "
                              "(and W the beam width)")
        n = nums[0]
        beam = nums[1] if len(nums) == 2 else max(min(8, n - 1), -(-(n - 1) // depth))
        return cls(kind, n, depth, beam)


def resolve_tree(spec, method: str, num_heads: int, chain_tau=None, sampling: bool = False,
                 fitted_tree: Tree | None = None) -> Tree:
    """The tree a user asked for, checked against the heads it will be drafted with.

    spec: None or "default" (`fitted_tree`, the tree fitted to these heads that their directory ships,
    else the method's paper tree), "fitted" (`fitted_tree`, an error without one), "paper" (the method's
    paper tree), "auto" (the default tree on an
    accelerator, on a CPU the chain `chain_tau` says is fastest, `sampling` or not: see `auto_tree`), a
    name from NAMED_TREES or "mc_sim_7b_63" (both named trees are cut to num_heads), "chain:D",
    "full:WxD", "widths:W1,W2,...", a JSON list of paths as a string, a JSON file path, a list of paths,
    a Tree, or a dynamic tree "dynamic:N[,W]" / "eagle2:N[,W]" (a DynamicTree of depth num_heads).
    """
    paper = methods.get(method).tree  # what `mc_sim_7b_63` means: the tree the method's own code uses
    heads = _positive(num_heads, "num_heads")
    if isinstance(spec, Tree):
        return Tree.from_paths(spec.paths, heads)
    if isinstance(spec, DynamicTree):
        if spec.max_depth > heads:
            raise CloverError(f"dynamic tree of depth {spec.max_depth} needs more than the {heads} draft heads")
        return spec
    if spec is None or (isinstance(spec, str) and spec.strip() == "default"):
        return _named(paper, heads) if fitted_tree is None else Tree.from_paths(fitted_tree.paths, heads)
    if isinstance(spec, (list, tuple)):
        return Tree.from_paths(spec, heads)
    if not isinstance(spec, str):
        raise CloverError(f"a tree spec must be a string, a list of paths or None, got {type(spec).__name__}")
    s = spec.strip()
    kind, _, arg = s.partition(":")
    if kind in DYNAMIC_KINDS:
        return DynamicTree.parse(kind, arg, heads)
    if s in ("paper", "mc_sim_7b_63"):
        return _named(paper, heads)
    if s == "fitted":
        if fitted_tree is None:
            raise CloverError("tree fitted: these heads ship no fitted tree (tree.json); fit one with python -m "
                              "train.evaluate --fit-tree N --record, or draft the paper tree (--tree paper)")
        return Tree.from_paths(fitted_tree.paths, heads)
    if s == "auto":
        picked = auto_tree(heads, chain_tau=chain_tau, sampling=sampling)
        if picked == PLAIN:
            raise CloverError(f"tree auto: with these heads no chain is modelled to beat plain decoding on this "
                              f"{jax.default_backend()} (held-out tau {', '.join(f'{t:.2f}' for t in chain_tau)}); "
                              "decode without drafting, or name a tree such as chain:1")
        return resolve_tree(picked, method, heads, fitted_tree=fitted_tree)
    if s in NAMED_TREES:
        return _named(s, heads)
    if kind in ("chain", "full", "widths") and arg:
        try:
            nums = [int(x) for x in arg.replace("x", ",").split(",")]
        except ValueError:
            raise CloverError(f"tree spec {spec!r}: expected integers after '{kind}:'") from None
        if kind == "chain" and len(nums) == 1:
            tree = chain(nums[0])
        elif kind == "full" and len(nums) == 2 and "x" in arg:
            tree = full(*nums)
        elif kind == "widths" and "x" not in arg:
            tree = from_widths(nums)
        else:
            raise CloverError(f"tree spec {spec!r}: write chain:D, full:WxD or widths:W1,W2,...")
        return Tree.from_paths(tree.paths, heads)
    if s.startswith(("[", "{")):
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise CloverError(f"tree spec is not valid JSON: {e}") from None
        return Tree.from_paths(data.get("paths", data) if isinstance(data, dict) else data, heads)
    if os.path.isfile(s) or s.endswith(".json"):
        return Tree.from_file(s, heads)
    raise CloverError(f"unknown tree spec {spec!r}: use default, fitted, paper, auto, {', '.join(NAMED_TREES)}, chain:D, "
                      "full:WxD, widths:W1,W2,..., dynamic:N, eagle2:N, a JSON list of paths or a .json file")


class ChainCost(NamedTuple):
    """What a chain:D step costs on a CPU, in plain steps: base + per_draft * D."""

    base: float
    per_draft: float

    def at(self, depth: int) -> float:
        return round(self.base + self.per_draft * depth, 4)


# The fitted cost model, where no cost was timed on the machine itself (`step_cost.chain_cost`): fitted to
# SmolLM2-135M's step times on a 2-core CPU (docs/benchmarks.md: chain:1 1.25-1.35, chain:2 1.41-1.52,
# chain:5 1.85, chain:7 2.05 plain steps): verifying a second row costs a quarter of a plain step there,
# each further draft and row about a seventh. Another 2-core CPU took 1.60-1.69 for chain:1.
CPU_CHAIN_COST = ChainCost(1.15, 0.14)
# What sampling adds to a speculative step beyond a plain sampling step's own draw, in the fitted model:
# a draw at each head over the draft vocabulary and the acceptance test (docs/benchmarks.md: a chain:1
# step took 1.36-1.43 plain steps at T=1 against 1.27-1.28 greedy on the same prompt and machine).
CPU_SAMPLING_COST = 0.10
# What `auto_tree` answers where no chain is modelled to beat plain decoding: decode without drafting.
PLAIN = "plain"


def cpu_chain_cost(depth: int, sampling: bool = False, cost: ChainCost | None = None) -> float:
    """A chain:`depth` step's cost on a CPU, in plain steps: by `cost`, timed on this machine for greedy
    or sampling steps as the run is, or else by the fitted model (CPU_CHAIN_COST, CPU_SAMPLING_COST)."""
    if cost is not None:
        return cost.at(depth)
    return round(CPU_CHAIN_COST.at(depth) + (CPU_SAMPLING_COST if sampling else 0.0), 4)


def auto_tree(num_heads: int, backend: str | None = None, chain_tau=None, sampling: bool = False,
              cost: ChainCost | None = None) -> str:
    """The tree spec `auto` stands for on `backend` (default: JAX's). On an accelerator verifying a
    26-64-node tree costs about one plain step (memory-bound), so the default trees pay. On a CPU every
    verified token costs compute (XLA:CPU runs a matmul of 2-16 rows at 2-4x a one-row one), so only a
    chain pays there, and only as deep as its drafts are accepted: with `chain_tau` (the held-out tokens
    a step of chains through the first 1, 2, ... heads reach, which train.train records as
    `val_chain_tau_by_depth`), the depth with the most tokens per unit of `cpu_chain_cost` (`cost`, timed
    here, or the fitted model, dearer when `sampling`), or PLAIN where even that depth is modelled to
    write fewer tokens than plain decoding in the same time; without `chain_tau`, a chain through every head."""
    if (backend or jax.default_backend()) != "cpu":
        return "default"
    taus = list(chain_tau or [])[:num_heads]
    if not taus:
        return f"chain:{num_heads}"
    speed = [tau / cpu_chain_cost(k + 1, sampling, cost) for k, tau in enumerate(taus)]
    best = max(range(len(speed)), key=speed.__getitem__)
    return f"chain:{best + 1}" if speed[best] > 1 else PLAIN


def auto_step_cost(spec: str, backend: str | None = None, sampling: bool = False,
                   cost: ChainCost | None = None) -> float | None:
    """What a step of `spec`, the tree `auto_tree` picked, costs in plain steps on `backend`: the
    speculative loop paces its drafting by it (`speculative.speculate_now`: plain steps while the drafts
    accepted do not pay for it). On a CPU a chain:D step costs `cpu_chain_cost`; on an accelerator the
    paper tree costs about one plain step, so None: draft at every step."""
    kind, _, depth = spec.partition(":")
    if (backend or jax.default_backend()) != "cpu" or kind != "chain":
        return None
    return cpu_chain_cost(int(depth), sampling, cost)


def step_cost_for(value, tree_spec, auto_spec: str, backend: str | None = None,
                  sampling: bool = False, cost: ChainCost | None = None) -> float | None:
    """The step cost a `--step-cost` value means for a run of tree `tree_spec`: "auto" paces the tree
    `auto` picked (`auto_spec`) by `auto_step_cost` (`cost`: timed here) and leaves any other tree
    unpaced; "none" (or None) never paces; a number is the cost, in plain steps."""
    if value is None or value == "none":
        return None
    if value == "auto":
        return auto_step_cost(auto_spec, backend, sampling, cost) if tree_spec == "auto" else None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not number > 0:
        raise CloverError(f"--step-cost {value!r}: write auto, none, or a speculative step's cost in plain steps (> 0)")
    return number


def _named(name: str, heads: int) -> Tree:
    return Tree.from_paths(NAMED_TREES[name]).truncated(heads)


# The tree each method drafts by default, cut to its head count: medusa 64 nodes (depth 4), clover 62
# nodes (depth 3), clover2 26 nodes (depth 5).
DEFAULT_TREES = {m: _named(methods.get(m).tree, methods.get(m).depth) for m in methods.HEADS}
