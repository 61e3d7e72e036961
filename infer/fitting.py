"""`--fit-tree N`: a static tree fitted to the node hits a run's static tree recorded, written to `--tree-out`.
"""
from __future__ import annotations

import numpy as np

from clover_jax.errors import CloverError
from clover_jax import Tree
from clover_jax.trees.fit import fit_to_hits
from infer.report import Row


def check_fit_source(tree, num_nodes: int) -> None:
    """Before the run: --fit-tree needs the drafting row's tree static and at least `num_nodes` large."""
    if not isinstance(tree, Tree):
        raise CloverError("--fit-tree: a dynamic tree's nodes are other paths every step; draft a static tree "
                          "with --tree, such as a larger one fitted by train.evaluate --fit-tree")
    if tree.num_nodes < num_nodes:
        raise CloverError(f"--fit-tree {num_nodes}: the run's tree has {tree.num_nodes} nodes; fit fewer, or "
                          "draft a larger tree")


def fit_from_run(fitted_from: tuple[Row, Tree], num_nodes: int, out: str, prompts: str) -> None:
    """--fit-tree: the `num_nodes`-node tree the run's accepted paths favour, written to `out`, and what
    it would have accepted on the run's own steps beside what the run's tree did."""
    row, tree = fitted_from
    hits = np.asarray(row.node_hits)
    fitted = fit_to_hits(tree, hits, num_nodes)
    fitted.to_file(out, fitted_on=prompts, method=row.method, from_tree=row.tree, temperature=row.temperature,
                   batch_size=row.batch_size, steps=int(hits[0]))

    def on_steps(kept: Tree) -> float:  # tokens per drafting step, the bonus token included
        held = set(kept.paths)
        return 1 + sum(int(h) for p, h in zip(tree.paths, hits[1:]) if p in held) / max(int(hits[0]), 1)

    print(f"\nfitted tree ({fitted.num_nodes} nodes, depth {fitted.max_depth}) written to {out}: on this run's "
          f"{hits[0]} drafting steps it accepts {on_steps(fitted):.3f} tokens a step, the run's tree "
          f"({tree.num_nodes} nodes) {on_steps(tree):.3f}")
