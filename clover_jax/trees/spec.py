"""The `--tree` spec language: a user's tree (a name, `chain:D`, `full:WxD`, `widths:..`, JSON paths or
file, `dynamic:N[,W]` / `eagle2[:N,K,D]`, `default`, `fitted`, `paper`) resolved against the drafter
that will draft it; and the tree each method drafts by default (on an accelerator an EAGLE method's own
dynamic tree, `registry.Method.accelerator_tree`). `auto` is no tree but a decision, which the planner
makes (`plan.factory.plan_tree`) before it hands the tree it picked here.
"""

from __future__ import annotations

import json
import os

import jax

from clover_jax.drafters import HEADS
from clover_jax.drafters import registry
from clover_jax.errors import CloverError
from clover_jax.trees.dynamic import DYNAMIC_KINDS, DynamicTree
from clover_jax.trees.static import NAMED_TREES, Tree, _positive, chain, from_widths, full


def resolve_tree(spec, method: str, num_heads: int, *, fitted_tree: Tree | None = None,
                 backend: str | None = None) -> Tree | DynamicTree:
    """The tree a user asked for, checked against the drafter (`num_heads` heads, or a draft model of
    that many chained steps, which drafts any depth: `Method.chained`) it will be drafted with.

    spec: None or "default" (on an accelerator, `backend` or else JAX's, the method's own
    `accelerator_tree` where it has one; else `fitted_tree`, the tree fitted to these heads that their
    directory ships, else the method's paper tree), "fitted" (`fitted_tree`, an error without one),
    "paper" (the method's paper tree), a name from NAMED_TREES or
    "mc_sim_7b_63" (both named trees are cut to num_heads), "chain:D", "full:WxD", "widths:W1,W2,...",
    a JSON list of paths as a string, a JSON file path, a list of paths, a Tree, or a dynamic tree
    "dynamic:N[,W]" (of depth num_heads) or "eagle2[:N[,K[,D]]]" (`DynamicTree.parse`). Not "auto":
    the planner decides what it stands for (`plan.factory.plan_tree`).
    """
    entry = registry.get(method)
    paper = entry.tree  # what `mc_sim_7b_63` means: the tree the method's own code uses
    heads = _positive(num_heads, "num_heads")
    deepest = None if entry.chained else heads  # the deepest tree a user's spec may name
    if isinstance(spec, Tree):
        return Tree.from_paths(spec.paths, deepest)
    if isinstance(spec, DynamicTree):
        if deepest is not None and spec.max_depth > deepest:
            raise CloverError(f"dynamic tree {spec} of depth {spec.max_depth} needs more than the {heads} draft heads")
        return spec
    if spec is None or (isinstance(spec, str) and spec.strip() == "default"):
        if accelerator_default(method, backend) is not None:
            return resolve_tree(accelerator_default(method, backend), method, heads, backend=backend)
        return _named(paper, heads) if fitted_tree is None else Tree.from_paths(fitted_tree.paths, heads)
    if isinstance(spec, (list, tuple)):
        return Tree.from_paths(spec, deepest)
    if not isinstance(spec, str):
        raise CloverError(f"a tree spec must be a string, a list of paths or None, got {type(spec).__name__}")
    s = spec.strip()
    kind, _, arg = s.partition(":")
    if kind in DYNAMIC_KINDS:
        return resolve_tree(DynamicTree.parse(kind, arg, heads, deepest), method, heads)
    if s in ("paper", "mc_sim_7b_63"):
        return _named(paper, heads)
    if s == "fitted":
        if fitted_tree is None:
            raise CloverError("tree fitted: these heads ship no fitted tree (tree.json); fit one with python -m "
                              "train.evaluate --fit-tree N --record, or draft the paper tree (tree=paper)",
                              arguments=("tree",))
        return Tree.from_paths(fitted_tree.paths, heads)
    if s == "auto":
        raise CloverError("tree auto is a choice a generator's planner makes for this machine, not a tree to "
                          "draw: name one here, such as default or chain:2")
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
        return Tree.from_paths(tree.paths, deepest)
    if s.startswith(("[", "{")):
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise CloverError(f"tree spec is not valid JSON: {e}") from None
        return Tree.from_paths(data.get("paths", data) if isinstance(data, dict) else data, deepest)
    if os.path.isfile(s) or s.endswith(".json"):
        return Tree.from_file(s, deepest)
    raise CloverError(f"unknown tree spec {spec!r}: use default, fitted, paper, auto, {', '.join(NAMED_TREES)}, chain:D, "
                      "full:WxD, widths:W1,W2,..., dynamic:N, eagle2[:N,K,D], a JSON list of paths or a .json file")


def accelerator_default(method: str, backend: str | None = None) -> str | None:
    """The tree spec `default` stands for with `method` on `backend` (default: JAX's), ahead of any
    fitted tree: the method's own `accelerator_tree` off a CPU; None where it is a fitted or paper tree."""
    tree = registry.get(method).accelerator_tree
    return tree if tree is not None and (backend or jax.default_backend()) != "cpu" else None


def _named(name: str, heads: int) -> Tree:
    return Tree.from_paths(NAMED_TREES[name]).truncated(heads)


# The tree each method drafts by default, cut to its head count: medusa 64 nodes (depth 4), clover 62
# nodes (depth 3), clover2 26 nodes (depth 5).
DEFAULT_TREES = {m: _named(registry.get(m).tree, registry.get(m).depth) for m in HEADS}
