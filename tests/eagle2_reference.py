"""EAGLE-2's dynamic tree as its authors select it, written after their `topK_genrate`
(SafeAILab/EAGLE, eagle/model/cnets.py) in NumPy, for tests to hold the engine's `eagle2` trees against.

`eagle2_tree(log_probs, root, total_tokens, top_k, depth)`:
- `log_probs(path) -> [V]`: the drafter's log-probabilities over the children of the node whose token
  path is `path`, a tuple of ints from the root: `(root,)` for the root, `(root, t1)` for its child t1,
  and so on. Any drafter fits behind it: a table, our JAX drafters run along the path, or the authors'
  PyTorch EAGLE-3 model (`Model.forward` on the prefix plus the path, then `lm_head(norm(.))` and
  `log_softmax`, as topK_genrate scores);
- `root`: the root token (the last one committed, not yet drafted from);
- `total_tokens`: the nodes verified, root included (the authors' `total_token`; their model keeps
  `total_tokens = total_token - 1` drafted ones); `top_k`: children per expanded node; `depth`: the
  expansions after the root's (their `depth`), so the tree is at most depth + 1 deep.
It returns an `Eagle2Tree`: the nodes in the authors' order (node 0 the root, then the selected
candidates in pool order), each node's token path from the root and its parent node.

The rule, step by step as theirs: the root's top_k children (log-probabilities) form the pool and the
first beam; `depth` times, every beam node proposes its top_k children, each scored by its parent's
score plus its own log-probability; all top_k x top_k of them join the pool and the next beam is the
top_k of those; finally the global top total_tokens - 1 of the pool (top_k + depth x top_k^2
candidates) are verified, in pool order. Ties go to the lower index, as a stable sort gives (torch.topk
leaves them open), so a child never outranks its parent.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class Eagle2Tree(NamedTuple):
    """The selected tree: node 0 is the root; parents precede children."""

    tokens: list[int]  # each node's token, the root's first
    parents: list[int]  # each node's parent node (-1 for the root)
    paths: list[tuple[int, ...]]  # each node's token path from the root, root included


def _topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices) of the k largest, largest first, ties to the lower index."""
    order = np.argsort(-x, kind="stable")[:k]
    return x[order], order


def eagle2_tree(log_probs: Callable[[tuple[int, ...]], np.ndarray], root: int, total_tokens: int = 60,
                top_k: int = 10, depth: int = 7) -> Eagle2Tree:
    """The tree topK_genrate drafts from `root` (see the module docstring for the arguments)."""
    k = top_k
    scores, tokens = _topk(np.asarray(log_probs((root,)), np.float64), k)
    scores_list, tokens_list = [scores], [tokens]
    parents_list = [np.zeros(1, np.int64)]  # per group of k candidates: the parent's pool index + 1 (0: root)
    beam_index = np.arange(k)  # the beam's indices in its own pool block (topk_cs_index)
    beam_paths = [(root, int(t)) for t in tokens]
    for i in range(depth):
        bias = 1 + k * k * max(0, i - 1) + (k if i > 0 else 0)  # the beam block's start in the pool, + 1
        parents_list.append(beam_index + bias)
        children = [_topk(np.asarray(log_probs(p), np.float64), k) for p in beam_paths]
        topk_p = np.stack([c[0] for c in children])  # [k beam nodes, k children]
        topk_index = np.stack([c[1] for c in children])
        cu_scores = topk_p + scores[:, None]
        scores, beam_index = _topk(cu_scores.ravel(), k)
        beam_paths = [beam_paths[j // k] + (int(topk_index.ravel()[j]),) for j in beam_index]
        scores_list.append(cu_scores.ravel())
        tokens_list.append(topk_index.ravel())

    pool_scores, pool_tokens = np.concatenate(scores_list), np.concatenate(tokens_list)
    top = np.sort(_topk(pool_scores, total_tokens - 1)[1])
    draft_parents = np.concatenate(parents_list)[top // k]  # pool index + 1 of each one's parent
    mask_index = np.searchsorted(top, draft_parents - 1)
    is_root_child = draft_parents == 0
    # The authors leave this check commented out: it holds because a child never outranks its parent.
    assert (top[np.minimum(mask_index, len(top) - 1)][~is_root_child] == (draft_parents - 1)[~is_root_child]).all()
    parents = np.where(is_root_child, 0, mask_index + 1)
    node_tokens = [root] + [int(t) for t in pool_tokens[top]]
    node_parents = [-1] + [int(p) for p in parents]
    paths = [(root,)]
    for tok, parent in zip(node_tokens[1:], node_parents[1:]):
        paths.append(paths[parent] + (tok,))
    return Eagle2Tree(node_tokens, node_parents, paths)
