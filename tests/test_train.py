"""`python -m train.train` on tiny models (the losses themselves: tests/test_losses.py).

The CLI end to end on a tiny random Llama with a real tokenizer: a few steps lower the loss, the base
model is never touched, a killed run resumes to identical heads, bad input is one line and exit 2, the
exported heads drive `infer.generate`, and `train.evaluate` measures them as training did. (What
training's teacher forcing sees: tests/test_unroll.py; sharded training: tests/test_sharding.py.)
"""

import contextlib
import hashlib
import io
import json
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file

from clover_jax.io.heads_dir import held_out_chain_tau, load_fitted_tree, load_heads
from clover_jax.io.hf import load_pretrained
from clover_jax.drafters.vocab import DraftVocab, token_counts
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters import registry
from clover_jax.drafters.dflash import DFlashDrafter
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.losses import targets_and_masks
from clover_jax.drafters import BUILT_IN as METHODS
from clover_jax.model.llama import causal_self_mask
from clover_jax.trees.spec import resolve_tree
from conftest import HEAD_RECORDS
from clover_jax.plan import factory
from infer import generate
from train import evaluate
from train import make_data
from train import train
from train.data import HeadDataset

pytestmark = pytest.mark.slow  # training runs of train.train, end to end

STEPS, SEED, NUM_HEADS = 6, 3, 2


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _argv(model_dir, data, out, work, method, *extra):
    argv = ["--method", method, "--base", model_dir, "--data", data, "--out", out, "--work-dir", work,
            "--steps", STEPS, "--batch-size", 2, "--seq-len", 32, "--dtype", "float32", "--warmup", 1,
            "--lr", 1e-2, "--num-heads", NUM_HEADS, "--seed", SEED, "--val-fraction", 0, *extra]
    return [str(a) for a in argv]


def _train(capsys, *args):
    """(exit code, stdout, stderr) of `train.main` on `_argv(*args)`."""
    capsys.readouterr()
    code = train.main(_argv(*args))
    return (code, *capsys.readouterr())


DATA_OF = {"medusa": "plain", "clover": "plain", "clover2": "hidden", "eagle": "hidden", "eagle3": "plain", "dflash": "plain",
           "dflash2": "plain", "dspark": "plain", "domino": "plain", "dflash_clover": "plain"}


@pytest.fixture(scope="module")
def trained(model_dir, datasets, tmp_path_factory):
    """method -> (out dir, work dir, sha256 of model.safetensors before and after): one run per method,
    6 steps; Medusa's also evaluates a held-out split."""
    runs = {}
    for method in METHODS:
        root = tmp_path_factory.mktemp(f"train-{method}")
        before = _sha256(model_dir / "model.safetensors")
        extra = {"medusa": ["--val-fraction", 0.2, "--eval-batches", 1], "eagle3": ["--draft-vocab", 40]}.get(method, [])
        err = io.StringIO()  # module fixtures cannot use capsys
        with contextlib.redirect_stderr(err):
            code = train.main(_argv(model_dir, datasets[DATA_OF[method]], root / "out", root / "work", method, *extra))
        assert code == 0, err.getvalue()
        runs[method] = (root / "out", root / "work", before, _sha256(model_dir / "model.safetensors"))
    return runs


def _base(model_dir):
    return load_pretrained(model_dir)[1]


def _batches(data_dir, seed=SEED):
    """The six training batches of a run (no validation split), stacked into one batch of 12 rows."""
    data = HeadDataset(data_dir)
    rows = [data.batch_at(s, 2, 32, seed) for s in range(STEPS)]
    return {k: jnp.asarray(np.concatenate([r[k] for r in rows])) for k in rows[0] if rows[0][k] is not None}


