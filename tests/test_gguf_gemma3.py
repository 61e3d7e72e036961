"""GGUF import of Gemma 3 (llama.cpp's `gemma3` architecture) on tiny files written here the way
llama.cpp's converter writes one: norms stored as 1 + w, q/k rows as they are, no window pattern, local
RoPE base or score scale in the metadata. The checkpoint directory it becomes must be the original
model again to transformers' Gemma3ForCausalLM, and, quantized, what transformers' own GGUF loader
makes of the same file; our decoder must match it too. The real 270M file: tests/test_gemma3_real.py."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from clover_jax.errors import CloverError
from clover_jax.io.gguf import gguf_checkpoint
from clover_jax.io.gguf_gemma3 import LAYER_TENSORS
from gguf_files import add_tensor, gguf_writer, hf_tensors

# Sentencepiece pieces as a Gemma file lists them: pad, eos, bos, unk first, then single characters.
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + ["\u2581"] + [chr(97 + i) for i in range(26)] + [
    "\u2581" + chr(97 + i) for i in range(26)] + ["\n", ".", ",", "!", "?", "-", "'"]
VOCAB = len(TOKENS)
WINDOW = 4
IDS = np.array([[2, 9, 33, 17, 40, 41, 12, 7, 60, 3, 22, 5, 31, 44]])  # longer than the window
_GGUF_NAMES = {hf: gg for gg, hf in LAYER_TENSORS.items()}


def tiny_gemma3(seed: int = 0, layers: int = 6, head_dim: int = 16) -> Gemma3ForCausalLM:
    """A random float32 Gemma 3 whose config is what llama.cpp's loader gives any gemma3 file: every
    sixth layer global, local RoPE base 10000, query_pre_attn_scalar = head_dim; norm weights away
    from 0 (so a missed 1 + w shows) and logits of order one."""
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=WINDOW,
        layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model


def write_gemma3_gguf(model, path, qtype: Q = Q.F32, drop: str | None = None) -> None:
    """`model` as llama.cpp's converter writes a Gemma 3: its matrices as `qtype` (norms F32, as 1 + w);
    `drop`: a GGUF tensor name left out."""
    c = model.config
    types = [3, 3, 3, 2] + [1] * (VOCAB - 4)  # control, unknown, normal
    with gguf_writer(path, "gemma3", c, c.rope_parameters["full_attention"]["rope_theta"], "llama", TOKENS, types,
                     bos=2, eos=1) as w:
        w.add_sliding_window(c.sliding_window)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        for name, out, a in hf_tensors(model, _GGUF_NAMES):
            if out == drop:
                continue
            if name.endswith("norm.weight"):
                add_tensor(w, out, a + np.float32(1), Q.F32)
            else:
                add_tensor(w, out, a, qtype)


def _logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_config_says_what_llama_cpp_assumes_of_every_gemma3_file(tmp_path, cache):
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(tiny_gemma3(layers=7), path)
    cfg = json.loads((gguf_checkpoint(path, cache) / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (cfg["sliding_window"], cfg["head_dim"], cfg["query_pre_attn_scalar"], cfg["rms_norm_eps"]) == (WINDOW, 16, 16, 1e-6)
    assert cfg["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"], cfg["rope_scaling"]) == (1e6, 1e4, None)
    assert (cfg["hidden_activation"], cfg["tie_word_embeddings"], cfg["final_logit_softcapping"]) == ("gelu_pytorch_tanh", True, None)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["vocab_size"]) == (2, 1, 0, VOCAB)


def test_a_lossless_file_converts_back_to_the_original_model(tmp_path, cache):
    """F32 storage loses nothing: transformers reads our directory as the model the file was written
    from (norms back to w, q/k rows untouched, windows and RoPE bases as they were), over more tokens
    than the window; and the tokenizer adds Gemma's <bos>."""
    from transformers import AutoTokenizer

    model = tiny_gemma3()
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(model, path)
    ckpt = gguf_checkpoint(path, cache)
    back = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    assert isinstance(back, Gemma3ForCausalLM)
    np.testing.assert_allclose(_logits(back), _logits(model), atol=1e-5, rtol=0)
    assert float(np.abs(_logits(model)).max()) > 0.5  # logits of order one: the comparison is not of zeros
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert tok("ab c")["input_ids"] == [2, TOKENS.index("a"), TOKENS.index("b"), TOKENS.index("\u2581c")]


def test_a_quantized_file_matches_transformers_loading_it(tmp_path, cache):
    """transformers' GGUF loader leaves query_pre_attn_scalar at its default, 256, where llama.cpp (and
    we) take head_dim: equal for every released Gemma 3 but the 27B, and so here."""
    model = tiny_gemma3(seed=3, head_dim=256)
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(model, path, Q.Q8_0)
    ours = AutoModelForCausalLM.from_pretrained(str(gguf_checkpoint(path, cache)), dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    np.testing.assert_allclose(_logits(ours), _logits(ref), atol=1e-5, rtol=0)
    assert not np.allclose(_logits(ours), _logits(model), atol=1e-5)  # it was quantized


def test_our_decoder_reads_the_converted_file_as_transformers_does(tmp_path, cache):
    from clover_jax.io.hf import load_pretrained
    from clover_jax.model.llama import causal_self_mask

    model = tiny_gemma3(seed=5)
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(model, path, Q.Q8_0)
    ckpt = gguf_checkpoint(path, cache)
    _, ours = load_pretrained(ckpt)
    t = IDS.shape[1]
    got = np.asarray(ours(jnp.asarray(IDS), jnp.arange(t)[None], causal_self_mask(1, t)).logits)
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    np.testing.assert_allclose(got, _logits(ref), atol=1e-4, rtol=0)


def test_a_file_missing_a_layer_tensor_is_one_line_and_leaves_nothing(tmp_path, cache):
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(tiny_gemma3(), path, drop="blk.2.attn_k_norm.weight")
    with pytest.raises(CloverError) as e:
        gguf_checkpoint(path, cache)
    assert "model.layers.2.self_attn.k_norm.weight is missing" in str(e.value) and "\n" not in str(e.value)
    assert not cache.exists() or not any(cache.rglob("*"))
