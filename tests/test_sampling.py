"""Sampling: `distribution` against hand-computed examples, `sample` against `distribution`, and the
generator's seeds, greedy limit and per-sequence keys."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch

from clover_jax.errors import CloverError
from clover_jax.engine.sampling import ACCEPT, BONUS, DRAW, SamplingConfig, distribution, draft_distribution, draw_without_replacement, sample, top_k, use_keys
from conftest import MAX_NEW, PROMPTS, hf_logits

# Probabilities [0.15, 0.5, 0.05, 0.3] (not sorted, so the top-p bookkeeping must map back).
P = np.array([0.15, 0.5, 0.05, 0.3], np.float32)
LOGITS = jnp.log(jnp.asarray(P))


def dist(**kw) -> np.ndarray:
    return np.asarray(distribution(LOGITS, SamplingConfig(**kw)))


@pytest.mark.parametrize("kw, want", [
    (dict(temperature=0.0), [0, 1, 0, 0]),
    (dict(temperature=1.0), P),
    (dict(temperature=1.0, top_p=0.4), [0, 1, 0, 0]),  # 0.5 alone reaches 0.4
    (dict(temperature=1.0, top_p=0.6), [0, 0.625, 0, 0.375]),  # 0.5 + 0.3
    (dict(temperature=1.0, top_p=0.9), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]),
    (dict(temperature=0.3, top_p=1e-6), [0, 1, 0, 0]),
    (dict(temperature=1.0, top_k=1), [0, 1, 0, 0]),
    (dict(temperature=1.0, top_k=2), [0, 0.625, 0, 0.375]),
    (dict(temperature=1.0, top_k=4), P),
    (dict(temperature=1.0, top_k=9), P),
    # top-k first (0.5, 0.3, 0.15 renormalised to 0.526, 0.316, 0.158), then top-p 0.7 keeps two.
    (dict(temperature=1.0, top_k=3, top_p=0.7), [0, 0.625, 0, 0.375]),
    (dict(temperature=2.0), np.sqrt(P) / np.sqrt(P).sum()),
    (dict(temperature=0.5), P ** 2 / (P ** 2).sum()),
    (dict(temperature=2.0, top_k=2), [0, np.sqrt(0.5), 0, np.sqrt(0.3)] / (np.sqrt(0.5) + np.sqrt(0.3))),
])
def test_distribution_hand_examples(kw, want):
    got = dist(**kw)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_distribution_is_per_row():
    logits = jnp.stack([LOGITS, LOGITS[::-1], jnp.zeros(4)]).reshape(3, 1, 4)
    got = np.asarray(distribution(logits, SamplingConfig(1.0, top_p=0.6)))
    assert got.shape == (3, 1, 4)
    np.testing.assert_allclose(got[0, 0], [0, 0.625, 0, 0.375], atol=1e-6)
    np.testing.assert_allclose(got[1, 0], [0.375, 0, 0.625, 0], atol=1e-6)
    np.testing.assert_allclose(got[2, 0].sum(), 1, atol=1e-6)  # ties: some subset, renormalised
    assert np.count_nonzero(got[2, 0]) >= 3


@pytest.mark.parametrize("kw, draft_kw", [
    (dict(temperature=1.0, draft_temperature=2.0), dict(temperature=2.0)),
    (dict(temperature=0.5, draft_temperature=3.0, top_p=0.9), dict(temperature=1.5, top_p=0.9)),
    (dict(temperature=1.0, draft_temperature=1.0, top_k=2), dict(temperature=1.0, top_k=2)),
])
def test_drafts_are_drawn_at_the_temperature_times_the_draft_temperature(kw, draft_kw):
    """The base model's distribution ignores the draft temperature; the drafts' q scales the temperature."""
    np.testing.assert_allclose(dist(**kw), dist(**{**kw, "draft_temperature": 1.0}), atol=0)
    np.testing.assert_allclose(np.asarray(draft_distribution(LOGITS, SamplingConfig(**kw))), dist(**draft_kw),
                               atol=1e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), r"temperature=-1.0 must be >= 0"),
    (dict(temperature=float("nan")), r"temperature=nan must be >= 0"),
    (dict(top_k=-2), r"top_k=-2 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(draft_temperature=0.0), r"draft_temperature=0.0 must be > 0"),
])
def test_bad_sampling_config(kw, match):
    with pytest.raises(CloverError, match=match):
        SamplingConfig(**kw)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=3)])
def test_sample_draws_from_distribution(kw):
    """Empirical frequencies of 40000 draws against `distribution`: chi-square, 3 degrees of freedom
    at most, threshold at p = 1e-4."""
    n = 40000
    cfg = SamplingConfig(**kw)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), n))
    draws = np.asarray(sample(jnp.broadcast_to(LOGITS, (n, 4)), keys, cfg))
    counts = np.bincount(draws, minlength=4)
    expected = n * dist(**kw)
    assert np.all(counts[expected == 0] == 0)
    live = expected > 0
    chi2 = float(np.sum((counts[live] - expected[live]) ** 2 / expected[live]))
    assert chi2 < 21.1, (counts, expected)


@pytest.mark.parametrize("k", [2, 3], ids=["in-turn", "gumbel-top-k"])
def test_draws_without_replacement_in_draw_order(k):
    """Ordered draws of k of P's 4 tokens (2 are drawn one after the other, 3 by the Gumbel top-k): the
    chance of (i, j, ...) is P_i * P_j / (1 - P_i) * ..., and 40000 draws pass a chi-square test over the
    orderings (p > 1e-4)."""
    n = 40000
    keys = jax.random.key_data(jax.random.split(jax.random.key(2), n))
    drawn = np.asarray(draw_without_replacement(jnp.broadcast_to(jnp.asarray(P), (n, 4)), keys, k))
    assert drawn.shape == (n, k) and all(len(set(row)) == k for row in drawn[:2000])
    orders = list(itertools.permutations(range(4), k))
    expected = []
    for order in orders:
        left, chance = 1.0, 1.0
        for i in order:
            chance, left = chance * float(P[i]) / left, left - float(P[i])
        expected.append(chance)
    expected = n * np.array(expected) / sum(expected)
    counts = [int(np.all(drawn == order, axis=1).sum()) for order in orders]
    assert scipy.stats.chisquare(counts, expected).pvalue > 1e-4, (counts, expected)


def test_greedy_sample_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 64)), jnp.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 5))
    np.testing.assert_array_equal(sample(logits, keys, SamplingConfig()), np.argmax(logits, -1))


# ---------------------------------------------------------------- through the generator

HOT = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def gen(llama2_generator):
    return llama2_generator


def test_fixed_seed_reproducible_and_seeds_differ(gen):
    a = gen.generate(PROMPTS, MAX_NEW, HOT, seed=3, eos_ids=[]).tokens
    b = gen.generate(PROMPTS, MAX_NEW, HOT, seed=3, eos_ids=[]).tokens
    c = gen.generate(PROMPTS, MAX_NEW, HOT, seed=4, eos_ids=[]).tokens
    assert a == b
    assert a != c
    assert len({tuple(t) for t in a}) == 3  # rows draw with different keys


def test_top_k_1_equals_greedy(gen):
    greedy = gen.generate(PROMPTS, MAX_NEW, eos_ids=[]).tokens
    assert gen.generate(PROMPTS, MAX_NEW, SamplingConfig(1.0, top_k=1), seed=5, eos_ids=[]).tokens == greedy


def test_rows_do_not_depend_on_other_rows(gen):
    """Row 0's key comes from the seed and its row index alone: changing (or dropping) the other
    rows' prompts leaves its draws unchanged."""
    base = gen.generate(PROMPTS, MAX_NEW, HOT, seed=7, eos_ids=[]).tokens
    other = gen.generate([PROMPTS[0], [1, 40, 41], [9] * 20], MAX_NEW, HOT, seed=7, eos_ids=[]).tokens
    assert other[0] == base[0]
    assert other[1] != base[1]
    alone = gen.generate(PROMPTS[:1], MAX_NEW, HOT, seed=7, eos_ids=[]).tokens
    assert alone[0] == base[0]


