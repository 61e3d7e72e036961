"""Qwen3, Gemma 3 and the sliding windows (Gemma 3's local layers, Mistral's and Qwen2's windows)
against transformers, both directions, on tiny random models (conftest.VARIANTS): sequences longer
than the window in one pass, token by token through the KV cache, as a tree deeper than the window,
and a prefill long enough to attend in query blocks. Then config.json: each family's defaults and
older spellings, and the settings the decoder does not implement, refused in one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

from clover_jax.errors import CloverError
from clover_jax.io.hf import save_pretrained
from clover_jax.model import layers
from clover_jax.model.cache import causal_mask, tree_mask
from clover_jax.model.config import ModelConfig, rope_inv_freq
from clover_jax.model.llama import causal_self_mask
from conftest import VARIANT_NAMES, assert_one_line, hf_logits, random_tokens

TOL = 1e-4
T = 14  # tokens: more than three windows of 4


@functools.partial(jax.jit, static_argnums=(0, 6))
def _forward(graphdef, state, tokens, pos, mask, cache, causal):
    return nnx.merge(graphdef, state)(tokens, pos, mask, cache, causal=causal)


def forward(model, tokens, pos, mask, cache=None, causal=False):
    return _forward(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(pos, jnp.int32), mask, cache, causal)


def positions(batch: int, length: int) -> np.ndarray:
    return np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize("family", VARIANT_NAMES)
def test_one_pass_and_token_by_token_decoding_match_hf(loaded, family):
    """A sequence longer than the window: one cache-free pass, and a causal prefill of 5 tokens through
    a cache, then one token at a time (row 1 commits 3 of its 5, so its next tokens overwrite slots),
    every step's logits HF's full forward's at that position."""
    hf, _, cfg, model = loaded(family)
    assert cfg.model_type == hf.config.model_type and cfg.num_params == sum(p.numel() for p in hf.parameters())
    tokens = random_tokens(2, T, seed=11)
    want = hf_logits(hf, tokens)
    free = forward(model, tokens, positions(2, T), causal_self_mask(2, T))
    assert max_diff(free.logits, want) <= TOL
    s = T + 2
    cache = model.init_cache(2, s)
    out = forward(model, tokens[:, :5], positions(2, 5), causal_mask(cache.lengths, 5, s), cache, causal=True)
    assert max_diff(out.logits[0], want[0, :5]) <= TOL and max_diff(out.logits[1, :3], want[1, :3]) <= TOL
    cache = out.cache.advance(jnp.array([5, 3]))
    rows = np.arange(2)
    ext = np.concatenate([tokens, random_tokens(2, 2, seed=12)], 1)  # row 0, two ahead, runs past T unchecked
    for _ in range(T - 3):
        pos = np.asarray(cache.lengths)
        out = forward(model, ext[rows, pos][:, None], pos[:, None], causal_mask(cache.lengths, 1, s), cache)
        live = pos < T
        assert max_diff(np.asarray(out.logits)[live, 0], want[rows[live], pos[live]]) <= TOL, pos
        cache = out.cache.advance(jnp.ones(2, jnp.int32))


