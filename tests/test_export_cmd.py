"""`python -m train.export` and `train.train --export-format`: trained heads written in published drafter
formats, read back by the format's own loader (`clover_jax.io.formats`) to the same drafts; bad
requests one line, exit 2, refused before anything is trained or written. `--export-dtype bfloat16`
stores bfloat16 weights that load for a float32 base."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from clover_jax.io import formats
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.io.heads_dir import load_heads, save_heads
from clover_jax.io.hf import load_pretrained
from clover_jax.model.llama import causal_self_mask
from test_train import DATA_OF, _argv, _train
from train import export, train


@pytest.fixture(scope="module")
def data(datasets):
    return datasets["plain"]


@pytest.fixture(scope="module")
def trained(model_dir, data, tmp_path_factory):
    """A few steps of Medusa heads, exported by train.train also as Medusa-1 (comma list, repeated)."""
    root = tmp_path_factory.mktemp("train")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.main(_argv(model_dir, data, root / "heads", root / "work", "medusa", "--steps", 3,
                                "--export-format", "medusa", "--export-format", "medusa,medusa"))
    assert code == 0, err.getvalue()
    return root


def _base(model_dir):
    return load_pretrained(model_dir)[1]


def _logits(drafter, base):
    tokens = jnp.asarray([[5, 9, 40, 77, 120, 33]], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    normed = base(tokens, positions, causal_self_mask(1, 6)).hidden_normed
    return np.stack([np.asarray(drafter.node_logits(base, k, normed, None)) for k in range(drafter.depth)])


def _run(tool, capsys, *argv):
    capsys.readouterr()
    code = tool.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("method", ["clover2", "eagle3"])
def test_training_over_a_loss_vocabulary_exports_bfloat16_heads(method, model_dir, datasets, tmp_path, capsys):
    """--loss-vocab trains and exports; --export-dtype bfloat16 stores every weight in bfloat16 (token
    ids as they are), and the heads load for a float32 base model."""
    vocab = ["--loss-vocab", 24] if method == "clover2" else ["--draft-vocab", 24]
    code, out, err = _train(capsys, model_dir, datasets[DATA_OF[method]], tmp_path / "out", tmp_path / "work",
                            method, *vocab, "--export-dtype", "bfloat16")
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert meta["training"]["export_dtype"] == "bfloat16"
    stored = load_file(str(tmp_path / "out" / "heads.safetensors"))
    assert {str(a.dtype) for name, a in stored.items() if not name.endswith("ids")} == {"bfloat16"}
    assert all(a.dtype == np.int32 for name, a in stored.items() if name.endswith("ids"))
    heads = load_heads(tmp_path / "out", _base(model_dir), method)
    weights = [np.asarray(v) for v in jax.tree.leaves(nnx.state(heads, nnx.Param))]
    assert all(w.dtype == np.float32 and np.array_equal(w, w.astype(jnp.bfloat16).astype(np.float32))
               for w in weights)


def test_train_writes_the_medusa1_export_beside_its_own(trained, model_dir):
    base = _base(model_dir)
    ours = load_heads(trained / "heads", base, "medusa")
    beside = trained / "heads-medusa"
    assert sorted(p.name for p in beside.iterdir()) == ["config.json", "medusa_lm_head.safetensors"]
    config = json.loads((beside / "config.json").read_text())
    assert config["medusa_num_heads"] == ours.depth and config["base_model_name_or_path"] == str(model_dir)
    medusa = formats.module("medusa1")
    assert formats.recognise(beside) is medusa
    np.testing.assert_allclose(_logits(medusa.load(beside, base), base), _logits(ours, base), atol=1e-6, rtol=1e-6)


def test_export_command_writes_what_train_wrote(trained, model_dir, tmp_path, capsys):
    code, out, err = _run(export, capsys, "--heads", trained / "heads", "--format", "medusa", "--out", tmp_path / "m")
    assert code == 0, err
    assert "as medusa to" in out
    mine = load_file(str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    theirs = load_file(str(trained / "heads-medusa" / "medusa_lm_head.safetensors"))
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    code, _, err = _run(export, capsys, "--heads", trained / "heads", "--format", "medusa", "--out", tmp_path / "b",
                        "--base", model_dir, "--dtype", "bfloat16")
    assert code == 0, err
    stored = load_file(str(tmp_path / "b" / "medusa_lm_head.safetensors"))
    assert {str(a.dtype) for a in stored.values()} == {"bfloat16"}


def test_every_flag_of_the_export_command_is_explained():
    actions = [a for a in export.build_parser()._actions if a.option_strings != ["-h", "--help"]]
    assert {s for a in actions for s in a.option_strings} == {"--drafter", "--heads", "--format", "--out", "--base", "--verifier",
                                                                 "--dtype"}
    assert all(a.help and len(a.help) > 20 for a in actions)


@pytest.mark.parametrize("case", ["unknown format", "format of another method", "out is the heads",
                                  "out holds heads", "no heads"])
def test_a_bad_export_is_one_line_and_writes_nothing(case, trained, tmp_path, capsys):
    heads, out = trained / "heads", tmp_path / "out"
    fmt = {"unknown format": "gguf", "format of another method": "medusa"}.get(case, "medusa")
    if case == "format of another method":
        heads = tmp_path / "clover"
        heads.mkdir()
        meta = json.loads((trained / "heads" / "heads.json").read_text())
        meta["heads"]["method"] = "clover"
        (heads / "heads.json").write_text(json.dumps(meta))
    if case == "out is the heads":
        out = heads
    if case == "out holds heads":
        out.mkdir()
        (out / "heads.json").write_text("{}")
    if case == "no heads":
        heads = tmp_path / "nothing"
        heads.mkdir()
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    code, _, err = _run(export, capsys, "--heads", heads, "--format", fmt, "--out", out)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before
    said = {"unknown format": "unknown drafter format 'gguf'", "format of another method": "not Clover's",
            "out is the heads": "holds heads.json", "out holds heads": "holds heads.json", "no heads": "no heads.json"}
    assert said[case] in err, err


@pytest.mark.parametrize("flag, says", [("gguf", "unknown drafter format"), ("medusa", "not Clover's")])
def test_train_refuses_an_export_format_before_training(flag, says, model_dir, data, tmp_path, capsys):
    code, _, err = _run(train, capsys, *_argv(model_dir, data, tmp_path / "heads", tmp_path / "work", "clover",
                                              "--export-format", flag))
    assert code == 2 and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "heads").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("name, module", [("sglang", "sglang_eagle3"), ("speculators", "speculators_eagle3")])
def test_eagle3_heads_export_as_sglang_and_speculators_and_load_back_the_same(name, module, model_dir, tmp_path, capsys):
    """The export command on EAGLE-3 heads: each export is recognised as its format and reads back to our
    drafter's config, draft vocabulary and parameters."""
    base = _base(model_dir)
    ours = make_heads(drafter_config("eagle3", 3, draft_vocab=40, aux_layer_ids=(0, 0, 0)), base, seed=2)
    ours.set_vocab(base, jnp.arange(3, 43, dtype=jnp.int32))
    save_heads(ours, base, tmp_path / "heads", extra={"training": {"base": str(model_dir)}})
    code, _, err = _run(export, capsys, "--heads", tmp_path / "heads", "--format", name, "--out", tmp_path / name)
    assert code == 0, err
    assert formats.recognise(tmp_path / name) is formats.module(module)
    back = formats.load_drafter(tmp_path / name, base, "eagle3")
    assert back.hcfg.aux_layer_ids == ours.hcfg.aux_layer_ids
    np.testing.assert_array_equal(np.asarray(back.ids[...]), np.asarray(ours.ids[...]))
    want, got = (dict(nnx.to_flat_state(nnx.state(d, nnx.Param))) for d in (ours, back))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key][...]), np.asarray(want[key][...]), atol=1e-6, err_msg=str(key))


