"""Dynamic trees: the settings of a tree chosen afresh each step, per sequence, under a fixed node
budget (drafted in `engine.drafting`).
"""

from __future__ import annotations

import dataclasses

from clover_jax.errors import CloverError
from clover_jax.trees.static import MAX_NODES

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
