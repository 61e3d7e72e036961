"""Join `train.make_data` datasets into one, so heads train on several sources at once.

The use: the base model's own answers (self-distillation: in distribution, slow to make on a CPU)
with far more of ShareGPT's own replies (`--mode fixed`: only a prefill pass each). Examples keep
their order, the first dataset's first, so they keep their indices: the held-out split is a hash of an
example's index (`train.data`), so the first dataset's held-out examples stay held out, and
`train.train --eval-data FIRST` measures on exactly them.

    python -m train.merge_data --out data/both data/self-distilled data/fixed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io.files import space_errors
from train.data import HeadDataset, check_dataset_room, dataset_bytes, new_memmap, prepare_dataset_dir, write_dataset

SHARED = ("base_fingerprint", "vocab_size", "hidden_size", "hidden_dtype")  # every part must agree on these


def merge(parts: list[str | Path], out: str | Path) -> dict:
    """Write the concatenation of `parts` to `out`; returns its meta. Hidden states are kept (every part
    must store them alike, or none); inner-layer features only when every part stores the same layers."""
    if len(parts) < 2:
        raise CloverError("give at least two datasets to merge")
    sets = [HeadDataset(p) for p in parts]
    for key in SHARED:
        values = {str(d.meta.get(key)) for d in sets}
        if len(values) > 1:
            raise CloverError(f"the datasets differ in {key} ({', '.join(sorted(values))}); make them with the same "
                              "base model and --store-hidden")
    out = Path(out)
    if any(out.resolve() == Path(p).resolve() for p in parts):
        raise CloverError(f"--out {out} is one of the datasets to merge; choose a new directory")
    staging = prepare_dataset_dir(out)
    layers = {d.feature_layers for d in sets}
    keep_features = len(layers) == 1 and bool(sets[0].feature_layers)
    if len(layers) > 1:
        print("the datasets store different inner layers (or some none): the merged one stores none; EAGLE-3 "
              "training will run the base model for them", file=sys.stderr)
    tokens = np.concatenate([d.tokens for d in sets])
    mask = np.concatenate([d.loss_mask for d in sets])
    starts = np.cumsum([0] + [len(d.tokens) for d in sets])
    offsets = np.concatenate([[0]] + [d.offsets[1:] + s for d, s in zip(sets, starts)]).astype(np.int64)
    first = sets[0]
    names = (("hidden", "features") if keep_features else ("hidden",)) if first.hidden is not None else ()
    row = sum(getattr(first, name)[0].nbytes for name in names)
    need = dataset_bytes(len(tokens), len(offsets) - 1, row)
    with space_errors(Path(out).resolve().parent, need, check_dataset_room(out, need)):
        for name in names:
            arrays = [getattr(d, name) for d in sets]  # the datasets' own memory maps, as make_data writes them
            staging.mkdir(parents=True, exist_ok=True)
            joined = new_memmap(staging / f"{name}.npy", arrays[0].dtype, (len(tokens),) + arrays[0].shape[1:])
            for part, s in zip(tqdm(arrays, desc=f"merge {name}", unit="dataset", dynamic_ncols=True), starts):
                joined[s: s + len(part)] = part
            joined.flush()
            del joined
        meta = {key: first.meta[key] for key in SHARED}
        meta.update(num_examples=len(offsets) - 1, num_tokens=len(tokens), num_response_tokens=int(mask.sum()),
                    mode="merged", feature_layers=list(first.feature_layers) if keep_features else None,
                    created_by="train.merge_data", parts=[{"path": str(d.path), **d.meta} for d in sets])
        write_dataset(staging, out, tokens, offsets, mask, meta)
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.merge_data", description=__doc__.split("\n\n")[0],
                                epilog="The first dataset's examples come first and keep their indices, so its "
                                       "held-out split stays held out (train.train --eval-data FIRST).")
    p.add_argument("parts", nargs="+", metavar="DATASET", help="dataset directories written by train.make_data")
    p.add_argument("--out", required=True, metavar="DIR", help="new dataset directory (an old dataset there is replaced)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> int:
        meta = merge(args.parts, args.out)
        print(f"wrote {meta['num_examples']} examples ({meta['num_tokens']} tokens, {meta['num_response_tokens']} "
              f"in responses) to {args.out}")
        return 0

    return cli.run_main(run)


if __name__ == "__main__":
    cli.exit(main())
