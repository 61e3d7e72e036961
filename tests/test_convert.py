"""Checkpoint import/export against Hugging Face, both directions, and every way a checkpoint can be
wrong (each a one-line `CloverError` naming the problem)."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from clover_jax.model.config import ModelConfig
from clover_jax.io.hf import _read_qkv, load_pretrained, save_pretrained
from clover_jax.errors import CloverError
from clover_jax.model.layers import fuse_qkv, to_stored
from conftest import FAMILY_NAMES, assert_one_line, hf_logits, random_tokens


def params(model) -> dict:
    """Every Param by path, as stored on disk: the fused q/k/v projection as HF's three tensors."""
    return {part: array for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
            for part, array in to_stored(k, np.asarray(v[...]))}


def assert_same_params(a, b) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


def hf_reload(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_import_is_exact(loaded, family):
    """Every HF tensor lands unchanged (transposed for kernels); tied checkpoints have no lm_head."""
    hf, _, cfg, model = loaded(family)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    ours = params(model)
    assert (model.lm_head is None) == cfg.tie_word_embeddings == (family == "qwen2")
    np.testing.assert_array_equal(ours[("embed_tokens", "embedding")], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours[("layers", 1, "self_attn", "k_proj", "kernel")],
                                  sd["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(ours[("norm", "weight")], sd["model.norm.weight"])
    if family == "qwen2":
        np.testing.assert_array_equal(ours[("layers", 0, "self_attn", "q_proj", "bias")],
                                      sd["model.layers.0.self_attn.q_proj.bias"])
    n_hf = sum(v.size for k, v in sd.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    assert sum(v.size for v in ours.values()) == n_hf == cfg.num_params


@pytest.mark.parametrize("index", [(slice(None),) * 4, (slice(None), slice(1, 2), slice(None), slice(None)),
                                   (slice(4, 8), slice(2, 4), slice(None), slice(None))])
def test_fused_qkv_block_reads_only_its_kv_heads(index):
    """A device's block of the fused q/k/v kernel (and bias) read from HF's three tensors equals that
    block of the whole fused parameter: a mesh splits it by kv head and by input width."""
    rng = np.random.default_rng(0)
    d, kv, g, h = 8, 4, 3, 2
    q, k, v = (rng.standard_normal((width, d)) for width in (kv * g * h, kv * h, kv * h))  # HF: [out, in]
    whole = fuse_qkv(q.T, k.T, v.T, kv)
    assert whole.shape == (d, kv, g + 2, h)
    np.testing.assert_array_equal(whole[:, 1, :g].reshape(d, g * h), q.T[:, g * h: 2 * g * h])  # kv head 1's queries
    np.testing.assert_array_equal(whole[:, 1, g + 1], v.T[:, h: 2 * h])
    np.testing.assert_array_equal(_read_qkv([q, k, v], index, whole.shape, transpose=True), whole[index])
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], kv)
    np.testing.assert_array_equal(_read_qkv([q[:, 0], k[:, 0], v[:, 0]], index[1:], bias.shape, transpose=False),
                                  bias[index[1:]])


def test_load_sharded_hf_checkpoint(loaded, tmp_path):
    hf, _, _, model = loaded("llama3-gqa4x2")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _, sharded = load_pretrained(tmp_path)
    assert_same_params(sharded, model)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_float32_reloads_in_hf(loaded, family, tmp_path):
    """save_pretrained -> HF from_pretrained gives back the same model: same logits, same config."""
    hf, _, cfg, model = loaded(family)
    save_pretrained(model, tmp_path, dtype=jnp.float32)
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    tokens = random_tokens(2, 10, seed=7)
    np.testing.assert_allclose(hf_logits(hf_reload(tmp_path), tokens), hf_logits(hf, tokens), atol=1e-5, rtol=0)


def test_export_sharded_roundtrip(loaded, tmp_path):
    hf, _, _, model = loaded("qwen2")
    save_pretrained(model, tmp_path, dtype=jnp.float32, shard_bytes=16 << 10)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert not list(tmp_path.glob("*.tmp"))
    _, again = load_pretrained(tmp_path)
    assert_same_params(again, model)
    tokens = random_tokens(1, 6, seed=8)
    np.testing.assert_allclose(hf_logits(hf_reload(tmp_path), tokens), hf_logits(hf, tokens), atol=1e-5, rtol=0)


def test_bfloat16_export_import_roundtrip(loaded, tmp_path):
    hf, _, _, model = loaded("llama3-gqa8x2")
    save_pretrained(model, tmp_path)  # bfloat16 by default
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    want = {k: np.asarray(jnp.asarray(v, jnp.bfloat16)) for k, v in params(model).items()}
    _, as_bf16 = load_pretrained(tmp_path, dtype=jnp.bfloat16)
    got = params(as_bf16)
    assert all(v.dtype == jnp.bfloat16 for v in got.values())
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    _, as_f32 = load_pretrained(tmp_path, dtype=jnp.float32)
    for k, v in params(as_f32).items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, want[k].astype(np.float32), err_msg=str(k))
    # HF reads the same bfloat16 values.
    sd = hf_reload(tmp_path).state_dict()
    np.testing.assert_array_equal(sd["model.layers.0.mlp.gate_proj.weight"].numpy(),
                                  want[("layers", 0, "mlp", "gate_proj", "kernel")].astype(np.float32).T)


# ---------------------------------------------------------------- bad checkpoints


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    """A fresh, writable copy of the llama2 checkpoint."""
    _, src = hf_checkpoint("llama2")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(path, edit) -> None:
    hf = json.loads((path / "config.json").read_text())
    edit(hf)
    (path / "config.json").write_text(json.dumps(hf))


def check_error(path, match) -> None:
    with pytest.raises(CloverError, match=match) as excinfo:
        load_pretrained(path)
    assert_one_line(excinfo)


def test_missing_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    check_error(ckpt, r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight \(expected shape \[64, 32\]\)")


def test_misshaped_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)}))
    check_error(ckpt, r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 32\], expected \[32, 32\]")


