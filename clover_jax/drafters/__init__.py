"""The draft methods. This file is where the built-in ones are assembled: each method's file registers
itself in `registry` when imported, and importing them here, in their order, makes every import of the
package (`from clover_jax.drafters import registry`, ...) find the whole list."""

from clover_jax.drafters import clover, clover2, eagle, eagle3, medusa  # noqa: F401  (each registers itself)
from clover_jax.drafters import registry

# The built-in methods, in the order the tools list them; HEADS the draft heads among them.
BUILT_IN = ("medusa", "clover", "clover2", "eagle", "eagle3")
HEADS = tuple(name for name in BUILT_IN if not registry.get(name).chained)
