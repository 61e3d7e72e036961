"""The table of draft methods: per method its drafter class, its config class, default depth, default
tree and loss; what a drafter can do (whether it chains, its Augmenting Block, the layers it reads) is
an attribute of its drafter class.

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
    config: type  # its `base.DrafterConfig` subclass: the options it has
    depth: int  # default depth (number of draft heads): the deepest tree it drafts
    tree: str  # its paper's static tree, a `trees.static.NAMED_TREES` name, cut to the drafter's depth
    # Its training loss, on what the drafter's `train_forward` returns; the signature is `losses.cross_entropy`'s.
    loss: Callable
    # Draft steps its loss weights (None: every one). A training step unrolls only these, since the
    # rest would add forward work and no gradient; evaluation still scores every depth.
    trained_steps: int | None = None
    title: str | None = None  # how prose and messages name it, e.g. "EAGLE-3" (None: its name)
    # The `--tree` spec `default` means on an accelerator (None: the CPU's, a fitted or paper tree).
    accelerator_tree: str | None = None

    @property
    def chained(self) -> bool:
        """Whether its drafter chains one layer, and so drafts any depth (`base.Drafter.chained`)."""
        return self.drafter.chained


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


# Fields the one config class of every method wrote into heads.json before each method had its own, with
# the values that meant "not this method's option": a file written then still loads.
_UNION_DEFAULTS = {"embed_source": "lm_head", "noise": 0.01, "draft_vocab": 0, "aux_layer_ids": None,
                   "head_layers": 1, "own_lm_head": False, "draft_layer": None, "switches": ()}


def drafter_config(method: str, num_heads: int | None = None, **options):
    """The config of a `method` drafter of depth `num_heads` (None: the method's default) with its own
    `options` (its config class's fields); an option the method does not have is refused by name, but
    one at the value older heads.json files wrote for every method is dropped."""
    entry = get(method)
    fields = {f.name for f in dataclasses.fields(entry.config)} - {"method", "num_heads"}
    for name in list(options):
        if name in fields:
            continue
        value = options.pop(name)
        legacy = _UNION_DEFAULTS.get(name, KeyError)
        if value != legacy and not (isinstance(legacy, tuple) and list(value or ()) == list(legacy)):
            have = ", ".join(sorted(fields)) or "none"
            raise CloverError(f"{title(method)} drafters have no option {name} (={value!r}); theirs: {have}")
    return entry.config(method, entry.depth if num_heads is None else num_heads, **options)


def make_drafter(hcfg, base, seed: int = 0):
    """A freshly initialised drafter (`base.Drafter`) of hcfg's method (its `Method.config`) for the base
    model `base` (a `model.llama.Llama`)."""
    return get(hcfg.method).drafter(hcfg, base, rngs=nnx.Rngs(seed))