@pytest.mark.parametrize("method", METHODS)
def test_training_lowers_the_loss_and_leaves_the_base_alone(method, trained, model_dir, datasets):
    out, work, sha_before, sha_after = trained[method]
    assert sha_before == sha_after
    base = _base(model_dir)
    batch = _batches(datasets[DATA_OF[method]])
    start = make_heads(drafter_config(method, NUM_HEADS), base, seed=SEED)
    end = load_heads(out, base, method)
    loss_start = float(train.head_loss(start, base, batch)[0])
    loss_end = float(train.head_loss(end, base, batch)[0])
    assert loss_end < loss_start, (loss_start, loss_end)
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [STEPS]
    meta = json.loads((out / "heads.json").read_text())
    assert meta["final_step"] == STEPS and meta["heads"]["method"] == method
    if method == "medusa":
        assert len(meta["held_out"]["val_top1"]) == NUM_HEADS and (work / "best").is_dir()
        assert 1.0 <= meta["held_out"]["val_chain_tau"] <= NUM_HEADS + 1
        by_depth = meta["held_out"]["val_chain_tau_by_depth"]  # chains through the first 1, 2, ... heads
        assert len(by_depth) == NUM_HEADS and by_depth[-1] == meta["held_out"]["val_chain_tau"]
        assert all(1.0 <= tau <= depth + 1 for depth, tau in enumerate(by_depth, 1)), by_depth

    # The checkpoint holds the heads' parameters and an optimizer state over them alone.
    mgr = ocp.CheckpointManager(work / "checkpoints")
    assert mgr.latest_step() == STEPS
    restored = mgr.restore(STEPS)
    head_shapes = sorted(np.shape(x) for x in jax.tree.leaves(nnx.state(end, nnx.Param)))
    assert sorted(np.shape(x) for x in jax.tree.leaves(restored["params"])) == head_shapes
    opt_sizes = sum(np.size(x) for x in jax.tree.leaves(restored["opt_state"]))
    head_size = sum(np.size(x) for x in jax.tree.leaves(restored["params"]))
    base_size = sum(np.size(x) for x in jax.tree.leaves(nnx.state(base, nnx.Param)))
    assert 2 * head_size <= opt_sizes <= 2 * head_size + 8  # Adam's mu and nu plus step counts
    assert base_size not in (opt_sizes, head_size)
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(restored)[0]}
    base_names = (("embed_tokens",) + (() if method == "eagle3" else ("lm_head",))  # EAGLE-3 has its own
                  # a DFlash block drafter's (its corrections' too) draft layers are its own `layers`
                  + (() if issubclass(registry.get(method).drafter, DFlashDrafter) else ("'layers'",)))
    assert not any(name in p for p in paths for name in base_names)
    if method == "eagle3":  # its draft vocabulary: the 40 most frequent response tokens, saved with the heads
        counts = load_file(str(out / "token_counts.safetensors"))["counts"]
        assert set(np.asarray(end.ids[...]).tolist()) == set(np.argsort(-counts, kind="stable")[:40].tolist())


