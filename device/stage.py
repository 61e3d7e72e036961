"""`python3 -m device.stage`: on the device, unpack the parts `device.pack` made into the stage folder.

    python3 -m device.stage .device-stage/part-1.tar     # one call per part, in any order
    python3 -m device.stage --status                      # what is there, what is missing
    python3 -m device.stage .device-stage/part-3.tar --need check && python3 -m device.check

Each part's chunks go to STAGE/chunks ($CLOVER_STAGE, else /tmp/clover-stage). An item whose chunks are
all there is joined, checked against the manifest's sha256, unpacked to its place in the stage and
then set up (the gguf wheel installed into STAGE/site; the GGUF converted into STAGE/cache as
`--model NAME` converts it), and marked done; its chunks are then deleted. Rerunning is safe: done
items are skipped, and a half-unpacked item is redone. `--need check|train` exits 1, naming the parts
still to send, unless everything that lease needs is done. Runs with the standard library alone
(the conversion step calls the project's own code).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from device.common import stage_dir, stage_env

REPO = Path(__file__).resolve().parents[1]


def add_part(part: Path, stage: Path) -> dict:
    """The part's chunks into STAGE/chunks; its manifest, checked to be the stage's pack."""
    with tarfile.open(part) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        old = stage / "manifest.json"
        if old.is_file() and json.loads(old.read_text())["pack_id"] != manifest["pack_id"]:
            raise SystemExit(f"error: {part} is from another pack than the stage holds ({stage}); "
                             f"remove {stage} to start again, or send this pack's parts")
        (stage / "chunks").mkdir(parents=True, exist_ok=True)
        for member in tar.getmembers():
            name = Path(member.name)
            if name.parts[:1] != ("chunks",) or len(name.parts) != 2 or not member.isfile():
                continue
            with tar.extractfile(member) as src, open(stage / "chunks" / name.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def finish(item: dict, stage: Path, post: bool = True) -> bool:
    """Join, check, unpack and set up one item if all its chunks are there; whether it is done."""
    done = stage / "done" / item["name"]
    if done.is_file():
        return True
    chunks = [stage / "chunks" / c["file"] for c in item["chunks"]]
    if not all(c.is_file() for c in chunks):
        return False
    blob = stage / "chunks" / f"{item['name']}.joined"
    h = hashlib.sha256()
    with open(blob, "wb") as out:
        for c in chunks:
            data = c.read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != item["sha256"]:
        blob.unlink()
        raise SystemExit(f"error: {item['name']}: its chunks do not join to what was packed (sha256); "
                         "send its parts again")
    dest = stage / item["dest"]
    if item["encoding"] == "tar.gz":
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(blob) as tar:
            for member in tar.getmembers():  # only plain files under dest
                target = (dest / member.name).resolve()
                if member.isfile() and target.is_relative_to(dest.resolve()):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        opener = gzip.open if item["encoding"] == "gzip" else open
        with opener(blob, "rb") as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    blob.unlink()
    if post and item["post"]:
        set_up(item["post"], dest, stage, item["name"])
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text("ok\n")
    for c in chunks:
        c.unlink()
    return True


def set_up(post: str, dest: Path, stage: Path, name: str) -> None:
    """An item's step after unpacking: the wheel installed, or the GGUF of the named model `name`
    converted (minutes of nothing at the check's start saved: the converted model stays in the stage)."""
    if post == "pip":
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(stage / "site"), str(dest)], check=True)
    elif post == "convert":
        subprocess.run([sys.executable, "-c", "import sys; from clover_jax.io import sources; print('model:', "
                        "sources.model_path(sys.argv[1]), flush=True)", name], cwd=REPO, env=stage_env(stage),
                       check=True)
    else:
        raise SystemExit(f"error: unknown set-up step {post!r}")


def status(stage: Path, need: str | None = None) -> int:
    manifest_file = stage / "manifest.json"
    if not manifest_file.is_file():
        print(f"stage {stage}: empty (no part sent yet, or the machine went back): send part 1 first")
        return 1 if need else 0
    manifest = json.loads(manifest_file.read_text())
    done = [i["name"] for i in manifest["items"] if (stage / "done" / i["name"]).is_file()]
    missing = [i for i in manifest["items"] if i["name"] not in done and (need is None or need in i["needed_by"])]
    parts = sorted({c["part"] for i in missing for c in i["chunks"] if not (stage / "chunks" / c["file"]).is_file()})
    print(f"stage {stage} (pack {manifest['pack_id']}, {manifest['parts']} parts): done: {', '.join(done) or 'nothing'}"
          + (f"; missing: {', '.join(i['name'] for i in missing)} (send part(s) {', '.join(map(str, parts))})"
             if missing else ""), flush=True)
    return 1 if need and missing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m device.stage", description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", help="part files made by device.pack")
    p.add_argument("--status", action="store_true", help="only say what the stage holds")
    p.add_argument("--need", choices=("check", "train"), help="exit 1 unless this lease's items are all done")
    p.add_argument("--no-set-up", action="store_true", help="unpack only: no wheel install, no conversion")
    args = p.parse_args(argv)
    stage = stage_dir()
    stage.mkdir(parents=True, exist_ok=True)
    if not args.status:
        for part in args.parts:
            manifest = add_part(Path(part), stage)
            print(f"{part}: added to {stage}", flush=True)
        if args.parts:
            for item in manifest["items"]:
                finish(item, stage, post=not args.no_set_up)
    return status(stage, args.need)


if __name__ == "__main__":
    sys.exit(main())
