"""What `--tree auto` and `--step-cost auto` stand for on this machine: on an accelerator the default
tree, unpaced; on a CPU the chain with the most tokens per unit of step cost (timed here, or the fitted
cost model), paced by that cost, or no drafting where no chain pays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from clover_jax.errors import CloverError


class ChainCost(NamedTuple):
    """What a chain:D step costs on a CPU, in plain steps: base + per_draft * D."""

    base: float
    per_draft: float

    def at(self, depth: int) -> float:
        return round(self.base + self.per_draft * depth, 4)


# The fitted cost model, where no cost was timed on the machine itself (`step_cost.chain_cost`): fitted to
# SmolLM2-135M's step times on a 2-core CPU (docs/history/benchmarks.md: chain:1 1.25-1.35, chain:2 1.41-1.52,
# chain:5 1.85, chain:7 2.05 plain steps): verifying a second row costs a quarter of a plain step there,
# each further draft and row about a seventh. Another 2-core CPU took 1.60-1.69 for chain:1.
CPU_CHAIN_COST = ChainCost(1.15, 0.14)


# What sampling adds to a speculative step beyond a plain sampling step's own draw, in the fitted model:
# a draw at each head over the draft vocabulary and the acceptance test (docs/history/benchmarks.md: a chain:1
# step took 1.36-1.43 plain steps at T=1 against 1.27-1.28 greedy on the same prompt and machine).
CPU_SAMPLING_COST = 0.10


def cpu_chain_cost(depth: int, sampling: bool = False, cost: ChainCost | None = None) -> float:
    """A chain:`depth` step's cost on a CPU, in plain steps: by `cost`, timed on this machine for greedy
    or sampling steps as the run is, or else by the fitted model (CPU_CHAIN_COST, CPU_SAMPLING_COST)."""
    if cost is not None:
        return cost.at(depth)
    return round(CPU_CHAIN_COST.at(depth) + (CPU_SAMPLING_COST if sampling else 0.0), 4)


def auto_tree(num_heads: int, backend: str | None = None, chain_tau=None, sampling: bool = False,
              cost: ChainCost | None = None) -> str | None:
    """The tree spec `auto` stands for on `backend` (default: JAX's), or None: decode without drafting. On an accelerator verifying a
    26-64-node tree costs about one plain step (memory-bound), so the default trees pay. On a CPU every
    verified token costs compute (XLA:CPU runs a matmul of 2-16 rows at 2-4x a one-row one), so only a
    chain pays there, and only as deep as its drafts are accepted: with `chain_tau` (the held-out tokens
    a step of chains through the first 1, 2, ... heads reach, which train.train records as
    `val_chain_tau_by_depth`), the depth with the most tokens per unit of `cpu_chain_cost` (`cost`, timed
    here, or the fitted model, dearer when `sampling`), or None where even that depth is modelled to
    write fewer tokens than plain decoding in the same time. When `sampling`, `chain_tau` is to be the
    sampled figure (`val_sampled_chain_tau_by_depth`): greedy figures overstate what sampling keeps (on
    the reference model's heads, paced chains picked by them ran at 0.74-0.94x plain at T=1). Without
    `chain_tau`: greedy, a chain through every head (drafters measured nowhere, such as published ones);
    sampling, None, since nothing says any draft is kept at that temperature."""
    if (backend or jax.default_backend()) != "cpu":
        return "default"
    taus = list(chain_tau or [])[:num_heads]
    if not taus:
        return None if sampling else f"chain:{num_heads}"
    speed = [tau / cpu_chain_cost(k + 1, sampling, cost) for k, tau in enumerate(taus)]
    best = max(range(len(speed)), key=speed.__getitem__)
    return f"chain:{best + 1}" if speed[best] > 1 else None


def auto_step_cost(spec: str, backend: str | None = None, sampling: bool = False,
                   cost: ChainCost | None = None) -> float | None:
    """What a step of `spec`, the tree `auto_tree` picked, costs in plain steps on `backend`: the
    speculative loop paces its drafting by it (`pacing.speculate_now`: plain steps while the drafts
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
        raise CloverError(f"step_cost={value!r}: write auto, none, or a speculative step's cost in plain steps (> 0)",
                          arguments=("step_cost",))
    return number
