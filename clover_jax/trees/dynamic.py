"""Dynamic trees: the settings of a tree chosen afresh each step, per sequence, under a fixed node
budget (drafted in `engine.drafting`).
"""

from __future__ import annotations

import dataclasses

from clover_jax.errors import CloverError
from clover_jax.trees.static import MAX_NODES

# A dynamic tree's selection rule: Clover's sampler, or EAGLE-2's expand-then-rerank.
DYNAMIC_KINDS = ("dynamic", "eagle2")

# EAGLE-2's tree as its authors draft it (SafeAILab/EAGLE, ea_model.py's from_pretrained): 60 nodes
# verified, root included; the top 10 children per node; 7 expansions after the root's.
EAGLE2_NODES, EAGLE2_TOP_K, EAGLE2_DEPTH = 60, 10, 7


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A tree chosen afresh each step, per sequence, from the drafter's own probabilities, under a
    fixed budget of `num_nodes` slots (root included) so every step keeps one static shape.

    Drafting expands a beam of `beam` nodes level by level, `max_depth` expansions (the root's first):
    each beam node proposes its `beam` most likely children, scored by joint path log-probability
    (the sum of the draft log-probabilities along the path), and the best `beam` of all those children
    form the next beam. Children become candidates, and the budget is filled from the candidates:
    - `kind="dynamic"` (Clover's sampler): only the beam survivors of each depth are candidates; those
      outside a head's top-p nucleus (`top_p`) or below `min_ratio` of that head's top-1 probability
      are dropped, and depths take the budget in order, each keeping its most probable candidates:
      deeper heads use what shallower ones left;
    - `kind="eagle2"` (EAGLE-2, as its authors' `topK_genrate`): every child of every beam node is a
      candidate (K of the root, then K x K per depth), no filter, and the global top num_nodes - 1 by
      joint log-probability are verified, ties going to the earlier (shallower) candidate.
    Either way a node's parent ranks ahead of it, so the chosen set is a tree. Slots the rule leaves
    empty are masked out of verification and never accepted."""

    kind: str  # "dynamic" or "eagle2"
    num_nodes: int  # N: slots per step, the root included (what the verifier runs, like Tree.num_nodes)
    # The tree's depth: expansions per step, the root's included (dynamic: the heads used; eagle2: its
    # depth D, the expansions after the root's, plus one).
    max_depth: int
    beam: int  # W (dynamic) or top_k K (eagle2): nodes kept per depth, and children proposed per node
    top_p: float = 0.8
    min_ratio: float = 0.25

    def __post_init__(self):
        if self.kind not in DYNAMIC_KINDS:
            raise CloverError(f"dynamic tree kind {self.kind!r}: use one of {', '.join(DYNAMIC_KINDS)}")
        if self.num_nodes < 2 or self.num_nodes > MAX_NODES:
            raise CloverError(f"a dynamic tree needs 2..{MAX_NODES} nodes (root included), got {self.num_nodes}")
        if self.max_depth < 1 or self.beam < 1:
            what = "depth >= 0 and top-k" if self.kind == "eagle2" else "depth >= 1 and beam"
            got = self.max_depth - (self.kind == "eagle2")
            raise CloverError(f"a dynamic tree needs {what} >= 1, got {got} and {self.beam}")
        if self.num_nodes - 1 > self.candidates:
            if self.kind == "eagle2":
                raise CloverError(f"eagle2:{self.num_nodes} cannot be filled by the {self.candidates} candidates of "
                                  f"top-k {self.beam} and depth {self.max_depth - 1}: raise them (write "
                                  "eagle2:N,K,D) or lower the budget")
            raise CloverError(f"{self.kind}:{self.num_nodes} cannot be filled by {self.max_depth} depths of "
                              f"{self.beam} candidates: raise the beam (write {self.kind}:{self.num_nodes},W) "
                              "or lower the budget")
        if self.draft_slots > MAX_NODES:
            raise CloverError(f"{self} expands {self.draft_slots - 1} nodes a step, more than the {MAX_NODES - 1} "
                              "supported: lower the top-k or the depth")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_ratio <= 1:
            raise CloverError(f"dynamic tree filters top_p={self.top_p}, min_ratio={self.min_ratio} must lie in (0, 1]")

    @property
    def candidates(self) -> int:
        """Candidate nodes drafted per step, of which num_nodes - 1 are verified: the beam of each depth
        (dynamic: D x W), or every child of the beams (eagle2: K + D x K x K)."""
        if self.kind == "eagle2":
            return self.beam + (self.max_depth - 1) * self.beam ** 2
        return self.max_depth * self.beam

    @property
    def draft_slots(self) -> int:
        """S: the draft slots a drafter's own cache needs past the prefix: the root and every node it
        expands (the beams of depths 1 .. max_depth - 1; the deepest candidates are never expanded)."""
        return 1 + (self.max_depth - 1) * self.beam

    def __str__(self) -> str:
        if self.kind == "eagle2":
            return f"eagle2:{self.num_nodes},{self.beam},{self.max_depth - 1}"
        return f"{self.kind}:{self.num_nodes},{self.beam}"

    @classmethod
    def eagle2(cls, num_nodes: int = EAGLE2_NODES, top_k: int = EAGLE2_TOP_K, depth: int = EAGLE2_DEPTH) -> DynamicTree:
        """EAGLE-2's tree in its authors' terms: `num_nodes` verified (their total_token, root
        included), `top_k` children per node, `depth` expansions after the root's (tree depth + 1)."""
        return cls("eagle2", num_nodes, depth + 1, top_k)

    @classmethod
    def parse(cls, kind: str, arg: str, depth: int, deepest: int | None = None) -> DynamicTree:
        """A dynamic tree spec's tree, for a drafter of `depth` heads that drafts trees up to `deepest`
        deep (None: any depth, a draft model chaining its layer).

        `dynamic:N` or `dynamic:N,W`: N slots, beam W (default: 8, fewer when N - 1 is smaller, more
        when depth x 8 candidates could not fill N - 1 slots), as deep as the heads.
        `eagle2`, `eagle2:N`, `eagle2:N,K` or `eagle2:N,K,D`: the authors' parameters (N total tokens,
        root included; top-k K; depth D, expansions after the root's), each left out taking their
        default (60, 10, 7); a drafter limited to `deepest` gets D = deepest - 1 at most by default."""
        try:
            nums = [int(x) for x in arg.split(",")] if arg else []
        except ValueError:
            nums = None
        if kind == "eagle2":
            if nums is None or len(nums) > 3:
                raise CloverError(f"tree spec eagle2:{arg}: write eagle2, eagle2:N, eagle2:N,K or eagle2:N,K,D (N tree "
                                  "slots, root included; K the children per node; D the depth after the root's "
                                  f"expansion; defaults {EAGLE2_NODES}, {EAGLE2_TOP_K}, {EAGLE2_DEPTH})")
            top_k = nums[1] if len(nums) > 1 else EAGLE2_TOP_K
            d = nums[2] if len(nums) > 2 else EAGLE2_DEPTH if deepest is None else min(EAGLE2_DEPTH, deepest - 1)
            n = nums[0] if nums else min(EAGLE2_NODES, 1 + top_k + d * top_k ** 2)
            return cls.eagle2(n, top_k, d)
        if nums is None or len(nums) not in (1, 2):
            raise CloverError(f"tree spec {kind}:{arg}: write {kind}:N (N tree slots, root included) or {kind}:N,W "
                              "(and W the beam width)")
        n = nums[0]
        beam = nums[1] if len(nums) == 2 else max(min(8, n - 1), -(-(n - 1) // depth))
        return cls(kind, n, depth, beam)
