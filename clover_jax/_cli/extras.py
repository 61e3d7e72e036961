"""What the tools need beyond the library's core install: pyproject.toml's extras, checked when a
tool package (`infer`, `train`) is imported, so a missing package is one line that names the extra to
install, not an ImportError traceback from wherever it is first used.
"""

from __future__ import annotations

import importlib.util
import sys

# pyproject.toml's [project.optional-dependencies], as the names their packages are imported by; train
# includes tools, as there.
TOOLS = ("tqdm", "matplotlib", "gguf")
EXTRAS = {"tools": TOOLS, "train": TOOLS + ("orbax.checkpoint", "tokenizers")}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def missing(extra: str) -> list[str]:
    """The extra's packages (import names) that this Python cannot import."""
    return [name for name in EXTRAS[extra] if not _importable(name)]


def require(extra: str, package: str) -> None:
    """Exit with one `error:` line and status 2 (a user error, as `run.run_main` exits) when any of the
    extra's packages is missing; `package` is the tool package asking, for the message."""
    gone = missing(extra)
    if gone:
        print(f"error: the {package} tools need clover-jax's [{extra}] extra (missing: {', '.join(gone)}): "
              f'pip install "clover-jax[{extra}]" (in a checkout: pip install -e ".[{extra}]")', file=sys.stderr)
        raise SystemExit(2)
