"""The JAX base model against Hugging Face (PyTorch) on tiny random models of every family, and the
cache/tree masks against a cache-free forward."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from clover_jax.model import layers
from clover_jax.model.cache import causal_mask, tree_mask
from clover_jax.model.config import ModelConfig, rope_inv_freq
from clover_jax.drafters.eagle3 import eagle3_layers, legacy_eagle3_layers
from clover_jax.model.llama import Llama, causal_self_mask
from conftest import FAMILY_NAMES, hf_logits, random_tokens

TOL = 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, pos, mask, cache):
    return nnx.merge(graphdef, state)(tokens, pos, mask, cache)


def forward(model, tokens, pos, mask, cache=None):
    """`model(...)` compiled once per shape: eager op-by-op dispatch is far slower on CPU."""
    return _forward(*nnx.split(model), jnp.asarray(tokens), pos, mask, cache)


def positions(batch: int, length: int, start=0) -> jax.Array:
    return jnp.asarray(start).reshape(-1, 1) + jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prefill_logits_match_hf(loaded, family):
    hf, _, _, model = loaded(family)
    tokens = random_tokens(2, 12, seed=1)
    want = hf_logits(hf, tokens)
    free = forward(model, jnp.asarray(tokens), positions(2, 12), causal_self_mask(2, 12))
    assert free.logits.shape == (2, 12, 64) and free.logits.dtype == jnp.float32
    assert max_diff(free.logits, want) <= TOL
    # The same prompt through a cache longer than the prompt: padding slots are masked out.
    cache = model.init_cache(2, 16)
    cached = forward(model, jnp.asarray(tokens), positions(2, 12), causal_mask(cache.lengths, 12, 16), cache)
    assert max_diff(cached.logits, want) <= TOL


@functools.partial(jax.jit, static_argnums=(0, 6))
def _forward_causal(graphdef, state, tokens, pos, mask, cache, causal):
    return nnx.merge(graphdef, state)(tokens, pos, mask, cache, causal=causal)


@pytest.mark.parametrize("family", FAMILY_NAMES[:1])
def test_a_long_causal_forward_attends_in_blocks_and_matches_hf(loaded, family):
    """Past two QUERY_BLOCKs a causal forward (a prefill) attends in query blocks, each over the keys up
    to its last token: HF's logits, without a cache and through a fresh cache longer than the prompt
    (the prompt right-padded, as the decoder pads it: the padding changes no real position)."""
    hf, _, _, model = loaded(family)
    t = 2 * layers.QUERY_BLOCK + 37
    assert len(layers.query_blocks(t)) == 2
    tokens = random_tokens(1, t, seed=5)
    want = hf_logits(hf, tokens)
    graphdef, state = nnx.split(model)
    free = _forward_causal(graphdef, state, jnp.asarray(tokens), positions(1, t), causal_self_mask(1, t), None, True)
    assert max_diff(free.logits, want) <= TOL
    padded = np.concatenate([tokens, random_tokens(1, 11, seed=6)], 1)  # 11 padding tokens after the prompt
    cache = model.init_cache(1, t + 11 + 5)
    cached = _forward_causal(graphdef, state, jnp.asarray(padded), positions(1, t + 11),
                             causal_mask(cache.lengths, t + 11, t + 16), cache, True)
    assert max_diff(cached.logits[:, :t], want) <= TOL


def test_causal_attention_in_blocks_reads_no_later_token_whatever_the_mask():
    """`attend(..., causal=True)`: the mask's own restrictions hold inside each block, and a later
    token is never read even where the mask allows it."""
    b, t, n, kv, h = 2, layers.QUERY_BLOCK * 3 + 5, 4, 2, 8
    assert [e - s for s, e in layers.query_blocks(t)] == [layers.QUERY_BLOCK + 1, layers.QUERY_BLOCK + 2,
                                                            layers.QUERY_BLOCK + 2]
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(r.standard_normal((b, kv, t, h)), jnp.float32) for _ in range(2))
    mask = r.random((b, t, t)) < 0.5
    mask[:, np.arange(t), np.arange(t)] = True  # each token reads itself, as every real mask has it
    run = jax.jit(layers.attend, static_argnames="causal")
    got = run(q, k, v, jnp.asarray(mask), causal=True)
    want = run(q, k, v, jnp.asarray(mask & np.tril(np.ones((t, t), bool))), causal=False)
    assert max_diff(got, want) <= 1e-5


@pytest.mark.parametrize("family", FAMILY_NAMES[:1])
def test_layer_features_match_hf(loaded, family):
    """`feature_layers` returns the chosen layers' outputs from the same pass: HF's hidden_states[i + 1]
    for layer i (-1: the last layer's output before the final norm, i.e. `hidden`), the other outputs
    unchanged."""
    hf, _, _, model = loaded(family)
    tokens = random_tokens(2, 12, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states
    run = jax.jit(lambda g, s, t: nnx.merge(g, s)(t, positions(2, 12), causal_self_mask(2, 12), feature_layers=(0, 1, -1)))
    out = run(*nnx.split(model), jnp.asarray(tokens))
    plain = forward(model, jnp.asarray(tokens), positions(2, 12), causal_self_mask(2, 12))
    assert out.features.shape == (2, 12, 3, model.cfg.hidden_size) and plain.features is None
    assert max_diff(out.features[:, :, 0], ref[1].numpy()) <= TOL  # HF's last entry is normed: not layer 1's
    assert max_diff(out.features[:, :, 1], out.hidden) == 0.0 and max_diff(out.features[:, :, 2], out.hidden) == 0.0
    assert max_diff(out.logits, plain.logits) <= 1e-5  # two programs: float32 rounding apart
    # EAGLE-3's layers as its authors name them (outputs of 1, L/2-1, L-4: HF hidden_states 2, L/2, L-3)
    assert eagle3_layers(30) == (1, 14, 26) and eagle3_layers(32) == (1, 15, 28) and eagle3_layers(2) == (1, 0, 0)
    assert legacy_eagle3_layers(32) == (2, 16, 29) and legacy_eagle3_layers(2) == (1, 1, 0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cached_decode_logits_match_hf(loaded, family):
    """Prefill 5 tokens, commit 5 of row 0 and 3 of row 1, then feed one token at a time: each step's
    logits equal HF's full forward at that position (the uncommitted slots of row 1 get overwritten)."""
    hf, _, _, model = loaded(family)
    tokens = random_tokens(2, 11, seed=2)
    want = hf_logits(hf, tokens)
    s = 16
    cache = model.init_cache(2, s)
    out = forward(model, jnp.asarray(tokens[:, :5]), positions(2, 5), causal_mask(cache.lengths, 5, s), cache)
    assert max_diff(out.logits[0, 4], want[0, 4]) <= TOL
    assert max_diff(out.logits[1, 2], want[1, 2]) <= TOL
    cache = out.cache.advance(jnp.array([5, 3]))
    rows = np.arange(2)
    for _ in range(6):
        pos = np.asarray(cache.lengths)
        step = jnp.asarray(tokens[rows, pos])[:, None]
        out = forward(model, step, jnp.asarray(pos)[:, None], causal_mask(cache.lengths, 1, s), cache)
        assert max_diff(out.logits[:, 0], want[rows, pos]) <= TOL, pos
        cache = out.cache.advance(jnp.ones(2, jnp.int32))
    np.testing.assert_array_equal(cache.lengths, [11, 9])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hidden_states_match_hf(loaded, family):
    """`hidden_normed` is HF's hidden_states[-1] (final norm applied); `hidden` is the last decoder
    layer's output before that norm."""
    hf, _, _, model = loaded(family)
    tokens = random_tokens(2, 12, seed=3)  # the prefill test's shape: no new compile
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.__setitem__("pre", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            ref = hf(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True)
    finally:
        hook.remove()
    out = forward(model, jnp.asarray(tokens), positions(2, 12), causal_self_mask(2, 12))
    assert max_diff(out.hidden_normed, ref.hidden_states[-1].numpy()) <= TOL
    assert max_diff(out.hidden, captured["pre"].numpy()) <= TOL
    assert max_diff(model.norm(out.hidden), out.hidden_normed) <= 1e-6


def test_llama3_rope_scaling_bends_frequencies(loaded):
    """The llama3 fixture really exercises all three bands: kept, smoothed and divided by `factor`."""
    _, _, cfg, _ = loaded("llama3-gqa4x2")
    assert cfg.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64) and cfg.rope_theta == 500000.0
    scaled = rope_inv_freq(cfg)
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    ratio = plain / scaled
    assert np.isclose(ratio[0], 1.0)
    assert np.any(np.isclose(ratio, 8.0))
    assert np.any((ratio > 1.01) & (ratio < 7.99)), ratio


# ---------------------------------------------------------------- cache and tree masks against a cache-free forward


@pytest.fixture(scope="module")
def base(loaded):
    """A model with weights of HF's random scale (logits of order one), so 1e-5 means something."""
    return loaded("llama3-gqa4x2")[3]


def test_prefill_then_decode_equals_cache_free_forward(base):
    """Shapes as in the parity tests above (same model), so nothing new is compiled."""
    tokens = jnp.asarray(random_tokens(2, 12, seed=4))
    full = forward(base, tokens, positions(2, 12), causal_self_mask(2, 12)).logits
    s = 16
    cache = base.init_cache(2, s)
    out = forward(base, tokens[:, :5], positions(2, 5), causal_mask(cache.lengths, 5, s), cache)
    got = [out.logits]
    cache = out.cache.advance(jnp.full((2,), 5))
    for t in range(5, 12):
        out = forward(base, tokens[:, t:t + 1], positions(2, 1, t), causal_mask(cache.lengths, 1, s), cache)
        got.append(out.logits)
        cache = out.cache.advance(jnp.ones(2, jnp.int32))
    assert max_diff(jnp.concatenate(got, axis=1), full) <= 1e-5


def test_tree_mask_of_a_chain_is_causal():
    lengths = jnp.array([0, 3, 7])
    chain = jnp.tril(jnp.ones((5, 5), bool))
    np.testing.assert_array_equal(tree_mask(lengths, chain, 16), causal_mask(lengths, 5, 16))


def test_tree_mask_hand_example():
    #   node 0 -> nodes 1 and 2 (siblings), committed prefix of 2 slots, 6 slots in all
    anc = jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    want = np.array([[1, 1, 1, 0, 0, 0],
                     [1, 1, 1, 1, 0, 0],
                     [1, 1, 1, 0, 1, 0]], bool)
    np.testing.assert_array_equal(tree_mask(jnp.array([2]), anc, 6)[0], want)


def test_tree_forward_equals_each_path_forward(base):
    """A branching tree in one forward: every node's logits equal the causal forward of its path.
    Row 0 holds the tree root -> (a, b); row 1 a chain. References come from one cache-free forward."""
    tokens = random_tokens(2, 12, seed=5)
    root, a, b = 10, 20, 30
    s = 16
    cache = base.init_cache(2, s)
    prefix = jnp.asarray(tokens[:, :5])
    cache = forward(base, prefix, positions(2, 5), causal_mask(cache.lengths, 5, s), cache).cache
    cache = cache.advance(jnp.array([5, 4]))  # row 1 keeps 4: its tree starts at position 4
    anc = jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    mask = tree_mask(cache.lengths, anc, s)
    mask = mask.at[1].set(causal_mask(cache.lengths, 3, s)[1])
    tree = forward(base, jnp.array([[root, a, b], tokens[1, 4:7]]), jnp.array([[5, 6, 6], [4, 5, 6]]), mask, cache).logits
    paths = np.stack([tokens[0], tokens[0]])  # row 0's prefix, then root -> a and root -> b
    paths[0, 5:7], paths[1, 5:7] = (root, a), (root, b)
    ref = forward(base, jnp.asarray(paths), positions(2, 12), causal_self_mask(2, 12)).logits
    chain = forward(base, jnp.asarray(tokens), positions(2, 12), causal_self_mask(2, 12)).logits
    assert max_diff(tree[0], jnp.stack([ref[0, 5], ref[0, 6], ref[1, 6]])) <= 1e-5
    assert max_diff(tree[1], chain[1, 4:7]) <= 1e-5


def test_shapes_via_eval_shape():
    cfg = ModelConfig.tiny(tie_word_embeddings=True, qkv_bias=True)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert model.lm_head is None
    graphdef, state = nnx.split(model)

    def fwd(state, tokens):
        m = nnx.merge(graphdef, state)
        c = m.init_cache(3, 20)
        return m(tokens, jnp.zeros((3, 5), jnp.int32), causal_mask(c.lengths, 5, 20), c)

    out = jax.eval_shape(fwd, state, jax.ShapeDtypeStruct((3, 5), jnp.int32))
    assert out.logits.shape == (3, 5, 64) and out.hidden.shape == out.hidden_normed.shape == (3, 5, 32)
    assert len(out.cache.k) == 2 and out.cache.k[0].shape == (3, 2, 20, 8)
    assert sum(np.prod(v.shape) for v in jax.tree.leaves(state)) == cfg.num_params


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_float32_products_ask_for_full_precision(dtype):
    """Accelerators multiply float32 in TF32 or one bfloat16 pass unless told otherwise, which made
    greedy speculative text leave plain decoding's on an H200: every product of a float32 model (the
    prefill, a step over committed slots, the draft vocabulary's logits) asks for HIGHEST; a bfloat16
    one keeps the fast default."""
    from clover_jax.drafters.vocab import DraftVocab

    cfg = ModelConfig.tiny(tie_word_embeddings=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0))))

    def prefill_then_step(state, tokens):
        m = nnx.merge(graphdef, state)
        c = m.init_cache(1, 16)
        c = m(tokens, positions(1, 4), causal_mask(c.lengths, 4, 16), c).cache.advance(jnp.full((1,), 4))
        step = m(tokens[:, :1], positions(1, 1, 4), causal_mask(c.lengths, 1, 16), c)
        return DraftVocab.most_frequent(m.lm_head_weight(), None, 8).logits(step.hidden_normed)

    text = jax.jit(prefill_then_step).lower(state, jax.ShapeDtypeStruct((1, 4), jnp.int32)).as_text()
    dots = text.count("stablehlo.dot_general")
    assert dots >= 2 * (4 * cfg.num_layers + 1)  # q/k/v, o, scores, mix (MLP's three more) per layer, both passes
    assert text.count("precision = [HIGHEST, HIGHEST]") == (dots if dtype == jnp.float32 else 0)
    assert text.count("HIGHEST") == (2 * dots if dtype == jnp.float32 else 0)
