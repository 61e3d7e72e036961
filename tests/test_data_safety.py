"""Nothing lost, nothing stale, nothing half-written: each fault the tools' fault sweep found, reproduced.

Every test puts data in place, injects the fault (a refused run, Ctrl-C, a kill between two renames, a
full disk, a killed conversion, a retrain over derived files) and checks that the old data is whole
byte for byte, that the error is one line, and that nothing stale is used afterwards.
"""

import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors
from flax import nnx

from clover_jax import _cli as cli
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io import files, gguf, heads_dir, hf
from clover_jax.io.heads_dir import load_draft_vocab, load_fitted_tree, load_heads, read_heads_config, save_heads
from clover_jax.io.hf import load_pretrained
from clover_jax.plan import factory
from clover_jax.trees.spec import resolve_tree
from clover_jax.trees.static import Tree
from train import data, evaluate, hidden_states, make_data, train
from train.data import HeadDataset, staging_dir

RECORDS = [{"prompt": "def add(a, b):", "response": "\n    return a + b\n"},
           {"prompt": "class Point:", "response": "\n    def __init__(self, x):\n        self.x = x\n"},
           {"prompt": "import os", "response": "\nprint(os.getcwd())"}]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def base(model_dir):
    return load_pretrained(model_dir)[1]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (folder / "empty.jsonl").write_text(json.dumps({"prompt": "def add(a, b):", "response": ""}) + "\n")
    return folder


@pytest.fixture(scope="module")
def old_set(model_dir, prompts, tmp_path_factory):
    """A finished dataset with float16 hidden states: the data a faulty rerun must not lose."""
    out = tmp_path_factory.mktemp("old-set")
    assert make_data.main([f"--base={model_dir}", f"--prompts={prompts / 'good.jsonl'}", f"--out={out}",
                           "--mode=fixed", "--store-hidden=float16"]) == 0
    return out


def snapshot(folder):
    """{file name: sha256} of everything in `folder`."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def one_line(err):
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def last_line(err):
    """The error line of a run that showed a progress bar before it: the only one, and the last."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert "Traceback" not in err and sum(line.startswith("error: ") for line in lines) == 1, err
    assert lines[-1].startswith("error: "), err
    return lines[-1]


def run_make_data(capsys, model_dir, prompts_file, out, *extra):
    capsys.readouterr()
    code = make_data.main([f"--base={model_dir}", f"--prompts={prompts_file}", f"--out={out}", "--mode=fixed",
                           *extra])
    return code, capsys.readouterr().err


# 1. A refused, interrupted or killed make_data rerun leaves the old dataset whole.

def test_a_refused_rerun_leaves_the_old_dataset_whole(model_dir, prompts, old_set, tmp_path, capsys):
    d = shutil.copytree(old_set, tmp_path / "d")
    before = snapshot(d)
    code, err = run_make_data(capsys, model_dir, prompts / "empty.jsonl", d)
    assert code == 2 and "every response is empty" in one_line(err)
    assert snapshot(d) == before and len(HeadDataset(d)) == len(RECORDS)
    assert not staging_dir(d).exists()


@pytest.mark.parametrize("where", ["hidden states", "arrays"])
def test_ctrl_c_during_a_rerun_leaves_the_old_dataset_whole(where, model_dir, prompts, old_set, tmp_path, capsys,
                                                            monkeypatch):
    d = shutil.copytree(old_set, tmp_path / "d")
    before = snapshot(d)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hidden_states, "_last_hidden", interrupted) if where == "hidden states" else \
        monkeypatch.setattr(data, "save_array", interrupted)
    code, err = run_make_data(capsys, model_dir, prompts / "good.jsonl", d, "--limit=2", "--store-hidden=float16")
    assert code == cli.INTERRUPTED
    assert {k: v for k, v in snapshot(d).items() if k not in data.PARTIAL} == before
    assert len(HeadDataset(d)) == len(RECORDS)
    monkeypatch.undo()
    code, _ = run_make_data(capsys, model_dir, prompts / "good.jsonl", d, "--limit=2")  # a finished rerun replaces it
    assert code == 0 and len(HeadDataset(d)) == 2 and HeadDataset(d).hidden is None
    assert not staging_dir(d).exists() and not (tmp_path / "d.old").exists()