def test_a_format_that_cannot_hold_the_heads_is_refused_before_training(model_dir, data, tmp_path, capsys):
    """EAGLE-3 on a two-layer base fuses its last layer, which the published formats cannot name: the
    export is tried on the untrained drafter and refused in one line before a step runs, nothing written."""
    code, _, err = _run(train, capsys, *_argv(model_dir, data, tmp_path / "heads", tmp_path / "work", "eagle3",
                                              "--steps", 1, "--export-format", "sglang"))
    assert code == 2 and err.startswith("error: --export-format sglang: ") and err.count("\n") == 1, err
    assert "last layer" in err and "drop the flag" in err
    assert not (tmp_path / "heads").exists() and not (tmp_path / "heads-sglang").exists()
    assert not (tmp_path / "work" / "metrics.jsonl").exists()


def test_train_fine_tunes_a_published_eagle3_drafter_from_its_own_folder(model_dir, data, tmp_path, capsys):
    """--init-from a SpecForge/SGLang EAGLE-3 folder (no heads.json): the drafter trains on with its own
    feature layers and draft vocabulary, and its exported heads start from the published weights."""
    base = _base(model_dir)
    theirs = make_heads(drafter_config("eagle3", 3, draft_vocab=40, aux_layer_ids=(0, 0, 0)), base, seed=5)
    theirs.set_vocab(base, jnp.arange(3, 43, dtype=jnp.int32))
    export.export(theirs, base, tmp_path / "published", "sglang")
    assert not (tmp_path / "published" / "heads.json").exists()
    code, _, err = _run(train, capsys, *_argv(model_dir, data, tmp_path / "heads", tmp_path / "work", "eagle3",
                                              "--steps", 3, "--init-from", tmp_path / "published",
                                              "--num-heads", 7))  # a published EAGLE-3 loads drafting 7 deep
    assert code == 0, err
    tuned = load_heads(tmp_path / "heads", base, "eagle3")
    assert tuned.hcfg.aux_layer_ids == (0, 0, 0) and tuned.hcfg.draft_vocab == 40
    np.testing.assert_array_equal(np.asarray(tuned.ids[...]), np.arange(3, 43))
    run = json.loads((tmp_path / "work" / "run.json").read_text())
    assert len(run["init_from_sha256"]) == 64
    before, after = (np.asarray(d.fc.kernel[...], np.float32) for d in (theirs, tuned))
    assert 0 < np.abs(after - before).max() < 0.1  # a few small steps from the published weights, not a fresh start