def test_first_token_follows_the_model_distribution(loaded, gen):
    """512 copies of one prompt, one new token each, top-k 4: counts against HF's softmax."""
    hf = loaded("llama2")[0]
    prompt = PROMPTS[1]
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    draws = np.array(gen.generate([prompt] * 512, 1, cfg, seed=11).tokens)[:, 0]
    logits = torch.tensor(hf_logits(hf, [prompt])[0, -1])
    top = torch.topk(logits, 4)
    expected = 512 * torch.softmax(top.values, -1).numpy()
    counts = np.array([(draws == int(t)).sum() for t in top.indices])
    assert counts.sum() == 512
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 21.1, (counts, expected)


@pytest.mark.parametrize("k", [1, 3, 8, 70])
def test_top_k_matches_lax_top_k_with_ties(k):
    """Our top_k (argmax passes for small k) gives lax.top_k's values and indices, ties included."""
    x = jax.random.randint(jax.random.key(0), (2, 3, 100), 0, 12).astype(jnp.float32)  # many ties
    values, indices = top_k(x, k)
    want_values, want_indices = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, want_indices)


def test_keys_of_a_level_with_1000_children_are_independent():
    """A speculative step's keys for the children tests of depths 1-2 with 1,001 children each (as
    `widths:1001,1001` drafts), the bonus token and the depths' draws are all distinct, and the
    uniforms drawn from them look independent: the old salt 1000 d + r gave depth 1's child 1000 the
    key of depth 2's child 0."""
    key = jax.random.key_data(jax.random.split(jax.random.key(0), 2))  # [B=2, 2]
    keys = [use_keys(key, ACCEPT, d, r) for d in (1, 2) for r in range(1001)]
    keys += [use_keys(key, BONUS)] + [use_keys(key, DRAW, d) for d in (1, 2)]
    stacked = np.asarray(jnp.stack(keys))  # [2006, B, 2]
    for b in range(stacked.shape[1]):
        assert len({tuple(k) for k in stacked[:, b]}) == len(keys)
    u = np.asarray(jax.vmap(jax.vmap(jax.random.uniform))(jnp.stack(keys[:2002])))  # [2002, B]
    assert scipy.stats.kstest(u.ravel(), "uniform").pvalue > 1e-3
    pairs = u[:2001:2, 0], u[1:2002:2, 0]  # neighbouring children's uniforms: uncorrelated
    assert abs(np.corrcoef(*pairs)[0, 1]) < 0.15
