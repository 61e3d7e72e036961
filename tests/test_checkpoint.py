"""Heads on disk: exact round trip, and one clear line for every wrong heads directory."""

import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from clover_jax.io.heads_dir import CONFIG, WEIGHTS, base_fingerprint, held_out_chain_tau, load_heads, save_heads
from clover_jax.model.config import ModelConfig
from clover_jax.io.hf import save_pretrained
from clover_jax.errors import CloverError
from clover_jax.io.files import atomic_path, write_text
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.llama import Llama


@pytest.fixture(scope="module")
def base():
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("method", ["medusa", "clover", "clover2", "eagle", "eagle3"])
def test_round_trip_is_exact(method, base, tmp_path):
    heads = make_heads(drafter_config(method, 3, draft_vocab=20 if method == "eagle3" else 0), base, seed=7)
    if method == "eagle3":  # its draft token ids are saved with its parameters
        heads.set_vocab(base, jnp.arange(20, dtype=jnp.int32) * 3)
    save_heads(heads, base, tmp_path, extra={"note": "x"})
    loaded = load_heads(tmp_path, base, method)
    for a, b in zip(jax.tree.leaves(nnx.state(heads)), jax.tree.leaves(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    meta = json.loads((tmp_path / "heads.json").read_text())
    assert meta["base_fingerprint"] == base_fingerprint(base) and meta["note"] == "x"
    assert not list(tmp_path.glob("*.tmp"))


def test_saved_files_take_the_umask_like_any_new_file(base, tmp_path):
    """safetensors creates files owner-only; exported heads and models are readable as the umask says."""
    old = os.umask(0o022)
    try:
        save_heads(make_heads(drafter_config("medusa", 1), base), base, tmp_path / "heads")
        save_pretrained(base, tmp_path / "model")
    finally:
        os.umask(old)
    for f in ("heads/heads.safetensors", "heads/heads.json", "model/model.safetensors", "model/config.json"):
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == 0o644, f


def test_fingerprint_ignores_dtype_but_not_weights(base):
    assert base_fingerprint(base) == base_fingerprint(
        nnx.merge(*nnx.split(base))) != base_fingerprint(Llama(base.cfg, rngs=nnx.Rngs(1)))
    as_bf16 = nnx.merge(nnx.split(base)[0], jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.split(base)[1]))
    assert base_fingerprint(as_bf16) == base_fingerprint(base)


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("method", ["clover", "eagle3"])
def test_wrong_base_and_wrong_method_are_refused(base, tmp_path, method):
    save_heads(make_heads(drafter_config(method, 2), base), base, tmp_path)
    with pytest.raises(CloverError, match="trained for another base model") as err:
        load_heads(tmp_path, Llama(base.cfg, rngs=nnx.Rngs(3)))
    _one_line(err)
    with pytest.raises(CloverError, match=f"holds {method} heads, not medusa") as err:
        load_heads(tmp_path, base, "medusa")
    _one_line(err)


@pytest.mark.parametrize("damage, message", [
    ("no_json", "no heads.json"),
    ("bad_json", "not a valid heads config"),
    ("bad_method", "not a valid heads config|unknown method"),
    ("no_weights", "cannot read heads.safetensors"),
    ("missing_tensor", "lacks tensor"),
    ("extra_tensor", "has unexpected tensor"),
    ("misshaped_tensor", "has shape"),
])
def test_damaged_heads_directory_is_one_clear_line(damage, message, base, tmp_path):
    save_heads(make_heads(drafter_config("medusa", 2), base), base, tmp_path)
    meta_path, weights_path = tmp_path / "heads.json", tmp_path / WEIGHTS
    tensors = load_file(str(weights_path))
    name = sorted(tensors)[0]
    if damage == "no_json":
        meta_path.unlink()
    elif damage == "bad_json":
        meta_path.write_text("{not json")
    elif damage == "bad_method":
        meta = json.loads(meta_path.read_text())
        meta["heads"]["method"] = "eagle-9"
        meta_path.write_text(json.dumps(meta))
    elif damage == "no_weights":
        weights_path.unlink()
    elif damage == "missing_tensor":
        save_file({k: v for k, v in tensors.items() if k != name}, str(weights_path))
    elif damage == "extra_tensor":
        save_file({**tensors, "stray.weight": np.zeros(3, np.float32)}, str(weights_path))
    elif damage == "misshaped_tensor":
        save_file({**tensors, name: np.zeros(tensors[name].shape + (2,), np.float32)}, str(weights_path))
    with pytest.raises(CloverError, match=message) as err:
        load_heads(tmp_path, base)
    _one_line(err)


def test_draft_ids_outside_the_vocabulary_are_one_clear_line(base, tmp_path):
    save_heads(make_heads(drafter_config("eagle3", 2, draft_vocab=8), base), base, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS))
    save_file({**tensors, "ids": np.arange(8, dtype=np.int32) + base.cfg.vocab_size - 4}, str(tmp_path / WEIGHTS))
    with pytest.raises(CloverError, match="draft token ids .* not distinct ids of the vocabulary") as err:
        load_heads(tmp_path, base)
    _one_line(err)


