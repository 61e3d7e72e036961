"""The training tools (make_data, train, evaluate, ...); they need the [train] extra beyond the core install."""

from clover_jax._cli.extras import require

require("train", "train")
