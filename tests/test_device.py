"""The prepared GPU lease (device/): the packer's parts fit and join back byte for byte, the stage
unpacks them in any order and says what is missing, the aside move is a rename both ways, every run of
the check's plan parses with the benchmark's own flags, and the check's and the training's dry modes
run on the reference model and write what a lease returns."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from device import aside, check, pack, stage
from infer.benchmark import build_parser

REPO = Path(__file__).resolve().parents[1]


def test_pack_parts_fit_and_stage_joins_them_in_any_order(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "heads" / "m").mkdir(parents=True)
    big = bytes(range(256)) * 4000  # 1 MB that gzip cannot shrink much below a part
    rng = __import__("random").Random(0)
    noise = bytes(rng.getrandbits(8) for _ in range(300_000))
    (src / "heads" / "m" / "w.bin").write_bytes(noise)
    (src / "model.gguf").write_bytes(noise + big)
    (src / "q.jsonl").write_text('{"turns": ["hi"]}\n')
    items = [pack.Item("q", src / "q.jsonl", "cache/q.jsonl"), pack.Item("model", src / "model.gguf", "cache/m.gguf"),
             pack.Item("heads", src / "heads", "heads", needed_by=("check",))]
    limit = 200_000
    manifest = pack.pack(items, tmp_path / "parts", limit)
    parts = sorted((tmp_path / "parts").glob("part-*.tar"))
    assert len(parts) == manifest["parts"] >= 3
    assert all(p.stat().st_size <= limit for p in parts)
    monkeypatch.setenv("CLOVER_STAGE", str(tmp_path / "stage"))
    assert stage.main([str(parts[-1]), "--need", "check"]) == 1  # the first parts are missing
    for p in reversed(parts[:-1]):
        stage.main([str(p)])
    assert stage.main(["--status", "--need", "check"]) == 0
    root = tmp_path / "stage"
    assert (root / "cache" / "m.gguf").read_bytes() == noise + big
    assert (root / "cache" / "q.jsonl").read_text() == '{"turns": ["hi"]}\n'
    assert (root / "heads" / "m" / "w.bin").read_bytes() == noise
    assert not list((root / "chunks").iterdir())  # joined chunks are deleted
    other = pack.pack(items[:1], tmp_path / "other", limit)
    assert other["pack_id"] != manifest["pack_id"]
    with pytest.raises(SystemExit, match="another pack"):
        stage.main([str(tmp_path / "other" / "part-1.tar")])


def test_aside_moves_by_rename_and_back(tmp_path):
    repo, away = tmp_path / "repo", tmp_path / "repo" / ".device-aside"
    (repo / ".git").mkdir(parents=True)
    (repo / "models" / "a").mkdir(parents=True)
    (repo / "models" / "a" / "f").write_text("x")
    assert aside.move("out", repo, away, ("models/a", "models/b")) == ["models/a: moved to .device-aside/",
                                                                       "models/b: already missing"]
    assert aside.where("models/a", repo, away) == "aside" and (away / "models" / "a" / "f").read_text() == "x"
    assert "/.device-aside/" in (repo / ".git" / "info" / "exclude").read_text().splitlines()
    assert aside.move("out", repo, away, ("models/a",)) == ["models/a: already aside"]
    aside.move("back", repo, away, ("models/a",))
    assert (repo / "models" / "a" / "f").read_text() == "x" and aside.where("models/a", repo, away) == "tree"
    (away / "models" / "a").mkdir(parents=True)
    with pytest.raises(SystemExit, match="both"):
        aside.move("out", repo, away, ("models/a",))


@pytest.mark.parametrize("dry", [False, True])
def test_every_run_of_the_check_parses_with_the_benchmarks_flags(dry):
    parser = build_parser()
    runs = check.plan(dry, Path("/tmp/clover-stage"))
    names = [r.name for r in runs]
    assert names[0] == "smollm2-bf16-greedy-b1" and len(set(names)) == len(names)
    for r in runs:
        if not r.skip:
            parser.parse_args(r.args + ["--json", "x.json"])
    real = check.plan(False, Path("/s"))
    first = real[0].args
    assert first[first.index("--buckets") + 1] == "1024" and "--chat" in first
    assert "clover2=chain:5" in first and "eagle3=chain:7" in first
    without = check.plan(False, Path("/s"), flags=set())
    assert [r.name for r in without if r.skip] == ["loop-k1", "loop-k8", "loop-k32"]
    assert next(r for r in without if r.name == "loop-cmdbuf").env["XLA_FLAGS"] == check.COMMAND_BUFFER_XLA


@pytest.mark.slow
def test_the_checks_dry_mode_writes_what_a_lease_returns(tmp_path):
    done = subprocess.run([sys.executable, "-m", "device.check", "--dry", "--out", str(tmp_path), "--jobs", "2",
                           "--only", "loop-base"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    returned = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(returned) <= 8 and {"check.tar.gz", "summary.md"} <= set(returned)
    with tarfile.open(tmp_path / "check.tar.gz") as tar:
        names = tar.getnames()
        run = json.load(tar.extractfile("check/json/loop-base.json"))
    assert "check/png/loop-base.png" in names and "check/precompile/loop-base.log" in names
    assert {r["method"] for r in run["results"]} == {"plain", "clover2"}
    assert "## loop-base" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_the_trainings_dry_mode_returns_heads_and_curves(tmp_path):
    done = subprocess.run([sys.executable, "-m", "device.train", "--dry", "--out", str(tmp_path), "--methods", "medusa"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    returned = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert returned == ["curves.md", "heads.tar.gz.part-00", "train.tar.gz"]
    assert "exported: medusa" in (tmp_path / "curves.md").read_text()
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "heads.tar.gz").write_bytes(b"".join(p.read_bytes() for p in sorted(tmp_path.glob("heads.tar.gz.part-*"))))
    with tarfile.open(heads / "heads.tar.gz") as tar:
        assert "heads/medusa/heads.json" in tar.getnames()
    with tarfile.open(tmp_path / "train.tar.gz") as tar:
        assert "train/medusa/metrics.jsonl" in tar.getnames()


def test_the_gemma3_training_lease_parses_and_keeps_its_sets_apart(tmp_path):
    from device import train as lease
    from train.make_data import build_parser as data_parser
    from train.train import build_parser as train_parser

    args = lease.parse_args(["--model", "gemma3"])
    assert (args.self_records, args.fixed_records, args.steps, args.batch, args.seq_len, args.vocab) == \
        (1570, 800, 4000, 8, 512, 32768)
    cmd = lease.commands(args, tmp_path)
    sets = [cmd["eval"], cmd["self"], *cmd["fixed"]]
    spans = []
    for c in sets:
        a = data_parser().parse_args(c[3:])
        assert a.base == "gemma3" and not a.chat and a.store_hidden == "bfloat16" and a.store_features
        spans.append(range(a.first, a.first + a.limit))
    assert all(x.stop <= y.start for x, y in zip(spans, spans[1:]))  # held-out, self and fixed sets share no record
    for m, c in cmd["train"].items():
        t = train_parser().parse_args(c[3:])
        assert t.base == "gemma3" and t.method == m
        assert (t.draft_vocab if m == "eagle3" else t.loss_vocab) == 32768
    with pytest.raises(SystemExit, match="training lease only"):
        pack.lease_items(tmp_path, 10, {"check", "train"}, "gemma3")


def test_a_lease_with_no_fixed_set_trains_on_the_models_own_answers(tmp_path):
    """`--self 384 --fixed 0 --steps 1000 --batch 4`, SmolLM2's EAGLE-3 round 2 on a lease: the first 384
    self-distilled records are the training data as they are (nothing to merge), held out on the same
    yardstick as every other lease."""
    from device import train as lease
    from train.make_data import build_parser as data_parser
    from train.train import build_parser as train_parser

    args = lease.parse_args(["--methods", "eagle3", "--self", "384", "--fixed", "0", "--steps", "1000", "--batch", "4"])
    cmd = lease.commands(args, tmp_path)
    assert cmd["merge"] is None and cmd["fixed"] == []
    own = data_parser().parse_args(cmd["self"][3:])
    assert (own.base, own.chat, own.first, own.limit, own.store_features) == ("smollm2", True, 0, 384, True)
    t = train_parser().parse_args(cmd["train"]["eagle3"][3:])
    assert (t.method, t.data, t.steps, t.batch_size, t.seq_len, t.draft_vocab) == \
        ("eagle3", str(tmp_path / "data" / "self"), 1000, 4, 512, 8192)
    assert t.eval_data == str(tmp_path / "data" / "eval")


def test_a_lease_trains_the_block_drafters_on_their_own_recipe(tmp_path):
    """--methods dflash,dflash2: a block of 8, one draft layer reading layers 1, 14 and 26 (stored by every
    lease's data as EAGLE-3's features), AdamW at 6e-4, as SmolLM2's shipped DFlash was trained."""
    from device import train as lease
    from train.train import build_parser as train_parser, method_options

    args = lease.parse_args(["--methods", "dflash,dflash2"])
    cmd = lease.commands(args, tmp_path)
    for m in ("dflash", "dflash2"):
        t = train_parser().parse_args(cmd["train"][m][3:])
        assert (t.method, t.num_heads, t.lr, t.loss_vocab) == (m, 7, 6e-4, 8192)
        assert method_options(t) == {"draft_layers": 1, "target_layer_ids": [1, 14, 26]}


def test_a_lease_trains_the_corrections_on_a_frozen_dflash(tmp_path):
    """dspark, domino and dflash_clover train their correction alone (--backbone): on the DFlash the same
    lease trains when it trains one, else on the model's shipped one."""
    from device import train as lease
    from train.train import build_parser as train_parser

    cmd = lease.commands(lease.parse_args(["--methods", "dflash,dspark,domino,dflash_clover"]), tmp_path)
    for m in lease.CORRECTIONS:
        t = train_parser().parse_args(cmd["train"][m][3:])
        assert (t.method, t.backbone, t.lr) == (m, str(tmp_path / "heads" / "dflash"), 6e-4)
    alone = lease.commands(lease.parse_args(["--methods", "dflash_clover"]), tmp_path)["train"]["dflash_clover"]
    t = train_parser().parse_args(alone[3:])
    assert Path(t.backbone) == lease.REPO / "models" / "smollm2" / "heads" / "dflash" and Path(t.backbone).is_dir()
