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
import itertools
import json
import math
import numbers

import numpy as np

from clover_jax.errors import CloverError
from clover_jax.io.files import write_text

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

    @property
    def num_leaves(self) -> int:
        """P: the number of root-to-leaf candidate paths."""
        return int((self.num_children == 0).sum())

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
        depth_nodes = tuple(_frozen(np.flatnonzero(depth == d).astype(np.int32))
                            for d in range(1, d_max + 1))  # fmt: skip
        max_rank = tuple(int(rank[nodes].max()) + 1 for nodes in depth_nodes)
        return cls(canon, _frozen(parents), _frozen(depth), _frozen(rank), _frozen(mask), depth_nodes,
                   max_rank, _frozen(num_children), _frozen(children))

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


def _positive(x, what: str) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < 1:
        raise CloverError(f"{what} must be a positive integer, got {x!r}")
    return int(x)
