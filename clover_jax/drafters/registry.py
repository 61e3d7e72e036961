"""The one list of draft methods: per method its drafter class, default depth, default tree and loss.

Every library module and tool reads this table (the heads' config validation, the default trees, the
command-line choices, the training loss), so adding a method is one new drafter file (the class and its
loss) and one `register` call; docs/adding-a-method.md walks through it. A test drafter registers under
its own name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from flax import nnx

from clover_jax.drafters.base import Drafter, HeadsConfig
from clover_jax.drafters.clover import CloverHeads
from clover_jax.drafters.clover2 import Clover2Heads, distill_loss
from clover_jax.drafters.eagle import Eagle, eagle_loss
from clover_jax.drafters.eagle3 import Eagle3, eagle3_loss
from clover_jax.drafters.losses import cross_entropy
from clover_jax.drafters.medusa import MedusaHeads
from clover_jax.errors import CloverError


@dataclasses.dataclass(frozen=True)
class Method:
    """One draft method."""

    name: str
    drafter: type  # a `base.Drafter` class, built as drafter(hcfg, base, rngs=...)
    depth: int  # default depth (number of draft heads): the deepest tree it drafts
    tree: str  # its paper's static tree, a `trees.static.NAMED_TREES` name, cut to the drafter's depth
    # Its training loss, on what the drafter's `train_forward` returns; the signature is `losses.cross_entropy`'s.
    loss: Callable
    aug_layers: int = 0  # Augmenting Block layers (own KV cache) the drafter builds
    # Draft steps its loss weights (None: every one). A training step unrolls only these, since the
    # rest would add forward work and no gradient; evaluation still scores every depth.
    trained_steps: int | None = None
    color: str | None = None  # its colour in the benchmark's plots (None: matplotlib's next)
    title: str | None = None  # how prose and messages name it, e.g. "EAGLE-3" (None: its name)
    # True for a draft model, which chains one layer and so drafts trees deeper than `depth` (its
    # trained steps): EAGLE-3's authors draft 8 deep with 7. Heads stop at their own count.
    chained: bool = False
    # The `--tree` spec `default` means on an accelerator (None: the CPU's, a fitted or paper tree).
    accelerator_tree: str | None = None


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


def title(name: str) -> str:
    """How messages name a method: its registry entry's title, else the name itself."""
    return (_REGISTRY[name].title if name in _REGISTRY else None) or name


def make_drafter(hcfg: HeadsConfig, base, seed: int = 0) -> Drafter:
    """A freshly initialised drafter of hcfg's method for the base model `base` (a `model.llama.Llama`)."""
    return get(hcfg.method).drafter(hcfg, base, rngs=nnx.Rngs(seed))


def color(name: str) -> str | None:
    """A method's colour in the plots: its registry entry's (None, matplotlib's cycle, for what is not a
    registered method, such as plain and hf)."""
    return _REGISTRY[name].color if name in _REGISTRY else None


# The draft heads (HEADS), on the base model's hidden states and lm_head.
register(Method("medusa", MedusaHeads, depth=4, tree="medusa_mc_sim_7b_63", loss=cross_entropy,
                color="tab:blue", title="Medusa"))
register(Method("clover", CloverHeads, depth=3, tree="medusa_mc_sim_7b_63", loss=cross_entropy, aug_layers=1,
                color="tab:green", title="Clover"))
register(Method("clover2", Clover2Heads, depth=5, tree="eagle_mc_sim_7b_63", loss=distill_loss, aug_layers=2,
                color="tab:red", title="Clover-2"))
HEADS = names()
# The draft models: the command-line choices, with the ones above (BUILT_IN).
# On accelerators each drafts its authors' dynamic tree: EAGLE-1 with EAGLE-2's (their EAGLE-2 release's
# evaluation scripts: 60 nodes, top-k 10, depth 5), EAGLE-3 with EAGLE-3's (from_pretrained: 60, 10, 7).
register(Method("eagle", Eagle, depth=5, tree="eagle_mc_sim_7b_63", loss=eagle_loss, trained_steps=1,
                color="tab:purple", title="EAGLE-1", chained=True, accelerator_tree="eagle2:60,10,5"))
register(Method("eagle3", Eagle3, depth=7, tree="eagle_mc_sim_7b_63", loss=eagle3_loss, color="tab:orange",
                title="EAGLE-3", chained=True, accelerator_tree="eagle2:60,10,7"))
BUILT_IN = names()
