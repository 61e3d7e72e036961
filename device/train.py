"""`python -m device.train`: the prepared training lease, SmolLM2's heads for every method in about 8 minutes.

(`--model gemma3`: Gemma 3 270M's, a base model, by the same plan: device/README.md, "A Gemma 3 training lease".)

    python3 -m device.stage .device-stage/part-2.tar --need train && python3 -m device.train   # on the device
    python -m device.train --dry --out /tmp/train                                               # here, on a CPU

The recipe of train/smollm2_heads.sh (models/smollm2/heads/MODEL_CARD.md, rounds 5 and 6), bounded to
one call: the held-out set (round 5's yardstick: the committed answers to ShareGPT's first 640 records)
made first, so that its compiled programs, kept in the stage's compilation cache, serve the other sets;
then, side by side, the model's own answers (models/smollm2/distill, the first `--self` records) and
ShareGPT's own replies to the records after them (`--fixed` sets of `--fixed-records` each, from the
ShareGPT slice the packer carries), every set with its hidden states and EAGLE-3's layers stored
(`--store-hidden float16 --store-features`), so no training step runs the base model; merged; then the
five trainings side by side on the one GPU (round 6: Medusa, Clover and EAGLE-1 ran 4,800 steps in 2.2-2.6
minutes five at a time, Clover-2 at 20-35 steps a second). OUT receives the heads as heads.tar.gz.part-NN
(15 MiB pieces: `cat heads.tar.gz.part-* | tar xz`), train.tar.gz (logs, metrics, run.json, the curves
table and plot) and curves.md. A training not finished by the deadline is killed and named; the others
still come back.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from device.common import Clock, bundle, out_dir, run_jobs, run_one, stage_dir, stage_env, tail

REPO = Path(__file__).resolve().parents[1]
METHODS = ("clover2", "clover", "medusa", "eagle", "eagle3")
# The block drafters' own recipe (models/smollm2/heads/MODEL_CARD.md, "DFlash"): a block of 8 (the paper's
# gamma 4), one draft layer reading the layers EAGLE-3's stored features hold (1, L/2 - 1, L - 4: SmolLM2's
# 1, 14, 26), the paper's AdamW at 6e-4. Named with --methods; not in the default five.
BLOCK_DRAFTERS = ("dflash", "dflash2")
BLOCK_RECIPE = ["--num-heads", "7", "--option", "draft_layers=1", "--option", "target_layer_ids=1,14,26",
                "--lr", "6e-4"]
# The corrections of a DFlash block (DSpark's Markov head, Domino's GRU, our Clover cell): each trains its
# correction alone on a frozen DFlash, the lease's own when it trains one (so they wait for it), else the
# one shipped for the model; the block drafters' recipe is the backbone's, so only the learning rate is theirs.
CORRECTIONS = ("dspark", "domino", "dflash_clover")
MODELS = ("smollm2", "gemma3")
GEMMA_EVAL = 320  # Gemma 3's held-out records: ShareGPT's first, answered by the model itself
PIECE = 15 * 2**20  # under the 16 MiB a returned file may be


def dry_records(path: Path, n: int) -> Path:
    """Tiny ShareGPT-style conversations from the reference model's prompts, each answered with the next
    prompt's text: fixed replies for the dry run's --mode fixed set."""
    prompts = [json.loads(line)["prompt"] for line in open(REPO / "models" / "reference" / "prompts.jsonl")][: n + 1]
    with open(path, "w") as f:
        for a, b in zip(prompts, prompts[1:]):
            f.write(json.dumps({"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b[:200]}]}) + "\n")
    return path


def backbone(args, work: Path) -> Path:
    """The frozen DFlash a correction trains on: the lease's own when --methods names dflash, else the
    drafter shipped for the model."""
    if "dflash" in args.methods.split(","):
        return work / "heads" / "dflash"
    return REPO / "models" / ("reference" if args.dry else args.model) / "heads" / "dflash"


def commands(args, work: Path) -> dict[str, list]:
    """The data, merge and training commands of the plan."""
    py = [sys.executable, "-m"]
    d = work / "data"
    if args.dry:
        base, prompts = str(REPO / "models" / "reference"), str(REPO / "models" / "reference" / "prompts.jsonl")
        md = py + ["train.make_data", "--base", base, "--chat", "--max-len", "256", "--store-hidden", "float16",
                   "--store-features", "--batch-size", "4", "--buckets", "128,256"]
        own = ["--data", prompts, "--max-new-tokens", "8"]
        evals = md + own + ["--limit", "6", "--out", str(d / "eval")]
        selfs = md + own + ["--limit", str(args.self_records), "--out", str(d / "self")]
        fixed_file = dry_records(work / "fixed.jsonl", args.fixed * args.fixed_records)
        fixed = [md + ["--data", str(fixed_file), "--mode", "fixed", "--first", str(k * args.fixed_records),
                       "--limit", str(args.fixed_records), "--out", str(d / f"fixed{k}")] for k in range(args.fixed)]
    else:  # smollm2, chat prompts with its committed answers; gemma3, a base model: ShareGPT's first user turns
        # as plain text to continue, bfloat16 hidden states (its residual stream passes float16's range), and no
        # committed answers, so its held-out set is its own answers to the first GEMMA_EVAL records, the others after
        chat = args.model == "smollm2"
        first = 0 if chat else GEMMA_EVAL
        base = args.model
        md = py + ["train.make_data", "--base", base, "--data", "sharegpt", *(["--chat"] if chat else []),
                   "--max-len", "2048", "--store-hidden", "float16" if chat else "bfloat16", "--store-features",
                   "--batch-size", "32", "--buckets", "512,1024"]
        answers = ["--answers", str(REPO / "models" / "smollm2" / "distill")] if chat else []
        own = ["--max-new-tokens", "256", *answers]
        evals = md + own + ["--limit", str(640 if chat else GEMMA_EVAL), "--out", str(d / "eval")]
        selfs = md + own + (["--first", str(first)] if first else []) + ["--limit", str(args.self_records),
                                                                         "--out", str(d / "self")]
        fixed = [md + ["--mode", "fixed", "--first", str(first + args.self_records + k * args.fixed_records),
                       "--limit", str(args.fixed_records), "--out", str(d / f"fixed{k}")] for k in range(args.fixed)]
    # With no fixed set the model's own answers are the training data as they are: nothing to merge.
    merge = py + ["train.merge_data", str(d / "self"), *[str(d / f"fixed{k}") for k in range(args.fixed)],
                  "--out", str(d / "joined")] if args.fixed else None
    training_data = d / ("joined" if args.fixed else "self")
    steps = str(args.steps)
    train = {}
    for m in args.methods.split(","):
        vocab = ["--draft-vocab", str(args.vocab)] if m == "eagle3" else ["--loss-vocab", str(args.vocab)]
        if m in BLOCK_DRAFTERS:
            vocab += BLOCK_RECIPE if not args.dry else ["--num-heads", "3"]
        if m in CORRECTIONS:
            vocab += ["--backbone", str(backbone(args, work)), "--lr", "6e-4"]
        train[m] = py + ["train.train", "--method", m, "--base", base, "--data", str(training_data),
                         "--eval-data", str(d / "eval"), "--counts-from", str(d / "self"), "--steps", steps,
                         "--batch-size", str(args.batch), "--seq-len", str(args.seq_len), "--warmup", "50",
                         "--dtype", "bfloat16", "--export-dtype", "bfloat16", "--eval-every", str(args.eval_every),
                         "--eval-batches", "4" if not args.dry else "1", "--ckpt-every", str(args.eval_every),
                         "--out", str(work / "heads" / m), "--work-dir", str(work / "runs" / m), *vocab]
    return {"eval": evals, "self": selfs, "fixed": fixed, "merge": merge, "train": train}


def pieces(folder: Path, out: Path, name: str) -> list[Path]:
    """`folder` as tar.gz cut into OUT/NAME.tar.gz.part-NN pieces under the returned files' size limit."""
    blob = out / f".{name}.tar.gz"
    with tarfile.open(blob, "w:gz") as tar:
        tar.add(folder, arcname=name)
    written = []
    with open(blob, "rb") as f:
        for k, data in enumerate(iter(lambda: f.read(PIECE), b"")):
            written.append(out / f"{name}.tar.gz.part-{k:02d}")
            written[-1].write_bytes(data)
    blob.unlink()
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m device.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="the reference model, tiny sizes, on this machine")
    p.add_argument("--model", choices=MODELS, default="smollm2",
                   help="whose heads: smollm2 (chat prompts, its committed answers) or gemma3 (Gemma 3 270M, a "
                        "base model: plain-text prompts, bfloat16 hidden states, a 32768-token loss and draft "
                        "vocabulary for its 262,144 tokens; pack it with device.pack --model gemma3 --for train) "
                        "(default: smollm2)")
    p.add_argument("--out", help="where the results go (default: $OUT)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds the whole lease may take (default: 450)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="methods to train (default: the five heads; dflash and dflash2 train on their own recipe, "
                        "a block of 8 and one draft layer, when named; dspark, domino and dflash_clover train their "
                        "correction alone on a frozen DFlash: this lease's when it trains dflash too, after it, "
                        "else the model's shipped one)")
    p.add_argument("--self", dest="self_records", type=int, default=None,
                   help="ShareGPT records answered by the model itself, the committed answers (default: 1570; dry 8)")
    p.add_argument("--fixed", type=int, default=2,
                   help="sets of ShareGPT's own replies (default: 2; dry 1); 0 trains on the model's own answers "
                        "alone, as SmolLM2's EAGLE-3 of round 2 (--self 384 --fixed 0 --steps 1000 --batch 4)")
    p.add_argument("--fixed-records", type=int, default=None, help="records per fixed set (default: 800; dry 6)")
    p.add_argument("--steps", type=int, default=None, help="training steps of each method (default: 4000; dry 4)")
    p.add_argument("--batch", type=int, default=None, help="windows a step (default: 8; dry 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a window (default: 512; dry 64)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations (default: 400; dry 2)")
    p.add_argument("--vocab", type=int, default=None,
                   help="loss / EAGLE-3 draft vocabulary (default: 8192, gemma3 32768; dry 256)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the sizes left out filled in: the dry run's, or a lease's for --model."""
    args = build_parser().parse_args(argv)
    dry = dict(self_records=8, fixed_records=6, steps=4, batch=2, seq_len=64, eval_every=2, vocab=256)
    real = dict(self_records=1570, fixed_records=800, steps=4000, batch=8, seq_len=512, eval_every=400, vocab=8192)
    if args.model == "gemma3":
        real["vocab"] = 32768
    for k, v in (dry if args.dry else real).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dry and args.fixed == 2:
        args.fixed = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget_s or (600.0 if args.dry else 450.0))
    stage = stage_dir() if not args.dry else out / ".dry-stage"
    work = stage / "train-work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    env = stage_env(stage)
    cmd = commands(args, work)
    logs = work / "logs"
    deadline = clock.budget_s - 25  # left for packing the heads
    if run_one("data-eval", cmd["eval"], env, logs / "data-eval.log", deadline - clock.elapsed(), clock) != 0:
        print(tail(logs / "data-eval.log", 5))
        return 1
    jobs = [("data-self", cmd["self"], env, logs / "data-self.log")] + \
           [(f"data-fixed{k}", c, env, logs / f"data-fixed{k}.log") for k, c in enumerate(cmd["fixed"])]
    status = run_jobs(jobs, len(jobs), deadline, clock)
    if any(v != 0 for v in status.values()):
        for name, *_ in jobs:
            print(tail(logs / f"{name}.log", 3))
        return 1
    if cmd["merge"] is not None and run_one("merge", cmd["merge"], env, logs / "merge.log",
                                            deadline - clock.elapsed(), clock) != 0:
        print(tail(logs / "merge.log", 5))
        return 1
    clock.say("data made: " + tail(logs / ("merge.log" if cmd["merge"] else "data-self.log"), 1))
    # Two waves: the corrections train on the DFlash the first wave exports, when it trains one.
    waits = "dflash" in cmd["train"]
    for wave in ([m for m in cmd["train"] if not (waits and m in CORRECTIONS)],
                 [m for m in cmd["train"] if waits and m in CORRECTIONS]):
        jobs = [(f"train-{m}", cmd["train"][m], env, logs / f"train-{m}.log") for m in wave]
        if jobs:
            run_jobs(jobs, len(jobs), deadline, clock)
    runs = [str(work / "runs" / m) for m in cmd["train"] if (work / "runs" / m / "metrics.jsonl").is_file()]
    if runs:
        subprocess.run([sys.executable, "-m", "train.curves", *runs, "--plot", str(work / "curves.png"),
                        "--out", str(work / "curves.md")], env=env, cwd=REPO)
    done = [m for m in cmd["train"] if (work / "heads" / m / "heads.json").is_file()]
    missing = [m for m in cmd["train"] if m not in done]
    note = f"exported: {', '.join(done) or 'none'}" + (f"; not finished: {', '.join(missing)}" if missing else "")
    (work / "curves.md").write_text((work / "curves.md").read_text() + f"\n\n{note}\n" if (work / "curves.md").is_file()
                                    else note + "\n")
    shutil.copyfile(work / "curves.md", out / "curves.md")
    if done:
        for piece in pieces(work / "heads", out, "heads"):
            clock.say(f"wrote {piece.name}")
    bundle_dir = work / "bundle"
    bundle_dir.mkdir()
    shutil.copytree(logs, bundle_dir / "logs")
    for m in cmd["train"]:
        for f in ("metrics.jsonl", "run.json"):
            if (work / "runs" / m / f).is_file():
                (bundle_dir / m).mkdir(exist_ok=True)
                shutil.copyfile(work / "runs" / m / f, bundle_dir / m / f)
    for f in ("curves.md", "curves.png"):
        if (work / f).is_file():
            shutil.copyfile(work / f, bundle_dir / f)
    bundle(bundle_dir, out, "train")
    clock.say(note)
    print((work / "curves.md").read_text()[-4000:])
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main())