def test_kill_and_resume_gives_identical_heads(trained, model_dir, datasets, tmp_path, capsys, ctrl_c):
    from safetensors.numpy import load_file

    straight, _, _, _ = trained["clover2"]
    out, work = tmp_path / "out", tmp_path / "work"
    code, _, err = _train(capsys, model_dir, datasets["hidden"], out, work, "clover2", "--stop-after", 3)
    assert code == 0 and "stopped at step 3; rerun with --resume" in err, err
    assert not (out / "heads.safetensors").exists()
    # Ctrl-C during step 5 (index 4): that step is finished and checkpointed, and the run exits with 130.
    batch_at = HeadDataset.batch_at

    def ctrl_c_in_step_5(self, step, *args):
        if step == 4:
            signal.raise_signal(signal.SIGINT)
        return batch_at(self, step, *args)

    handler = signal.getsignal(signal.SIGINT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HeadDataset, "batch_at", ctrl_c_in_step_5)
        code, _, err = _train(capsys, model_dir, datasets["hidden"], out, work, "clover2", "--resume")
    assert code == 130 and "resumed from step 3" in err and "stopped at step 5; rerun with --resume" in err, err
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C acts as usual again
    code, _, err = _train(capsys, model_dir, datasets["hidden"], out, work, "clover2", "--resume")
    assert code == 0 and "resumed from step 5" in err, err
    a, b = load_file(str(straight / "heads.safetensors")), load_file(str(out / "heads.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    # A finished work dir without --resume is refused before anything is overwritten.
    code, stdout, err = _train(capsys, model_dir, datasets["hidden"], out, work, "clover2")
    assert (code, stdout) == (2, "") and err.startswith("error: ") and err.count("\n") == 1, err
    assert "already holds checkpoints; pass --resume" in err

    # Resuming with settings that change what the checkpoints hold is refused in one line.
    code, stdout, err = _train(capsys, model_dir, datasets["hidden"], out, work, "medusa", "--resume")
    assert (code, stdout) == (2, "") and err.count("\n") == 1, err
    assert "was started with method='clover2', not 'medusa'" in err


def test_resuming_a_finished_run_exports_the_same_heads_and_held_out_figures(trained, model_dir, datasets,
                                                                            tmp_path, capsys):
    """No step is left to run, so none evaluates: the export evaluates the held-out split itself."""
    out, work, _, _ = trained["medusa"]
    again = tmp_path / "again"
    code, _, err = _train(capsys, model_dir, datasets["plain"], again, work, "medusa", "--val-fraction", 0.2,
                          "--eval-batches", 1, "--resume")
    assert code == 0 and f"resumed from step {STEPS}" in err, err
    first, second = (json.loads((d / "heads.json").read_text())["held_out"] for d in (out, again))
    assert second == first and len(first["val_top1"]) == NUM_HEADS
    a, b = load_file(str(out / "heads.safetensors")), load_file(str(again / "heads.safetensors"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", ["clover2", "eagle3"])
def test_training_on_from_exported_heads_starts_from_them(method, trained, model_dir, datasets, tmp_path, capsys):
    """--init-from: at learning rate 0 the export is the initial heads byte for byte (EAGLE-3's draft
    ids included, which a fresh start would pick from the counts); at train.train's default rate (1e-3;
    the first runs' 1e-2, restarted from its peak, can overshoot heads already trained at it) the loss
    on the run's own batches falls below theirs."""
    start, _, _, _ = trained[method]
    frozen = tmp_path / "frozen"
    code, _, err = _train(capsys, model_dir, datasets[DATA_OF[method]], frozen, tmp_path / "w0", method,
                          "--init-from", start, "--lr", 0)
    assert code == 0, err
    a, b = load_file(str(start / "heads.safetensors")), load_file(str(frozen / "heads.safetensors"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    on = tmp_path / "on"
    code, _, err = _train(capsys, model_dir, datasets[DATA_OF[method]], on, tmp_path / "w1", method,
                          "--init-from", start, "--lr", 1e-3)
    assert code == 0, err
    assert json.loads((on / "heads.json").read_text())["training"]["init_from"] == str(start)
    base, batch = _base(model_dir), _batches(datasets[DATA_OF[method]])
    before, after = (float(train.head_loss(load_heads(d, base, method), base, batch)[0]) for d in (start, on))
    assert after < before, (before, after)
    # A resume may not swap the heads its first start read for others.
    code, stdout, err = _train(capsys, model_dir, datasets[DATA_OF[method]], tmp_path / "again", tmp_path / "w1",
                               method, "--init-from", on, "--resume")
    assert (code, stdout) == (2, "") and err.count("\n") == 1, err
    assert "was started with init_from_sha256=" in err, err


@pytest.mark.parametrize("case", ["other method", "other number of heads"])
def test_init_from_heads_that_do_not_fit_is_one_error_line(case, trained, model_dir, datasets, tmp_path, capsys):
    """(Heads of another base model are refused by load_heads, as for decoding: tests/test_checkpoint.py.)"""
    start, _, _, _ = trained["clover"]
    method, extra = ("medusa", []) if case == "other method" else ("clover", ["--num-heads", NUM_HEADS + 1])
    code, stdout, err = _train(capsys, model_dir, datasets["plain"], tmp_path / "out", tmp_path / "work", method,
                               "--init-from", start, *extra)  # the last --num-heads counts
    assert (code, stdout) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert {"other method": "holds clover heads, not medusa",
            "other number of heads": f"holds heads with --num-heads {NUM_HEADS}, not {NUM_HEADS + 1}"}[case] in err, err


def test_held_out_figures_and_token_counts_can_come_from_another_dataset(trained, model_dir, datasets, tmp_path, capsys):
    """`--eval-data`: the held-out split of another dataset (here made with `make_data --first`, which
    leaves out the records before it) gives the held-out figures; training still reads --data."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in HEAD_RECORDS))
    later = tmp_path / "later"
    assert make_data.main([f"--base={model_dir}", f"--prompts={prompts}", f"--out={later}", "--mode=fixed",
                           "--first=3", "--limit=4"]) == 0
    whole, part = HeadDataset(datasets["plain"]), HeadDataset(later)
    assert part.num_examples == 4 and np.array_equal(part.tokens, whole.tokens[whole.offsets[3]: whole.offsets[7]])
    out, work, _, _ = trained["medusa"]
    again = tmp_path / "again"
    code, _, err = _train(capsys, model_dir, datasets["plain"], again, work, "medusa", "--val-fraction", 0.2,
                          "--eval-batches", 1, "--eval-data", later, "--resume")
    assert code == 0, err
    got = json.loads((again / "heads.json").read_text())["held_out"]
    base = _base(model_dir)
    heads = load_heads(out, base)
    batch = next(part.eval_batches(32, 2, part.split(0.2)[1]))
    _, want = train.head_loss(heads, base, {k: jnp.asarray(v) for k, v in batch.items() if v is not None},
                              with_ranks=True)
    np.testing.assert_allclose(got["val_loss"], float(want["loss"]), rtol=1e-5)
    np.testing.assert_allclose(got["val_top1"], np.asarray(want["top1"]), rtol=1e-5)
    first = json.loads((out / "heads.json").read_text())["held_out"]
    assert got["val_loss"] != first["val_loss"]
    # --counts-from: the exported token counts (and the loss vocabulary) are the other set's training
    # split's; a run started with it does not resume without it.
    counted, work2 = tmp_path / "counted", tmp_path / "work2"
    code, _, err = _train(capsys, model_dir, datasets["plain"], counted, work2, "medusa", "--counts-from", later,
                          "--val-fraction", 0.2, "--steps", 2, "--loss-vocab", 8)
    assert code == 0, err
    train_split = part.split(0.2)[0]
    want_counts = token_counts(part.tokens, part.loss_mask * part.example_mask(train_split), base.cfg.vocab_size)
    assert 0 < want_counts.sum() < token_counts(part.tokens, part.loss_mask, base.cfg.vocab_size).sum()
    np.testing.assert_array_equal(load_file(str(counted / "token_counts.safetensors"))["counts"], want_counts)
    code, _, err = _train(capsys, model_dir, datasets["plain"], counted, work2, "medusa", "--val-fraction", 0.2,
                          "--steps", 2, "--loss-vocab", 8, "--resume")
    assert code == 2 and "was started with counts_from=" in err, err


def test_exported_probability_mass_is_the_base_models_before_each_trained_response_token(trained, model_dir, datasets):
    """What `--draft-vocab auto` samples from: the base model's next-token distributions summed over the
    positions whose next token is a response token of the counted examples (one window each)."""
    out, _, _, _ = trained["medusa"]  # --seq-len 32; no --counts-from: all of --data
    base = _base(model_dir)
    data = HeadDataset(datasets["plain"])
    want = np.zeros(base.cfg.vocab_size)
    targets = 0
    for batch in data.eval_batches(32, 1):
        tokens, mask = batch["tokens"], batch["loss_mask"][0].astype(bool)
        logits = np.asarray(base(jnp.asarray(tokens), jnp.arange(32)[None], causal_self_mask(1, 32)).logits[0])
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want += probs[:-1][mask[1:]].sum(0)  # position t predicts token t + 1
        targets += mask[1:].sum()
    stats = load_file(str(out / "token_counts.safetensors"))
    np.testing.assert_allclose(stats["mass"], want, rtol=1e-4, atol=1e-6)
    assert stats["mass"].sum() == pytest.approx(targets, rel=1e-4)
    assert stats["counts"].sum() >= targets  # responses cut off by the window are counted, not massed


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_draft_model_resumes_to_identical_heads(method, trained, model_dir, datasets, tmp_path, capsys,
                                                  monkeypatch):
    """Stopped after step 3 and resumed, EAGLE-1 (whose feature noise is drawn per step) and EAGLE-3
    (with its draft vocabulary) export the heads of the straight run."""
    extra = ["--draft-vocab", 40] if method == "eagle3" else []
    out, work = tmp_path / "out", tmp_path / "work"
    code, _, err = _train(capsys, model_dir, datasets[DATA_OF[method]], out, work, method, "--stop-after", 3, *extra)
    assert code == 0 and "stopped at step 3" in err, err
    code, _, err = _train(capsys, model_dir, datasets[DATA_OF[method]], out, work, method, "--resume", *extra)
    assert code == 0 and "resumed from step 3" in err, err
    a, b = load_file(str(trained[method][0] / "heads.safetensors")), load_file(str(out / "heads.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    if method == "eagle3":  # another draft vocabulary would change what the checkpoints hold
        code, _, err = _train(capsys, model_dir, datasets[DATA_OF[method]], out, work, method, "--resume")
        assert code == 2 and err.count("\n") == 1 and "was started with draft_vocab=40, not 0" in err, err
        # Nor over other token counts, which would pick other draft ids than the checkpoints were trained with.
        counted = train.token_counts
        monkeypatch.setattr(train, "token_counts", lambda tokens, mask, v: counted(tokens, mask, v) + (np.arange(v) == 7))
        code, _, err = _train(capsys, model_dir, datasets[DATA_OF[method]], out, work, method, "--resume", *extra)
        assert code == 2 and err.count("\n") == 1 and "was started with token_counts_sha256=" in err, err


@pytest.mark.parametrize("method", METHODS)
def test_a_loss_vocabulary_of_every_token_is_the_whole_vocabulary_loss(method, trained, model_dir, datasets):
    """--loss-vocab scores heads and base over a subset: with every token in it, in id order, the loss,
    per-head losses, accuracies and targets' ranks are the whole-vocabulary ones (the same computation)."""
    base = _base(model_dir)
    batch = _batches(datasets[DATA_OF[method]])
    heads = load_heads(trained[method][0], base, method)
    every = DraftVocab.most_frequent(base.lm_head_weight(), None, base.cfg.vocab_size)
    whole = train.head_loss(heads, base, batch, with_ranks=True)
    subset = train.head_loss(heads, base, batch, with_ranks=True, vocab=every)
    np.testing.assert_allclose(subset[0], whole[0], rtol=1e-5)
    for name in ("head_loss", "top1", "top5"):
        np.testing.assert_allclose(subset[1][name], whole[1][name], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(subset[1]["ranks"], whole[1]["ranks"])


@pytest.mark.parametrize("method", ["medusa", "clover2", "eagle"])
def test_a_loss_vocabulary_scores_only_its_tokens(method, trained, model_dir, datasets):
    """A target outside the subset is no target of the loss, and a miss in the accuracies (as in
    decoding): only tokens of the subset are ever hit, and a subset of tokens the responses never use
    has no loss and no hit."""
    base = _base(model_dir)
    batch = _batches(datasets[DATA_OF[method]])
    heads = load_heads(trained[method][0], base, method)
    counts = token_counts(np.asarray(batch["tokens"]).ravel(), np.asarray(batch["loss_mask"]).ravel(),
                          base.cfg.vocab_size)
    half = DraftVocab.most_frequent(base.lm_head_weight(), counts, int((counts > 0).sum()) // 2)
    loss, m = train.head_loss(heads, base, batch, vocab=half, with_ranks=True)
    assert np.isfinite(float(loss)) and float(loss) > 0
    targets, _ = targets_and_masks(batch["tokens"], batch["loss_mask"], heads.num_heads)
    assert not np.isin(np.asarray(targets)[np.asarray(m["ranks"]) == 0], np.asarray(half.ids), invert=True).any()
    none = DraftVocab.most_frequent(base.lm_head_weight(), -counts, 8)  # eight tokens the responses never use
    assert not np.isin(np.asarray(none.ids), np.flatnonzero(counts)).any()
    loss, m = train.head_loss(heads, base, batch, vocab=none)
    if method != "eagle":  # EAGLE-1's feature regression counts only where a target is
        assert float(loss) == 0.0
    np.testing.assert_array_equal(m["top1"], 0.0)


# case -> (what the one line says, what the run is given instead: data, base, method, extra flags, a file
# that --out or --work-dir is to be made under); {tmp} is the test's folder.
BAD_INPUT = {
    "missing dir": ("no such dataset directory", dict(data="nope")),
    "empty dir": ("no meta.json", dict(data="empty")),
    "foreign meta": ("not a meta.json written by train.make_data", dict(data="foreign")),
    "other base": ("made with another base model", dict(base="other")),
    "seq-len too long": ("exceeds the base model's context", dict(extra=["--seq-len", 65])),
    "zero steps": ("--steps must be >= 1", dict(extra=["--steps", 0])),
    "draft vocab of heads": ("--draft-vocab is EAGLE-3's own lm_head; clover drafts from the base model's",
                             dict(extra=["--draft-vocab", 8])),
    "loss vocab of eagle3": ("EAGLE-3 scores its own draft vocabulary; set its size with --draft-vocab",
                             dict(method="eagle3", extra=["--loss-vocab", 8])),
    "loss vocab too large": ("--loss-vocab 100000 must be in [1, ", dict(extra=["--loss-vocab", 100000])),
    "out under a file": ("--out: cannot create the folder {tmp}/a-file/heads: {tmp}/a-file is a file",
                         dict(under_file="out")),  # refused before any training, not when the heads are saved
    "work dir under a file": ("--work-dir: cannot create the folder {tmp}/a-file/work: {tmp}/a-file is a file",
                              dict(under_file="work")),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_error_line_and_exit_2(case, model_dir, other_base, datasets, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "meta.json").write_text('{"created_by": "someone else"}')
    (tmp_path / "a-file").write_text("")
    needle, given = BAD_INPUT[case]
    data = tmp_path / given["data"] if "data" in given else datasets["plain"]
    base = other_base if given.get("base") else model_dir
    out, work = tmp_path / "out", tmp_path / "work"
    if given.get("under_file") == "out":
        out = tmp_path / "a-file" / "heads"
    elif given.get("under_file") == "work":
        work = tmp_path / "a-file" / "work"
    code, stdout, err = _train(capsys, base, data, out, work, given.get("method", "clover"), *given.get("extra", []))
    assert (code, stdout) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert needle.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "out").exists()


def test_exported_heads_drive_generation(trained, model_dir, capsys):
    """Greedy speculative decoding with each method's trained heads prints the plain text."""
    base = _base(model_dir)
    argv = ["--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", 8]
    capsys.readouterr()
    assert generate.main([str(a) for a in argv]) == 0
    plain = capsys.readouterr().out
    assert plain.strip()
    for method in METHODS:
        out = trained[method][0]
        heads = load_heads(out, base, method)
        assert heads.num_heads == NUM_HEADS and heads.hcfg.method == method
        code = generate.main([str(a) for a in argv + ["--method", method, "--heads", out]])
        stdout, err = capsys.readouterr()
        assert (code, stdout) == (0, plain), err
        assert err.startswith(f"[{method}]"), err


def test_evaluate_measures_exported_heads_as_training_did(trained, model_dir, datasets, tmp_path, capsys):
    """train.evaluate on the heads' own data and settings (read from heads.json) gives the held-out
    figures train.train exported with them (float32 heads)."""
    out, _, _, _ = trained["medusa"]
    report = tmp_path / "medusa.json"
    capsys.readouterr()
    assert evaluate.main(["--heads", str(out), "--base", str(model_dir), "--data", str(datasets["plain"]),
                          "--json", str(report)]) == 0
    assert "chain tau through 1, 2, ... heads" in capsys.readouterr().out
    got, want = json.loads(report.read_text()), json.loads((out / "heads.json").read_text())["held_out"]
    assert (got["split"], got["seq_len"], got["batch_size"], got["val_fraction"]) == ("held-out", 32, 2, 0.2)
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-5)
    np.testing.assert_allclose(got["val_top1"], want["val_top1"], rtol=1e-5)
    assert got["val_chain_tau_by_depth"] == want["val_chain_tau_by_depth"]
    assert "evaluated" not in json.loads((out / "heads.json").read_text())  # no --record: heads.json untouched


def test_evaluate_records_the_chain_tau_by_depth_that_auto_picks_its_chain_by(trained, model_dir, datasets,
                                                                               tmp_path, capsys):
    """Heads exported with no held-out figures (here EAGLE-3 trained with none held out; the shipped
    heads from before train.train recorded the tau per depth) gain them with --record, beside what
    train.train wrote, and `held_out_chain_tau` reads them; EAGLE-3 drafts from its own vocabulary."""
    heads = tmp_path / "eagle3"
    shutil.copytree(trained["eagle3"][0], heads)
    before = json.loads((heads / "heads.json").read_text())
    assert held_out_chain_tau(heads) is None
    capsys.readouterr()
    assert evaluate.main(["--heads", str(heads), "--base", str(model_dir), "--data", str(datasets["plain"]),
                          "--split", "all", "--record"]) == 0
    after = json.loads((heads / "heads.json").read_text())
    assert {k: v for k, v in after.items() if k != "evaluated"} == before
    taus = after["evaluated"]["val_chain_tau_by_depth"]
    assert len(taus) == NUM_HEADS and taus == sorted(taus) and held_out_chain_tau(heads) == taus
    assert after["evaluated"]["split"] == "all" and after["evaluated"]["data"] == str(datasets["plain"])
    sampled = after["evaluated"]["val_sampled_chain_tau_by_depth"]["1"]
    assert len(sampled) == NUM_HEADS and all(1 <= t <= 1 + NUM_HEADS for t in sampled)
    # Recording again on the same data keeps what it did not measure again: a tree replayed before.
    assert evaluate.main(["--heads", str(heads), "--base", str(model_dir), "--data", str(datasets["plain"]),
                          "--split", "all", "--tree", "chain:2", "--record"]) == 0
    assert evaluate.main(["--heads", str(heads), "--base", str(model_dir), "--data", str(datasets["plain"]),
                          "--split", "all", "--record"]) == 0
    again = json.loads((heads / "heads.json").read_text())["evaluated"]
    assert list(again["val_tree_tau"]) == ["chain:2"] and again["val_chain_tau_by_depth"] == taus


def test_evaluate_fits_a_tree_that_default_then_drafts(trained, model_dir, datasets, tmp_path, capsys):
    """--tree replays decoding on a static tree (a chain as the held-out chain tau does); --fit-tree N
    fits an N-node tree, which --record writes beside the heads as tree.json, and `--tree default`
    (infer.generate's, train.evaluate's) drafts from then on; `paper` stays the method's paper tree."""
    heads = tmp_path / "clover2"
    shutil.copytree(trained["clover2"][0], heads)
    data = ["--base", str(model_dir), "--data", str(datasets["hidden"]), "--split", "all"]
    capsys.readouterr()
    assert evaluate.main(["--heads", str(heads), *data, "--tree", f"chain:{NUM_HEADS}", "--tree", "paper",
                          "--fit-tree", "6", "--record"]) == 0
    assert "tree fit:6 (6 nodes" in capsys.readouterr().out
    got = json.loads((heads / "heads.json").read_text())["evaluated"]
    assert got["val_tree_tau"][f"chain:{NUM_HEADS}"] == got["val_chain_tau"]
    assert set(got["val_tree_tau"]) == {f"chain:{NUM_HEADS}", "paper", "fit:6"}
    fitted = load_fitted_tree(heads, NUM_HEADS)
    assert fitted.num_nodes == 6 and (0,) in fitted.paths
    base = _base(model_dir)
    gen = factory.make_generator(base, "clover2", model_path=str(model_dir), heads=str(heads), tree="default")
    assert gen.tree == fitted
    assert factory.make_generator(base, "clover2", model_path=str(model_dir), heads=str(heads),
                                  tree="paper").tree == resolve_tree("paper", "clover2", NUM_HEADS)
    assert evaluate.main(["--heads", str(heads), *data, "--tree", "default", "--tree", "fitted"]) == 0
    again = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  tree ")]
    assert again[0].replace("default", "fitted") == again[1]  # the same tree, the same replay


@pytest.mark.parametrize("case", ["no heads", "another base", "zero batches", "json in no folder", "dynamic tree",
                                  "no fitted tree", "tree out in no folder", "tree out without a fit",
                                  "a one-node tree"])
def test_evaluate_bad_input_is_one_error_line(case, trained, model_dir, other_base, datasets, tmp_path, capsys):
    out = trained["medusa"][0]
    argv = {"no heads": ["--heads", tmp_path, "--base", model_dir, "--data", datasets["plain"]],
            "another base": ["--heads", out, "--base", other_base, "--data", datasets["plain"]],
            "zero batches": ["--heads", out, "--base", model_dir, "--data", datasets["plain"], "--eval-batches", 0],
            "json in no folder": ["--heads", out, "--base", model_dir, "--data", datasets["plain"],
                                  "--json", tmp_path / "missing" / "figures.json"],
            "dynamic tree": ["--heads", out, "--base", model_dir, "--data", datasets["plain"], "--tree", "dynamic:8"],
            "no fitted tree": ["--heads", out, "--base", model_dir, "--data", datasets["plain"], "--tree", "fitted"],
            "tree out in no folder": ["--heads", out, "--base", model_dir, "--data", datasets["plain"], "--fit-tree", 4,
                                      "--tree-out", tmp_path / "missing" / "tree.json"],
            "tree out without a fit": ["--heads", out, "--base", model_dir, "--data", datasets["plain"],
                                       "--tree-out", tmp_path / "tree.json"],
            "a one-node tree": ["--heads", out, "--base", model_dir, "--data", datasets["plain"], "--fit-tree", 1]}
    capsys.readouterr()
    assert evaluate.main([str(a) for a in argv[case]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
