"""The draft methods. This file is where the built-in ones are assembled: each method's file registers
itself in `registry` when imported, so importing them here, in the order the tools list them, makes every
import of the package (`from clover_jax.drafters import registry`, ...) find the whole list."""

from clover_jax.drafters import medusa, clover, clover2, eagle, eagle3, dflash, dflash2, dspark, domino, dflash_clover  # noqa: F401,I001  (each registers itself)
from clover_jax.drafters import registry
from clover_jax.drafters.heads import Heads

BUILT_IN = registry.names()  # the built-in methods, in their import order above
# The draft heads among them (not the draft models, which chain, nor DFlash's block drafters)
HEADS = tuple(name for name in BUILT_IN if issubclass(registry.get(name).drafter, Heads))
