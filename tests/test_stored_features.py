"""`train.make_data --store-features`: the inner layers EAGLE-3 drafts from, stored beside the hidden
states so that its training runs no base forward. Checked against the model's own forward, and the
training loss from stored features against the one from a forward pass."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.io.hf import load_pretrained
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.eagle3 import eagle3_layers
from clover_jax.model.llama import causal_self_mask
from conftest import tiny_llama_checkpoint
from train import make_data, train
from train.data import HeadDataset

RECORDS = [{"prompt": "def add(a, b):", "response": "\n    return a + b\n"},
           {"prompt": "class Point:", "response": "\n    def __init__(self, x):\n        self.x = x\n" * 3},
           {"prompt": "import os", "response": "\nprint(os.getcwd())"}]
LAYERS = 7  # eagle3_layers(7) = (1, 2, 3): three different layers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def data_dirs(model_dir, tmp_path_factory):
    """{"hidden": fixed responses with float16 hidden states, "features": the same with the inner layers}."""
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = {}
    for name, extra in (("hidden", []), ("features", ["--store-features"])):
        out[name] = tmp_path_factory.mktemp(name)
        assert make_data.main([f"--base={model_dir}", f"--prompts={prompts}", f"--out={out[name]}", "--mode=fixed",
                               "--batch-size=2", "--store-hidden=float16", *extra]) == 0
    return out


def test_stored_features_are_the_inner_layers_of_one_forward(model_dir, data_dirs):
    model = load_pretrained(model_dir)[1]
    layers = eagle3_layers(LAYERS)
    data = HeadDataset(data_dirs["features"])
    assert data.feature_layers == layers
    assert json.loads((data_dirs["features"] / "meta.json").read_text())["feature_layers"] == list(layers)
    assert data.features.shape == (len(data.tokens), 3, 32) and data.features.dtype == np.float16
    assert HeadDataset(data_dirs["hidden"]).features is None
    assert not (data_dirs["hidden"] / "features.npy").exists()
    for e in range(data.num_examples):
        a, b = data.offsets[e], data.offsets[e + 1]
        tokens = jnp.asarray(data.tokens[a:b])[None]
        t = int(b - a)
        out = nnx.jit(lambda m, x: m(x, jnp.arange(t, dtype=jnp.int32)[None], causal_self_mask(1, t),
                                     with_logits=False, feature_layers=layers))(model, tokens)
        np.testing.assert_allclose(data.features[a:b].astype(np.float32), np.asarray(out.features[0]),
                                   atol=3e-3, rtol=3e-3)
        np.testing.assert_allclose(data.hidden[a:b].astype(np.float32), np.asarray(out.hidden[0]),
                                   atol=3e-3, rtol=3e-3)
    batch = data.batch_at(0, 2, 16)
    assert batch["features"].shape == (2, 16, 3, 32)
    for row, n in enumerate(batch["lengths"]):
        start = int(batch["positions"][row, 0])
        e = next(e for e in range(data.num_examples)
                 if np.array_equal(data.tokens[data.offsets[e] + start:][:n], batch["tokens"][row, :n]))
        np.testing.assert_array_equal(batch["features"][row, :n],
                                      data.features[data.offsets[e] + start:][:n])


def test_eagle3_loss_from_stored_features_is_the_forwards(model_dir, data_dirs):
    """The same batch scored from stored (float16) layers and from a base forward: the same loss and
    per-head losses, to float16's rounding."""
    base = load_pretrained(model_dir)[1]
    heads = make_heads(drafter_config("eagle3", 3), base, seed=0)
    batch = {k: jnp.asarray(v) for k, v in HeadDataset(data_dirs["features"]).batch_at(0, 2, 16).items()
             if v is not None}
    stored = train.head_loss(heads, base, batch)
    forward = train.head_loss(heads, base, {k: v for k, v in batch.items() if k not in ("hidden", "features")})
    np.testing.assert_allclose(stored[0], forward[0], rtol=2e-3)
    np.testing.assert_allclose(stored[1]["head_loss"], forward[1]["head_loss"], rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("data", ["features", "hidden"])
def test_training_says_when_it_runs_the_base_for_inner_layers(data, model_dir, data_dirs, tmp_path, capsys):
    capsys.readouterr()
    argv = ["--method", "eagle3", "--base", model_dir, "--data", data_dirs[data], "--out", tmp_path / "out",
            "--work-dir", tmp_path / "work", "--steps", 2, "--batch-size", 2, "--seq-len", 16, "--dtype", "float32",
            "--warmup", 1, "--num-heads", 2, "--val-fraction", 0]
    assert train.main([str(a) for a in argv]) == 0
    err = capsys.readouterr().err
    assert ("each step runs the base model" in err) == (data == "hidden")


def test_store_features_without_hidden_is_one_line(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(RECORDS[0]) + "\n")
    capsys.readouterr()
    assert make_data.main([f"--base={model_dir}", f"--prompts={prompts}", f"--out={tmp_path / 'out'}",
                           "--mode=fixed", "--store-features"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--store-hidden" in err[0]