def test_eagle3_heads_name_their_feature_layers_and_old_ones_keep_theirs(base, tmp_path):
    """New EAGLE-3 heads draft from the authors' layers and heads.json says so; a heads.json written
    before it named them loads with the layers those heads were trained on (one higher)."""
    from clover_jax.drafters.eagle3 import eagle3_layers, legacy_eagle3_layers

    save_heads(make_heads(drafter_config("eagle3", 2), base), base, tmp_path)
    meta = json.loads((tmp_path / CONFIG).read_text())
    layers = eagle3_layers(base.cfg.num_layers)
    assert meta["heads"]["aux_layer_ids"] == list(layers) and load_heads(tmp_path, base).feature_layers == layers
    del meta["heads"]["aux_layer_ids"]
    (tmp_path / CONFIG).write_text(json.dumps(meta))
    assert load_heads(tmp_path, base).feature_layers == legacy_eagle3_layers(base.cfg.num_layers)
    with pytest.raises(CloverError, match="aux_layer_ids .* layers the .*-layer base model does not have") as err:
        make_heads(drafter_config("eagle3", 2, aux_layer_ids=(0, 1, base.cfg.num_layers)), base)
    _one_line(err)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    """files.atomic_path: the file is replaced only by a write that finished; one that raised (an error, a
    Ctrl-C) leaves what was there, and no NAME.tmp beside it."""
    path = tmp_path / "meta.json"
    write_text(path, "old\n")
    for interrupt in (OSError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(interrupt)), atomic_path(path) as tmp:
            tmp.write_text("half")
            raise interrupt
        assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and path.read_text() == "old\n"
        tmp.write_text("new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]
    write_text(tmp_path / "made" / "deeper" / "x.json", "{}\n")  # a missing folder is made
    assert (tmp_path / "made" / "deeper" / "x.json").read_text() == "{}\n"


def test_held_out_chain_tau_is_read_from_heads_json_or_refused_in_one_line(tmp_path):
    """`--tree auto` on a CPU picks its chain depth by the tau train.train recorded per depth; heads
    without the record (older exports, random heads) give None, a damaged one a line saying what to do."""
    meta = {"heads": {"method": "clover2", "num_heads": 3}, "held_out": {"val_chain_tau": 1.5}}
    (tmp_path / CONFIG).write_text(json.dumps(meta))
    assert held_out_chain_tau(tmp_path) is None and held_out_chain_tau(None) is None
    meta["held_out"]["val_chain_tau_by_depth"] = [1.3, 1.45, 1.5]
    (tmp_path / CONFIG).write_text(json.dumps(meta))
    assert held_out_chain_tau(tmp_path) == [1.3, 1.45, 1.5]
    meta["held_out"]["val_chain_tau_by_depth"] = [1.3, "high"]
    (tmp_path / CONFIG).write_text(json.dumps(meta))
    with pytest.raises(CloverError, match="val_chain_tau_by_depth should be a list of numbers >= 1"):
        held_out_chain_tau(tmp_path)