def test_evaluate_measures_a_published_drafter_and_refuses_to_record_into_it(model_dir, data, tmp_path, capsys):
    from train import evaluate

    base = _base(model_dir)
    theirs = make_heads(drafter_config("eagle3", 3, draft_vocab=40, aux_layer_ids=(0, 0, 0)), base, seed=5)
    theirs.set_vocab(base, jnp.arange(3, 43, dtype=jnp.int32))
    export.export(theirs, base, tmp_path / "published", "sglang")
    argv = ["--heads", tmp_path / "published", "--base", model_dir, "--data", data, "--split", "all",
            "--seq-len", 32, "--batch-size", 2, "--eval-batches", 2]
    code, out, err = _run(evaluate, capsys, *argv, "--json", tmp_path / "figures.json")
    assert code == 0, err
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert len(figures["val_top1"]) == 7 and 0 <= figures["val_top1"][0] <= 1  # drafting 7 deep, as loaded
    before = sorted(p.name for p in (tmp_path / "published").iterdir())
    code, _, err = _run(evaluate, capsys, *argv, "--record")
    assert code == 2 and "published drafter" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (tmp_path / "published").iterdir()) == before


def test_train_fine_tunes_a_medusa1_export(trained, model_dir, data, tmp_path, capsys):
    code, _, err = _run(train, capsys, *_argv(model_dir, data, tmp_path / "heads", tmp_path / "work", "medusa",
                                              "--steps", 2, "--init-from", trained / "heads-medusa"))
    assert code == 0, err
    assert load_heads(tmp_path / "heads", _base(model_dir), "medusa").hcfg.method == "medusa"
