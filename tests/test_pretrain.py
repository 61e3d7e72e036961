"""A tiny pretraining run: the loss goes down, and a stopped run resumes to the very same weights."""

import json
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from train import pretrain

pytestmark = pytest.mark.optimized  # its time goes into running programs, not compiling them

TINY = ["--vocab-size", "300", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "64", "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup", "2",
        "--eval-windows", "4", "--eval-every", "3", "--ckpt-every", "3"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def run(tmp_path, data_dir, name, *extra, code=0):
    work = tmp_path / name
    assert pretrain.main(TINY + ["--out", str(work / "model"), "--work-dir", str(work / "run"),
                                 "--data-dir", str(data_dir), *map(str, extra)]) == code
    return work


def test_loss_falls_and_resume_is_exact(tmp_path, data_dir, monkeypatch, capsys, ctrl_c):
    """Stopped by --stop-after, then by Ctrl-C (the step in progress is finished and checkpointed, exit
    130), then resumed to the end: the very weights of a run never stopped."""
    straight = run(tmp_path, data_dir, "straight", "--steps", 8)
    val = [json.loads(line)["val_loss"] for line in (straight / "run" / "metrics.jsonl").read_text().splitlines()
           if "val_loss" in line]
    assert val[-1] < val[0] - 0.2

    resumed = run(tmp_path, data_dir, "resumed", "--steps", 8, "--stop-after", 4)
    assert not (resumed / "model").exists()  # stopped before the end: nothing exported
    batch_at = pretrain.batch_at

    def ctrl_c_in_step_5(tokens, step, *args):
        if step == 5:
            signal.raise_signal(signal.SIGINT)
        return batch_at(tokens, step, *args)

    monkeypatch.setattr(pretrain, "batch_at", ctrl_c_in_step_5)
    capsys.readouterr()
    run(tmp_path, data_dir, "resumed", "--steps", 8, code=130)
    assert "resumed from step 4" in (err := capsys.readouterr().err) and "stopped at step 6; rerun to resume" in err
    monkeypatch.setattr(pretrain, "batch_at", batch_at)
    resumed = run(tmp_path, data_dir, "resumed", "--steps", 8)
    a = load_file(str(straight / "model" / "model.safetensors"))
    b = load_file(str(resumed / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for f in ("config.json", "tokenizer.json", "generation_config.json", "split.json"):
        assert (resumed / "model" / f).is_file()


def test_an_output_path_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys):
    """The export is written after the whole run: an --out under a file is one error line at the start."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = pretrain.main(TINY + ["--out", str(blocker / "model"), "--work-dir", str(tmp_path / "run"),
                                 "--data-dir", str(tmp_path / "data")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == f"error: --out: cannot create the folder {blocker / 'model'}: {blocker} is a file; pick another path"
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()
