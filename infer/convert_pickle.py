"""Convert a drafter published only as a PyTorch pickle into safetensors, once, with PyTorch's
weights-only loader.

    python -m infer.convert_pickle yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
    python -m infer.convert_pickle path/to/medusa-heads --file medusa_lm_head.pt

Nothing in clover-jax unpickles by default: unpickling a file can run whatever code it names. This is
the one explicit step that reads a pickle, and it reads it with `torch.load(path, map_location="cpu",
weights_only=True)`, whose unpickler builds tensors and plain containers only and refuses any other
object, so no code from the file runs. The tensors (nested dicts flattened to dotted names) are written
as safetensors into the cache (`formats.weights.converted_path`, keyed by the pickle's sha256), where the
drafter loaders read them whenever that folder is given to --heads.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io import sources
from clover_jax.io.files import atomic_path, check_free_space, space_errors
from clover_jax.io.formats.weights import PICKLE_SUFFIXES, converted_path
from clover_jax.io.hf import save_safetensors

# The pickles the drafter formats read (EAGLE's and the EAGLE-3 authors' model, Medusa-1's heads): what
# is converted when --file names none. Others (training_args.bin, optimizer states) are left alone.
KNOWN = ("pytorch_model.bin", "medusa_lm_head.pt")
WRAPPERS = ("state_dict", "model", "module")  # a checkpoint that is {"state_dict": {...}} holds its weights inside

EPILOG = """\
What it trusts: PyTorch's weights-only unpickler (torch.load(..., weights_only=True)), which builds only
tensors, storages and plain containers (dict, list, tuple, OrderedDict) of numbers and strings, and
refuses a pickle naming any other class or function, so no code from the file runs. A refused file is
not converted. PyTorch must be installed for this step (pip install torch; the CPU build is enough): it
is not a dependency of clover-jax, which never unpickles otherwise.

examples:
  python -m infer.convert_pickle yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
  python -m infer.convert_pickle FasterDecoding/medusa-vicuna-7b-v1.3
  python -m infer.convert_pickle path/to/heads --file medusa_lm_head.pt
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer.convert_pickle",
        description="Convert a drafter's PyTorch pickle (pytorch_model.bin, medusa_lm_head.pt) into safetensors "
                    "in the cache, once, with PyTorch's weights-only loader; --heads then loads the folder or Hub id.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="FOLDER_OR_HUB_ID",
                   help="a local drafter folder, or a Hugging Face Hub id (org/name) whose config.json and pickle "
                        "are downloaded first")
    p.add_argument("--file", metavar="NAME",
                   help=f"the pickle to convert, a file name in the folder (default: those of {', '.join(KNOWN)} "
                        "that are there)")
    return p


def _torch():
    try:
        import torch
    except ImportError:
        raise CloverError("converting a pickle needs PyTorch, which clover-jax does not install: pip install torch "
                          "(the CPU build is enough)") from None
    return torch


def to_numpy(tensor) -> np.ndarray:
    """A CPU tensor as a NumPy array of the same dtype and values (bfloat16 through ml_dtypes)."""
    torch = _torch()
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def flatten(state, where: Path) -> dict[str, np.ndarray]:
    """The tensors of a loaded state (nested dicts, lists, tuples) by dotted name; a lone wrapper entry
    (`WRAPPERS`) is looked inside; numbers and strings beside the tensors (an epoch, a version) are left
    out. One line when it holds no tensor, or is not a dict."""
    torch = _torch()
    if not isinstance(state, dict):
        raise CloverError(f"{where}: holds a {type(state).__name__}, not a dict of named tensors; not converted")
    while len(state) == 1 and next(iter(state)) in WRAPPERS and isinstance(next(iter(state.values())), dict):
        state = next(iter(state.values()))
    tensors: dict[str, np.ndarray] = {}

    def walk(value, name: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors[name] = to_numpy(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{name}.{key}" if name else str(key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{name}.{i}" if name else str(i))

    walk(state, "")
    if not tensors:
        raise CloverError(f"{where}: holds no tensors; not converted")
    return tensors


def _refusal(error: Exception) -> str:
    """What the weights-only unpickler refused, in a few words (its own message runs to many lines and
    suggests loading without it)."""
    text = str(error)
    if found := re.search(r"Unsupported global: GLOBAL ([\w.]+)", text):
        return f"it names {found[1]}"
    if found := re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text):
        return found[1].strip()
    return (text.strip().splitlines() or [type(error).__name__])[0]


def convert(pickle: Path) -> tuple[Path, bool]:
    """(the converted safetensors file of `pickle`, whether it was written now rather than found). The
    file appears whole or not at all."""
    target = converted_path(pickle)
    if target.is_file():
        return target, False
    torch = _torch()
    import pickle as pickle_module

    try:
        state = torch.load(pickle, map_location="cpu", weights_only=True)
    except pickle_module.UnpicklingError as e:
        raise CloverError(f"{pickle}: not a weights-only pickle ({_refusal(e)}); PyTorch's weights-only loader refuses "
                          "it, so it is not converted (no code from it ran)") from None
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, TypeError) as e:
        raise CloverError(f"{pickle}: cannot read it as a PyTorch checkpoint ({_refusal(e)}); not converted") from None
    tensors = flatten(state, pickle)
    need = sum(a.nbytes for a in tensors.values()) + (1 << 16)
    target.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(target.parent, need, note=" for the converted weights")
    with space_errors(target.parent, need, note=" for the converted weights"), atomic_path(target) as tmp:
        save_safetensors(tensors, tmp)
    return target, True


def pickles_in(folder: Path, name: str | None) -> list[Path]:
    """The pickles to convert in `folder`: `name`, else those of KNOWN that are there; one line for none."""
    if name is not None:
        path = folder / name
        if Path(name).name != name or not path.is_file():
            raise CloverError(f"--file {name}: no such file in {folder}")
        if path.suffix not in PICKLE_SUFFIXES:
            raise CloverError(f"--file {name}: not a pickle ({', '.join(PICKLE_SUFFIXES)}); only pickles need converting")
        return [path]
    found = [folder / n for n in KNOWN if (folder / n).is_file()]
    if not found:
        raise CloverError(f"{folder}: no pickle to convert ({', '.join(KNOWN)}); name one with --file")
    return found


def source_folder(spec: str, name: str | None) -> Path:
    """The local folder of `spec`: a directory as it is, a Hub id as its config.json and pickle(s)
    downloaded into the Hugging Face cache (the snapshot --heads with that id reads)."""
    if Path(spec).is_dir():
        return Path(spec)
    if not sources.is_hub_id(spec):
        raise CloverError(f"{spec}: no such folder, nor a Hugging Face Hub id (org/name)")
    return sources.hub_files(spec, ["config.json", *([name] if name else KNOWN)], "drafter")


def run(args) -> int:
    folder = source_folder(args.source, args.file)
    for pickle in pickles_in(folder, args.file):
        target, written = convert(pickle)
        state = "converted" if written else "already converted"
        print(f"{pickle.name}: {state} (weights only) into {target}")
    print(f"--heads {args.source} now reads it", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    cli.exit(main())
