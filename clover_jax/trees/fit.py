"""Static trees fitted to heads: the rank paths that drafted held-out tokens most often (`fit`), or
that lay on decoding's accepted paths (`fit_to_hits`), under a node budget.
"""

from __future__ import annotations

import heapq

import numpy as np

from clover_jax.errors import CloverError
from clover_jax.trees.static import Tree, _positive


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
