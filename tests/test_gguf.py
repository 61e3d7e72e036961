"""GGUF import: tiny files written here with gguf.GGUFWriter (Llama and Qwen2 layouts, several tensor
types) load through `gguf_checkpoint` and match the same file loaded by `transformers`; bad files are one
error line and leave nothing in the cache."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from clover_jax.io.hf import load_pretrained
from clover_jax.errors import CloverError
from clover_jax.io.gguf import gguf_checkpoint, unpermute_rope_rows
from clover_jax.model.llama import causal_self_mask
from clover_jax import _cli as cli
from clover_jax.io import tokenization
from gguf_files import add_tensor, gguf_writer, hf_tensors

TOKENS = [chr(33 + i) for i in range(64)]  # one printable character per id, all in the byte-level alphabet
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order, as its converter writes it (the inverse of what we undo)."""
    h2 = w.shape[0] // heads // 2
    return w.reshape(heads, 2, h2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, path, qtype: Q, arch: str = "llama", tokens=TOKENS) -> None:
    """hf_model's weights as a GGUF file of `arch`, its matrices stored as `qtype` (norms and biases F32)."""
    c = hf_model.config
    with gguf_writer(path, arch, c, c.rope_parameters["rope_theta"], "gpt2", tokens, [1] * len(tokens),
                     bos=1, eos=2) as w:
        w.add_vocab_size(c.vocab_size)
        w.add_token_merges([])
        w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
        for name, out, a in hf_tensors(hf_model, _LAYER):
            if arch == "llama" and ".self_attn.q_proj" in name:
                a = permute_rope_rows(a, c.num_attention_heads)
            elif arch == "llama" and ".self_attn.k_proj" in name:
                a = permute_rope_rows(a, c.num_key_value_heads)
            add_tensor(w, out, a, qtype if a.ndim == 2 else Q.F32)


IDS = np.array([[1, 5, 9, 33, 17, 2, 40, 41, 12, 7, 60, 3]])


@pytest.mark.parametrize("family,arch,qtype", [("llama2", "llama", Q.F32), ("mistral", "llama", Q.F16),
                                                ("llama2", "llama", Q.Q8_0), ("qwen2", "qwen2", Q.Q4_1),
                                                ("mistral", "llama", Q.Q4_1), ("qwen2", "qwen2", Q.F32)])
def test_tiny_gguf_matches_transformers_loading_the_same_file(family, arch, qtype, hf_checkpoint, tmp_path, cache):
    from transformers import AutoModelForCausalLM

    hf, _ = hf_checkpoint(family)
    path = tmp_path / "model.gguf"
    write_gguf(hf, path, qtype, arch)
    ckpt = gguf_checkpoint(path, cache)
    _, ours = load_pretrained(ckpt)
    t = IDS.shape[1]
    got = np.asarray(ours(jnp.asarray(IDS), jnp.arange(t)[None], causal_self_mask(1, t)).logits)
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    if qtype == Q.F32:  # lossless: the original model's own logits, so the q/k rows went back where they were
        with torch.no_grad():
            orig = hf(torch.tensor(IDS)).logits.numpy()
        np.testing.assert_allclose(got, orig, atol=1e-4, rtol=0)


def test_conversion_is_cached_by_hash_and_carries_tokenizer_and_template(hf_checkpoint, tmp_path, cache, capsys):
    hf, _ = hf_checkpoint("llama2")
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, Q.F16)
    first = gguf_checkpoint(path, cache)
    assert "converting m.gguf" in capsys.readouterr().err
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_checkpoint(path, cache) == first  # found again, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert "converting" not in capsys.readouterr().err
    assert json.loads((first / "source.json").read_text())["sha256"].startswith(first.name[len("gguf-"):])
    tok = cli.load_tokenizer(first)
    assert tok("ABC", add_special_tokens=False)["input_ids"] == [TOKENS.index(c) for c in "ABC"]
    assert tokenization.render_chat(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True) == "<user>hi<assistant>"
    assert json.loads((first / "config.json").read_text())["eos_token_id"] == 2
    assert sorted(os.listdir(cache / "models")) == [first.name]  # no temporary left behind


def test_tokenizer_converter_naming_special_tokens_itself(hf_checkpoint, tmp_path, cache, monkeypatch):
    """transformers 5.17's GGUF tokenizer converter returns bos_token among its extra arguments (5.24's does
    not): the conversion must not pass it twice (it failed so on the H100's image), and the GGUF's own
    special tokens win over the converter's."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    real = mapping.convert_gguf_tokenizer

    def like_5_17(arch, spec):
        backend, extra = real(arch, spec)
        return backend, {**extra, "bos_token": TOKENS[5], "eos_token": TOKENS[6]}

    monkeypatch.setattr(mapping, "convert_gguf_tokenizer", like_5_17)
    hf, _ = hf_checkpoint("llama2")
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, Q.F16)
    tok = cli.load_tokenizer(gguf_checkpoint(path, cache))
    assert (tok.bos_token, tok.eos_token) == (TOKENS[1], TOKENS[2])


def test_unpermute_inverts_llama_cpp_order():
    w = np.arange(4 * 8 * 3).reshape(32, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not np.array_equal(permute_rope_rows(w, 4), w)


def _bad_file(kind: str, hf, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        write_gguf(hf, path, Q.F16)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "architecture":
        write_gguf(hf, path, Q.F16, arch="phi3")
    elif kind == "tensor-type":
        write_gguf(hf, path, Q.Q8_0)
        data = bytearray(path.read_bytes())
        # The first quantized tensor's type field: its info record is name, n_dims (u32), dims (u64 each),
        # type (u32), offset (u64); rewrite Q8_0 (8) as a type no gguf version knows.
        name = b"token_embd.weight"
        at = data.index(name) + len(name)
        n_dims = int.from_bytes(data[at:at + 4], "little")
        at += 4 + 8 * n_dims
        assert int.from_bytes(data[at:at + 4], "little") == Q.Q8_0
        data[at:at + 4] = (250).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    elif kind == "not-gguf":
        path.write_bytes(b"not a gguf file at all" * 10)
    return path


@pytest.mark.parametrize("kind,words", [("truncated", "truncated"), ("architecture", "'phi3' is not supported"),
                                        ("tensor-type", "a tensor of a type"), ("not-gguf", "not a readable GGUF")])
def test_bad_gguf_is_one_line_and_leaves_the_cache_empty(kind, words, hf_checkpoint, tmp_path, cache):
    hf, _ = hf_checkpoint("llama2")
    path = _bad_file(kind, hf, tmp_path)
    with pytest.raises(CloverError) as e:
        gguf_checkpoint(path, cache)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not cache.exists() or not any(cache.rglob("*"))


def test_generate_takes_a_gguf_file(hf_checkpoint, tmp_path, cache, capsys):
    from infer import generate

    hf, _ = hf_checkpoint("llama2")
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path, Q.F16)
    assert generate.main(["--model", str(path), "--prompt", "ABC", "--max-new-tokens", "4"]) == 0
    assert "[plain] new_tokens=4" in capsys.readouterr().err
