"""`train/smollm2_heads.sh`, the round-6 recipe, run over a stand-in Python that records each command and
writes what the real one would leave (a dataset's meta.json, exported heads): the order of the data
passes, the records each set takes, each method's flags, the packed parts, and a rerun that redoes nothing."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "train" / "smollm2_heads.sh"

FAKE = r'''#!/usr/bin/env python3
import json, os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
if args[0] == "-c":
    print("/models/smollm2")
    sys.exit(0)
out = args[args.index("--out") + 1]
os.makedirs(out, exist_ok=True)
if args[1] == "train.train":
    time.sleep(0.5)  # still running when the script first looks
    open(os.path.join(out, "heads.json"), "w").write("{}")
    open(os.path.join(out, "heads.safetensors"), "wb").write(os.urandom(2048))
else:
    open(os.path.join(out, "meta.json"), "w").write("{}")
'''


def run_recipe(tmp_path, log):
    fake = tmp_path / "python"
    fake.write_text(FAKE.replace("#!/usr/bin/env python3", "#!" + sys.executable))
    fake.chmod(0o755)
    env = dict(os.environ, FAKE_LOG=str(log), PY=str(fake), ROOT=str(tmp_path / "run"),
               PACK_TO=str(tmp_path / "pack"), POLL="0.2", METHODS="clover2 medusa eagle3")
    (tmp_path / "pack").mkdir(exist_ok=True)
    done = subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parents[1], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()], done.stdout


def flag(args, name):
    return args[args.index(name) + 1]


def test_the_recipe_makes_the_data_then_trains_every_method_and_a_rerun_redoes_nothing(tmp_path):
    log = tmp_path / "calls.jsonl"
    calls, out = run_recipe(tmp_path, log)
    modules = [a[1] for a in calls if a[0] == "-m"]
    data = [a for a in calls if a[:2] == ["-m", "train.make_data"]]
    # The held-out set first and alone (its compiled programs serve the other four), then the rest.
    assert Path(flag(data[0], "--out")).name == "eval" and flag(data[0], "--limit") == "640"
    sets = {Path(flag(a, "--out")).name: a for a in data}
    assert sorted(sets) == ["eval", "fixed0", "fixed1", "fixed2", "self"]
    assert flag(sets["self"], "--limit") == "1570" and "--answers" in sets["self"]
    assert [flag(sets[f"fixed{k}"], "--first") for k in range(3)] == ["1570", "2370", "3170"]
    assert all(flag(a, "--buckets") == "512,1024" and "--store-features" not in a for a in data)
    merge = next(a for a in calls if a[:2] == ["-m", "train.merge_data"])
    assert [Path(p).name for p in merge[2:6]] == ["self", "fixed0", "fixed1", "fixed2"]
    assert modules.index("train.merge_data") > max(i for i, m in enumerate(modules) if m == "train.make_data")
    trains = {flag(a, "--method"): a for a in calls if a[:2] == ["-m", "train.train"]}
    assert sorted(trains) == ["clover2", "eagle3", "medusa"]
    assert flag(trains["eagle3"], "--draft-vocab") == "8192" and "--loss-vocab" not in trains["eagle3"]
    for m in ("clover2", "medusa"):
        assert flag(trains[m], "--loss-vocab") == "8192" and flag(trains[m], "--steps") == "4800"
        assert Path(flag(trains[m], "--data")).name == "r6" and Path(flag(trains[m], "--eval-data")).name == "eval"
    for m in trains:
        with tarfile.open(tmp_path / "pack" / f"{m}.tgz.part-00") as t:
            assert sorted(t.getnames()) == [m, f"{m}/heads.json", f"{m}/heads.safetensors"]
    assert "all exported" in out
    log.write_text("")
    calls, out = run_recipe(tmp_path, log)
    assert [a[0] for a in calls] == ["-c"]  # every set and every method kept; nothing made or trained again
