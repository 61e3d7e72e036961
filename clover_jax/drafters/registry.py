"""The one list of draft methods: per method its drafter class, default depth, default tree and loss.

Every library module and tool reads this table (the heads' config validation, the default trees, the
command-line choices, the training loss), so adding a method is one new drafter file and one
`register` call; docs/architecture.md walks through it. A test drafter registers under its own name.
"""

from __future__ import annotations

import dataclasses

from clover_jax.drafters.clover import CloverHeads
from clover_jax.drafters.clover2 import Clover2Heads
from clover_jax.drafters.eagle import Eagle
from clover_jax.drafters.eagle3 import Eagle3
from clover_jax.drafters.medusa import MedusaHeads
from clover_jax.errors import CloverError


@dataclasses.dataclass(frozen=True)
class Method:
    """One draft method."""

    name: str
    drafter: type  # a `drafter.Drafter` class, built as drafter(hcfg, base, rngs=...)
    depth: int  # default number of draft heads: the deepest tree it drafts
    tree: str  # its paper's static tree, a `tree.NAMED_TREES` name, cut to the heads' depth
    loss: str  # its training loss, a key of `train.losses.LOSSES`
    aug_layers: int = 0  # Augmenting Block layers (own KV cache) the drafter builds
    # Draft steps its loss weights (None: every one). A training step unrolls only these, since the
    # rest would add forward work and no gradient; evaluation still scores every depth.
    trained_steps: int | None = None
    color: str | None = None  # its colour in the benchmark's plots (None: matplotlib's next)


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method (or replace one of the same name, for a test); returns it."""
    _REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    """The method called `name`, or one error line naming the known ones."""
    if name not in _REGISTRY:
        raise CloverError(f"unknown method {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_REGISTRY)


def color(name: str) -> str | None:
    """A method's colour in the plots: its registry entry's (None, matplotlib's cycle, for what is not a
    registered method, such as plain and hf)."""
    return _REGISTRY[name].color if name in _REGISTRY else None


# The draft heads of SPEC section 2 (HEADS).
register(Method("medusa", MedusaHeads, depth=4, tree="medusa_mc_sim_7b_63", loss="cross_entropy",
                color="tab:blue"))
register(Method("clover", CloverHeads, depth=3, tree="medusa_mc_sim_7b_63", loss="cross_entropy", aug_layers=1,
                color="tab:green"))
register(Method("clover2", Clover2Heads, depth=5, tree="eagle_mc_sim_7b_63", loss="distill", aug_layers=2,
                color="tab:red"))
HEADS = names()
# The draft models of SPEC section 8: the command-line choices, with the ones above (BUILT_IN).
register(Method("eagle", Eagle, depth=5, tree="eagle_mc_sim_7b_63", loss="eagle", trained_steps=1,
                color="tab:purple"))
register(Method("eagle3", Eagle3, depth=7, tree="eagle_mc_sim_7b_63", loss="eagle3", color="tab:orange"))
BUILT_IN = names()
