"""What the tools' plots share: each draft method's colour, the same in the benchmark's and training's
figures, so a method reads the same across them."""

from __future__ import annotations

COLORS = {"medusa": "tab:blue", "clover": "tab:green", "clover2": "tab:red", "eagle": "tab:purple",
          "eagle3": "tab:orange"}


def color(method: str) -> str | None:
    """A method's colour in the plots (None, matplotlib's next one, for a method without one: plain, hf,
    a method added later)."""
    return COLORS.get(method)
