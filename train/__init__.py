"""The training tools (make_data, train, evaluate, ...); they need the [train] extra beyond the core install."""

from cli.extras import require

require("train", "train")