def test_extra_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(64, 32)}))
    check_error(ckpt, r"unexpected tensor model\.layers\.2\.mlp\.up_proj\.weight \(1 in all\)")


def test_old_rotary_buffers_are_ignored(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}))
    load_pretrained(ckpt)


def _set(**kv):
    return lambda hf: hf.update(kv)


BAD_CONFIGS = {
    "gpt2": (_set(model_type="gpt2"), r"model_type='gpt2' is not supported"),
    "no model_type": (lambda hf: hf.pop("model_type"), r"model_type=None is not supported"),
    "yarn": (_set(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
             r"rope_scaling type 'yarn'"),
    "yarn (old spelling)": (_set(rope_scaling={"type": "yarn", "factor": 4.0}), r"rope_scaling type 'yarn'"),
    "gelu": (_set(hidden_act="gelu"), r"unsupported field hidden_act='gelu'"),
    "mlp bias": (_set(mlp_bias=True), r"unsupported field mlp_bias=True"),
    "attention bias": (_set(attention_bias=True), r"attention_bias"),
    "quantized": (_set(quantization_config={"quant_method": "gptq"}), r"unsupported field quantization_config"),
    "softcapping": (_set(attn_logit_softcapping=50.0), r"attn_logit_softcapping=50.0"),
    "moe": (_set(num_local_experts=8), r"unsupported field num_local_experts=8"),
    "heads": (_set(num_key_value_heads=3), r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_unsupported_config(ckpt, case):
    edit, match = BAD_CONFIGS[case]
    rewrite_config(ckpt, edit)
    check_error(ckpt, match)


def test_pickle_only_checkpoint_is_refused(ckpt):
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    check_error(ckpt, r"no \*\.safetensors weights \(only pickled weights found")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    check_error(ckpt, r"config\.json: not found")


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    check_error(ckpt, r"config\.json: cannot be read as JSON")


def test_missing_directory(tmp_path):
    check_error(tmp_path / "nowhere", r"no such model directory")


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    check_error(ckpt, r"not a readable safetensors file")


def test_index_names_a_missing_shard(loaded, tmp_path):
    hf, _, _, _ = loaded("llama2")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    next(tmp_path.glob("model-*.safetensors")).unlink()
    check_error(tmp_path, r"listed in the safetensors index but missing")