@pytest.mark.parametrize("family", VARIANT_NAMES)
def test_export_loads_in_transformers(loaded, family, tmp_path):
    """Ours written with save_pretrained is read by transformers into the same model (same logits) and
    by us into the same config."""
    hf, _, cfg, model = loaded(family)
    save_pretrained(model, tmp_path, dtype=jnp.float32)
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(again) is type(hf)
    assert getattr(again.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    tokens = random_tokens(2, 10, seed=7)
    np.testing.assert_allclose(hf_logits(again, tokens), hf_logits(hf, tokens), atol=1e-5, rtol=0)


def test_gemma3_layers_are_what_the_config_says(loaded):
    _, _, cfg, model = loaded("gemma3-kv1")
    assert [layer.self_attn.window for layer in model.layers] == [None, 4]
    assert cfg.tie_word_embeddings and model.lm_head is None and cfg.query_pre_attn_scalar == 24
    _, _, linear, _ = loaded("gemma3-mha-linear")
    assert linear.layer_types == ("sliding_attention", "full_attention") and linear.rope_scaling == ("linear", 4.0)
    plain = 1.0 / (1e6 ** (np.arange(0, 8, 2) / 8))
    np.testing.assert_allclose(rope_inv_freq(linear), plain / 4, rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(linear, local=True), 1.0 / (1e4 ** (np.arange(0, 8, 2) / 8)), rtol=1e-6)


def test_a_tree_deeper_than_the_window_is_windowed_by_depth(loaded):
    """Verification's tree: root -> a, root -> b -> c -> d -> e -> f, after 5 committed tokens. Node f
    (position 10) must not read b (position 6, distance 4 = the window), though b's slot (7) is within
    4 of it: keys are windowed by position. Every node's logits are HF's over its own path."""
    hf, _, _, model = loaded("gemma3-kv1")
    parents = [-1, 0, 0, 2, 3, 4, 5]
    depth = np.array([0, 1, 1, 2, 3, 4, 5])
    anc = np.eye(7, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    tokens = random_tokens(2, 12, seed=13)  # the prefixes, then the tree's tokens
    tree = tokens[:, 5:12]
    s = T + 2
    cache = model.init_cache(2, s)
    cache = forward(model, tokens[:, :5], positions(2, 5), causal_mask(cache.lengths, 5, s), cache, causal=True).cache
    cache = cache.advance(jnp.array([5, 5]))
    got = forward(model, tree, 5 + np.broadcast_to(depth, (2, 7)), tree_mask(cache.lengths, jnp.asarray(anc), s), cache).logits
    short = np.concatenate([tokens[:, :5], tree[:, [0, 1]]], 1)  # prefix, root, a
    long = np.concatenate([tokens[:, :5], tree[:, [0, 2, 3, 4, 5, 6]]], 1)  # prefix, root, b, c, d, e, f
    ref_short, ref_long = hf_logits(hf, short), hf_logits(hf, long)
    want = np.concatenate([ref_long[:, 5:6], ref_short[:, 6:7], ref_long[:, 6:]], 1)
    assert max_diff(got, want) <= TOL


def test_a_long_prefill_attends_in_blocks_with_windows(loaded):
    """Past two QUERY_BLOCKs a causal forward attends in query blocks; a local layer's window is in
    each block's mask, and the logits stay HF's."""
    hf, _, _, model = loaded("gemma3-kv1")
    t = 2 * layers.QUERY_BLOCK + 37
    assert len(layers.query_blocks(t)) == 2
    tokens = random_tokens(1, t, seed=5)
    got = forward(model, tokens, positions(1, t), causal_self_mask(1, t), causal=True)
    assert max_diff(got.logits, hf_logits(hf, tokens)) <= TOL


def test_gemma_norm_and_embedding_round_as_hf_in_bfloat16():
    """Gemma's RMSNorm multiplies by (1 + w) in float32 before casting, and its embedding scale is
    cast to the table's dtype first (sqrt(3072) is 55.5 in bfloat16): bit for bit HF's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    hf_norm = Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(64, generator=g))
    norm = layers.RMSNorm(64, 1e-6, jnp.bfloat16, unit_offset=True)
    norm.weight[...] = jnp.asarray(hf_norm.weight.detach().float().numpy(), jnp.bfloat16)
    with torch.no_grad():
        want = hf_norm(x).float().numpy()
    np.testing.assert_array_equal(np.asarray(norm(jnp.asarray(x.float().numpy(), jnp.bfloat16)), np.float32), want)

    hf_embed = Gemma3TextScaledWordEmbedding(8, 3072, 0, embed_scale=3072 ** 0.5).to(torch.bfloat16)
    embed = layers.Embed(8, 3072, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scale=3072 ** 0.5)
    embed.embedding[...] = jnp.asarray(hf_embed.weight.detach().float().numpy(), jnp.bfloat16)
    ids = np.array([[1, 5, 7]])
    with torch.no_grad():
        want = hf_embed(torch.tensor(ids)).float().numpy()
    assert float(jnp.asarray(embed.scale, jnp.bfloat16)) == 55.5
    np.testing.assert_array_equal(np.asarray(embed(jnp.asarray(ids), jnp.bfloat16), np.float32), want)


# ---------------------------------------------------------------- config.json, family by family

GEMMA3_1B = {  # google/gemma-3-1b-it's config.json as transformers 4.50 wrote it (no layer_types)
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def test_gemma3_config_of_transformers_4_reads_as_5_writes_it():
    cfg = ModelConfig.from_hf_dict(GEMMA3_1B)
    assert cfg.layer_types == tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26))
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (512, 1e6, 1e4, None)
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.tie_word_embeddings, cfg.eos_token_ids) == (256, 256, True, (1, 106))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    four_b = ModelConfig.from_hf_dict({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert four_b.rope_scaling == ("linear", 8.0)
    np.testing.assert_allclose(rope_inv_freq(four_b), rope_inv_freq(cfg) / 8, rtol=1e-6)
    np.testing.assert_array_equal(rope_inv_freq(four_b, local=True), rope_inv_freq(cfg, local=True))


def test_each_family_keeps_transformers_defaults():
    assert ModelConfig.from_hf_dict(QWEN3).head_dim == 128  # Qwen3Config's, not hidden / heads
    assert not ModelConfig.from_hf_dict({**QWEN3, "sliding_window": 4}).layer_types  # use_sliding_window is off
    qwen2 = ModelConfig.from_hf_dict({**QWEN3, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
                                      "max_window_layers": 3})
    assert qwen2.layer_types == ("full_attention",) * 3 + ("sliding_attention",) and qwen2.head_dim == 8
    mistral = ModelConfig.from_hf_dict({**QWEN3, "model_type": "mistral"})  # MistralConfig's window: 4096
    assert mistral.sliding_window == 4096 and set(mistral.layer_types) == {"sliding_attention"}
    assert ModelConfig.from_hf_dict({**QWEN3, "model_type": "mistral", "sliding_window": None}).layer_types == ()
    assert ModelConfig.from_hf_dict(GEMMA3_1B).fingerprint() != ModelConfig.from_hf_dict(QWEN3).fingerprint()


def test_a_llamas_fingerprint_is_the_one_written_before_the_families():
    """Datasets and heads keep their base model's fingerprint; the family fields leave a Llama's alone."""
    assert ModelConfig.tiny().fingerprint() == "9dd970c8258f8e6a"
    llama3 = ModelConfig.tiny(tie_word_embeddings=True, qkv_bias=True, rope_scaling=("llama3", 8.0, 1.0, 4.0, 64),
                              eos_token_ids=(2,))
    assert llama3.fingerprint() == "4e0d12c0b074a69a"


def _gemma(**kv):
    return {**GEMMA3_1B, **kv}


BAD_CONFIGS = {
    "gemma2": (_gemma(model_type="gemma2"), r"model_type='gemma2' is not supported"),
    "gemma3 multimodal": ({"model_type": "gemma3", "text_config": GEMMA3_1B}, r"model_type='gemma3' is Gemma 3's image"),
    "attention softcap": (_gemma(attn_logit_softcapping=50.0), r"unsupported field attn_logit_softcapping=50.0"),
    "final softcap": (_gemma(final_logit_softcapping=30.0), r"unsupported field final_logit_softcapping=30.0"),
    "bidirectional": (_gemma(use_bidirectional_attention=True), r"use_bidirectional_attention=True"),
    "layer type": (_gemma(layer_types=["chunked_attention"] * 26), r"unsupported layer type 'chunked_attention'"),
    "layer count": (_gemma(layer_types=["full_attention"] * 3), r"layer_types has 3 entries for num_hidden_layers=26"),
    "no window": (_gemma(sliding_window=None), r"sliding_window is null"),
    "global yarn": (_gemma(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"full_attention type 'yarn'"),
    "local linear": (_gemma(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
                     r"sliding_attention type 'linear'"),
    "gelu": (_gemma(hidden_activation="gelu"), r"unsupported field hidden_activation='gelu'"),
    "gemma bias": (_gemma(attention_bias=True), r"attention_bias"),
    "qwen3 bias": ({**QWEN3, "attention_bias": True}, r"attention_bias"),
    "partial rope": ({**QWEN3, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    "qwen2 local without window": ({**QWEN3, "model_type": "qwen2", "layer_types": ["sliding_attention"] * 4},
                                   r"sliding_window is null"),
    "gemma field on a llama": ({**QWEN3, "model_type": "llama", "query_pre_attn_scalar": 64},
                               r"unsupported field query_pre_attn_scalar=64"),
    "missing field": ({k: v for k, v in QWEN3.items() if k != "hidden_size"}, r"field hidden_size is missing"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_what_the_decoder_does_not_implement_is_refused_in_one_line(case):
    hf, match = BAD_CONFIGS[case]
    with pytest.raises(CloverError, match=match) as excinfo:
        ModelConfig.from_hf_dict(hf)
    assert_one_line(excinfo)
