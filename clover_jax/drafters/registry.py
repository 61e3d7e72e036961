"""The table of draft methods: per method its drafter class, default depth, default tree and loss.

Each method's own file registers its entry (`register(Method(...))` beside its drafter class and loss);
the package's `__init__` imports the built-in method files, in one place, so importing
`clover_jax.drafters.registry` from anywhere finds them all. This module imports no method and nothing in
the package imports it back, so adding a method is one new file (docs/adding-a-method.md); a test's
drafter registers under its own name the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from flax import nnx

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


def make_drafter(hcfg, base, seed: int = 0):
    """A freshly initialised drafter (`base.Drafter`) of hcfg's method (a `base.HeadsConfig`) for the base
    model `base` (a `model.llama.Llama`)."""
    return get(hcfg.method).drafter(hcfg, base, rngs=nnx.Rngs(seed))