def test_a_kill_between_the_swaps_renames_is_undone_by_the_next_run(model_dir, prompts, old_set, tmp_path, capsys,
                                                                     monkeypatch):
    """The swap moves the old set aside, then the new one in; killed in between, the next run (even a
    refused one) puts the old set back before anything else."""
    d = shutil.copytree(old_set, tmp_path / "d")
    before = snapshot(d)

    def killed(src, dst):
        if src == staging_dir(d):
            raise KeyboardInterrupt

    monkeypatch.setattr(files, "rename_hook", killed)
    assert run_make_data(capsys, model_dir, prompts / "good.jsonl", d, "--limit=2")[0] == cli.INTERRUPTED
    assert not d.exists() and snapshot(tmp_path / "d.old") == before
    monkeypatch.setattr(files, "rename_hook", None)
    code, err = run_make_data(capsys, model_dir, prompts / "empty.jsonl", d)
    assert code == 2 and "every response is empty" in one_line(err)
    assert snapshot(d) == before and not (tmp_path / "d.old").exists()


# 5. A full disk is one line, checked up front where the size is known; the old dataset stays whole.

def test_a_dataset_that_cannot_fit_is_refused_before_the_hidden_states(model_dir, prompts, old_set, tmp_path,
                                                                        capsys, monkeypatch):
    d = shutil.copytree(old_set, tmp_path / "d")
    before, calls = snapshot(d), []
    real = hidden_states._last_hidden
    monkeypatch.setattr(hidden_states, "_last_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(files, "free_bytes", lambda path: 1000)
    code, err = run_make_data(capsys, model_dir, prompts / "good.jsonl", d, "--store-hidden=float16")
    assert code == 2 and "no space left on" in one_line(err) and "need about" in err and "old one stays" in err
    assert not calls and snapshot(d) == before


@pytest.mark.parametrize("stub", ["allocating the hidden states", "writing an array"])
def test_a_disk_that_fills_during_a_rerun_is_one_line(stub, model_dir, prompts, old_set, tmp_path, capsys,
                                                      monkeypatch):
    """A full disk met while writing (the free-space check passed): ENOSPC, never SIGBUS on a sparse map,
    turned into the one line; the old set whole."""
    d = shutil.copytree(old_set, tmp_path / "d")
    before = snapshot(d)

    def full(*a, **k):
        raise ENOSPC

    if stub == "allocating the hidden states":
        monkeypatch.setattr(os, "posix_fallocate", full)
    else:
        monkeypatch.setattr(data, "save_array", full)
    code, err = run_make_data(capsys, model_dir, prompts / "good.jsonl", d, "--store-hidden=float16")
    assert code == 2 and "no space left on" in last_line(err) and "need about" in err
    assert {k: v for k, v in snapshot(d).items() if k not in data.PARTIAL} == before


def test_new_hidden_state_arrays_are_allocated_not_sparse(tmp_path):
    array = data.new_memmap(tmp_path / "h.npy", np.float16, (4096, 64))
    assert files.allocated_bytes(tmp_path / "h.npy") >= array.nbytes
    del array


# 2. A heads export is one set: a kill between its renames is refused, never loaded as a mix.

def _heads(base, seed):
    return make_heads(drafter_config("medusa", 2), base, seed=seed)


def _weights(heads):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(heads, nnx.Param))]


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
def test_an_export_killed_between_renames_is_never_loaded_as_a_mix(nth, base, tmp_path, monkeypatch):
    """Renames of an export: 1 the marker, 2 the weights, 3 the counts, 4 heads.json. Killed before the
    first file of the set is renamed, the old set is whole and loads; after it, every reader refuses the
    folder in one line. The next export clears it."""
    old, new = _heads(base, 1), _heads(base, 2)
    v = base.cfg.vocab_size
    save_heads(old, base, tmp_path, extra={"note": "old"}, token_counts=np.arange(v))
    before = snapshot(tmp_path)
    renames = []

    def killed(src, dst):
        renames.append(dst.name)
        if len(renames) == nth:
            raise KeyboardInterrupt

    monkeypatch.setattr(files, "rename_hook", killed)
    with pytest.raises(KeyboardInterrupt):
        save_heads(new, base, tmp_path, extra={"note": "new"}, token_counts=np.arange(v)[::-1].copy())
    monkeypatch.setattr(files, "rename_hook", None)
    assert renames == [files.SWITCHING, heads_dir.WEIGHTS, heads_dir.COUNTS, heads_dir.CONFIG][:nth]
    assert not list(tmp_path.glob("*.tmp"))
    if nth <= 2:
        assert snapshot(tmp_path) == before and read_heads_config(tmp_path)["note"] == "old"
        for a, b in zip(_weights(load_heads(tmp_path, base)), _weights(old), strict=True):
            np.testing.assert_array_equal(a, b)
    else:
        for read in (lambda: load_heads(tmp_path, base), lambda: read_heads_config(tmp_path),
                     lambda: load_draft_vocab(tmp_path, base, 8), lambda: load_fitted_tree(tmp_path, 2)):
            with pytest.raises(CloverError, match="interrupted") as e:
                read()
            assert "\n" not in str(e.value)
        def interrupted(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(heads_dir, "save_safetensors", interrupted)
        with pytest.raises(KeyboardInterrupt):  # an export that fails again keeps the folder refused
            save_heads(new, base, tmp_path)
        monkeypatch.undo()
        with pytest.raises(CloverError, match="interrupted"):
            read_heads_config(tmp_path)
    save_heads(new, base, tmp_path, extra={"note": "new"})
    assert read_heads_config(tmp_path)["note"] == "new" and not (tmp_path / files.SWITCHING).exists()
    for a, b in zip(_weights(load_heads(tmp_path, base)), _weights(new), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_full_disk_at_export_is_one_line_and_keeps_the_old_heads(base, tmp_path, monkeypatch):
    """Safetensors' own error for ENOSPC, and the OSError itself: one line naming the folder and the
    size, the old heads whole, no temporary or marker left."""
    save_heads(_heads(base, 1), base, tmp_path, extra={"note": "old"})
    before = snapshot(tmp_path)
    message = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    for error in (safetensors.SafetensorError(message), ENOSPC):
        def full(*a, **k):
            raise error
        monkeypatch.setattr(hf, "save_file", full)
        with pytest.raises(CloverError, match="no space left on .* for the heads: need about") as e:
            save_heads(_heads(base, 2), base, tmp_path, extra={"note": "new"})
        assert "\n" not in str(e.value) and snapshot(tmp_path) == before


# 3. What is derived from heads (tree.json, evaluate's record) does not outlive them.

@pytest.fixture(scope="module")
def trained_heads(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads")
    save_heads(_heads(base, 1), base, out, token_counts=np.ones(base.cfg.vocab_size, np.int64))
    return out


def _train_argv(model_dir, data_dir, out, work, *extra):
    return [str(a) for a in ["--method", "medusa", "--base", model_dir, "--data", data_dir, "--out", out,
                             "--work-dir", work, "--steps", 2, "--batch-size", 2, "--seq-len", 16, "--dtype",
                             "float32", "--warmup", 1, "--num-heads", 2, "--val-fraction", 0, "--eval-batches", 1,
                             *extra]]


def test_a_retrain_drops_the_tree_fitted_to_the_old_heads(model_dir, base, old_set, trained_heads, tmp_path, capsys):
    heads = shutil.copytree(trained_heads, tmp_path / "heads")
    capsys.readouterr()
    assert evaluate.main(["--heads", str(heads), "--base", str(model_dir), "--data", str(old_set), "--split", "all",
                          "--fit-tree", "8", "--record"]) == 0
    fitted = load_fitted_tree(heads, 2)
    assert fitted.num_nodes == 8 and "evaluated" in read_heads_config(heads)
    stale = (heads / heads_dir.TREE).read_text()
    assert train.main(_train_argv(model_dir, old_set, heads, tmp_path / "work")) == 0
    assert not (heads / heads_dir.TREE).exists() and "evaluated" not in read_heads_config(heads)
    paper = resolve_tree("paper", "medusa", 2)
    gen = factory.make_generator(base, "medusa", model_path=str(model_dir), heads=str(heads), tree="default")
    assert gen.tree == paper
    # The old tree.json put back (a copy, a kill before its removal): it names the old heads, so it is ignored.
    (heads / heads_dir.TREE).write_text(stale)
    capsys.readouterr()
    assert load_fitted_tree(heads, 2) is None
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and err.count("\n") == 1 and "fitted to other heads" in err
    gen = factory.make_generator(base, "medusa", model_path=str(model_dir), heads=str(heads), tree="default")
    assert gen.tree == paper
    # A tree without a hash (the shipped ones, fitted before the hash was kept) is still drafted.
    Tree.to_file(fitted, heads / heads_dir.TREE)
    assert load_fitted_tree(heads, 2) == fitted


def test_train_refuses_a_full_out_before_training_and_an_export_error_keeps_the_old_heads(
        model_dir, old_set, trained_heads, tmp_path, capsys, monkeypatch):
    heads = shutil.copytree(trained_heads, tmp_path / "heads")
    before = snapshot(heads)
    monkeypatch.setattr(files, "free_bytes", lambda path: 1000)
    capsys.readouterr()
    assert train.main(_train_argv(model_dir, old_set, heads, tmp_path / "work")) == 2
    err = one_line(capsys.readouterr().err)
    assert "no space left on" in err and "for the heads: need about" in err
    assert not (tmp_path / "work" / "checkpoints").exists() and snapshot(heads) == before
    monkeypatch.undo()
    message = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'

    def full(*a, **k):
        raise safetensors.SafetensorError(message)

    monkeypatch.setattr(hf, "save_file", full)  # room at the start, none at the end
    assert train.main(_train_argv(model_dir, old_set, heads, tmp_path / "work2")) == 2
    err = last_line(capsys.readouterr().err)
    assert "no space left on" in err and "SafetensorError" not in err and snapshot(heads) == before


# 4. A killed GGUF conversion's temporary folder is removed by the next run.

def test_a_killed_conversion_leaves_nothing_for_long(tmp_path, monkeypatch):
    """A conversion killed mid-write (os._exit in a child process) leaves its folder; the next call removes
    it, but not a folder of a process still running, nor one made on another machine."""
    source, cache = tmp_path / "m.gguf", tmp_path / "cache"
    source.write_bytes(b"any bytes: only hashed, the conversion is a stand-in")
    child = ("import os, sys\nfrom pathlib import Path\nfrom clover_jax.io import gguf\n"
             "def killed(path, out):\n    Path(out).mkdir(parents=True)\n"
             "    (Path(out) / 'model.safetensors').write_bytes(bytes(4096))\n    os._exit(9)\n"
             "gguf._gguf = lambda: None\ngguf.convert_gguf = killed\n"
             "gguf.gguf_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]))\n")
    done = subprocess.run([sys.executable, "-c", child, str(source), str(cache)], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    leaked = list((cache / "models").glob("gguf-*.tmp-*"))
    assert len(leaked) == 1 and (leaked[0] / "model.safetensors").is_file()
    running = cache / "models" / f"gguf-{'0' * 24}.tmp-{socket.gethostname()}-{os.getppid()}"
    elsewhere = cache / "models" / f"gguf-{'1' * 24}.tmp-another-host-{done.returncode}"
    for folder in (running, elsewhere):
        folder.mkdir()

    def convert(path, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "_gguf", lambda: None)
    monkeypatch.setattr(gguf, "convert_gguf", convert)
    target = gguf.gguf_checkpoint(source, cache)
    assert sorted(p.name for p in (cache / "models").iterdir()) == sorted([target.name, running.name, elsewhere.name])


def test_hidden_states_that_overflow_float16_are_one_line_and_keep_the_old_dataset(model_dir, old_set, prompts,
                                                                                     tmp_path, capsys):
    """A base model whose residual stream passes float16's 65,504 (Gemma 3's does; here the tiny model with
    its embedding times 1e6) is refused in one line naming bfloat16, not written as inf into the data;
    bfloat16 stores the same states."""
    big = tmp_path / "big"
    shutil.copytree(model_dir, big)
    _, model = load_pretrained(big)
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 1e6
    hf.save_pretrained(model, big, dtype=np.float32)
    d = shutil.copytree(old_set, tmp_path / "d")
    before = snapshot(d)
    code, err = run_make_data(capsys, big, prompts / "good.jsonl", d, "--store-hidden=float16")
    assert code == 2 and "--store-hidden bfloat16" in last_line(err) and "not finite as float16" in err, err
    assert snapshot(d) == before
    code, err = run_make_data(capsys, big, prompts / "good.jsonl", tmp_path / "bf16", "--store-hidden=bfloat16")
    assert code == 0, err
    assert np.isfinite(np.load(tmp_path / "bf16" / "hidden.npy").view(data.HIDDEN_DTYPES["bfloat16"])).all()
