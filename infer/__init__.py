"""The inference tools (generate, benchmark, ...); they need the [tools] extra beyond the core install."""

from clover_jax._cli.extras import require

require("tools", "infer")
