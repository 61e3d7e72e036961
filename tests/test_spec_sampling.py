"""Speculative sampling keeps the base model's distribution exactly.

A tiny model (24-token vocabulary) with peaked distributions; its exact distribution of the first four
sampled tokens under a sampling setting is computed by enumerating every prefix. Tens of thousands of
speculative samples (one per sequence of a large batch; fixed seeds, so the test is deterministic) must
pass a chi-square test against it for every method, at temperature 1 and 0.7 and with top-p 0.9, on
static and dynamic trees, and with a draft vocabulary; the same test must reject a deliberately wrong
acceptance rule.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from clover_jax.engine import speculative
from clover_jax.model.config import ModelConfig
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.llama import Llama, causal_self_mask
from clover_jax.engine.sampling import SamplingConfig, distribution
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.trees.spec import resolve_tree
from conftest import TableHeads

pytestmark = pytest.mark.optimized  # its time goes into running programs, not compiling them

VOCAB = 24
PREFIX = [3, 17, 5, 9, 12]
NEW = 4  # t1 from the prefill, t2..t4 from speculative steps (a depth-3 tree can accept all three)
DRAWS, BATCH = 3, 8192  # 24,576 samples per setting
TREE = "widths:3,2,1"


def noisy(module, std: float, seed: int, replace: bool):
    """Add N(0, std^2) to every parameter, or redraw the matrices from it (`replace`): the default 0.02
    init gives a near-uniform base model, where every acceptance rule looks right."""
    leaves, treedef = jax.tree.flatten(nnx.state(module, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [std * jax.random.normal(k, x.shape, x.dtype) + (0 if replace and x.ndim > 1 else x)
           for x, k in zip(leaves, keys)]
    nnx.update(module, jax.tree.unflatten(treedef, new))
    return module


@pytest.fixture(scope="module")
def base():
    return noisy(Llama(ModelConfig.tiny(vocab_size=VOCAB), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)


# Gemma 3's layer: (1 + w) norms around both branches, q/k norms, GeGLU, a scaled embedding and score
# scalar, and a local layer of window 4 before a global one, so the prefix and the sampled tokens (9 in
# all) span more than two windows.
GEMMA3 = dict(model_type="gemma3", qk_norm=True, norm_unit_offset=True, sandwich_norms=True,
              hidden_act="gelu_pytorch_tanh", embed_scale=True, query_pre_attn_scalar=12.0, sliding_window=4,
              layer_types=("sliding_attention", "full_attention"), rope_local_theta=10000.0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def gemma3_base():
    return noisy(Llama(ModelConfig.tiny(vocab_size=VOCAB, **GEMMA3), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(graphdef, params, tokens):
    base = nnx.merge(graphdef, params)
    b, t = tokens.shape
    return base(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), causal_self_mask(b, t)).logits[:, -NEW:]


def exact_joint(base: Llama, sampling: SamplingConfig) -> np.ndarray:
    """P(t1, t2, t3, t4) [V]*4 under `sampling`, by running every continuation of the prefix: one causal
    pass over the prefix + each of the V^3 (t1, t2, t3) gives every conditional at once (the rows with
    stride V^(3-n) enumerate the n-token continuations at position len(PREFIX) - 1 + n)."""
    conts = np.array(list(itertools.product(range(VOCAB), repeat=NEW - 1)), np.int32)
    tokens = np.concatenate([np.tile(PREFIX, (len(conts), 1)), conts], axis=1)
    logits = _last_logits(*nnx.split(base), jnp.asarray(tokens))  # [V^3, NEW, V]
    probs = np.asarray(distribution(logits, sampling), np.float64)
    joint = np.ones(())
    for n in range(NEW):
        p = probs[:: VOCAB ** (NEW - 1 - n), n].reshape((VOCAB,) * n + (VOCAB,))
        joint = joint[..., None] * p
    return joint


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs, cells with expected count < 5 pooled into one."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel() / probs.sum()
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # a token the base model cannot produce was sampled
    return float(scipy.stats.chisquare(obs[keep], exp[keep]).pvalue)


def table_heads(base) -> TableHeads:
    """Heads that know the base model's bigram statistics: head d at a node holding token a proposes
    P(t_{d+2} = b | t_{d+1} = a) from the exact joint at temperature 1. Random heads draft well enough
    for static trees, but a dynamic tree spends its budget where the heads are confident, and with
    uninformed heads its drafts are rarely accepted past depth 1."""
    joint = exact_joint(base, SamplingConfig(temperature=1.0))
    pairs = [joint.sum(axis=tuple(i for i in range(NEW) if i not in (d, d + 1))) for d in range(NEW - 1)]
    table = np.stack([np.log(p / p.sum(-1, keepdims=True) + 1e-9) for p in pairs])
    return TableHeads(base.cfg, table)


def noisy_heads(base, method: str):
    """Random heads of `method` (3 of them), their parameters nudged off the init as `noisy` says."""
    return noisy(make_heads(drafter_config(method, 3), base, seed=2), 0.05, seed=3, replace=False)


def sample_tokens(base, method: str, sampling: SamplingConfig, tree: str = TREE, draft_vocab: int = 0,
                  step_cost: float | None = None) -> np.ndarray:
    """Samples of the first NEW tokens; with `draft_vocab`, the heads draft from the first that many ids;
    with `step_cost`, the loop paces its drafting by it (`pacing.speculate_now`)."""
    if method == "table":
        heads = table_heads(base)
    else:
        heads = noisy_heads(base, method)
    vocab = DraftVocab.most_frequent(base.lm_head_weight(), None, draft_vocab) if draft_vocab else None
    # An 8-token bucket holds the prefix: the default smallest (32) would make the big batch's prefill
    # and cache four times wider than the prefix needs.
    gen = SpeculativeGenerator(base, heads, resolve_tree(tree, "clover" if method == "table" else method, 3),
                               draft_vocab=vocab, buckets=(8,), step_cost=step_cost)
    rows = []
    for seed in range(DRAWS):
        out = gen.generate([PREFIX] * BATCH, NEW, sampling, seed=seed, eos_ids=())
        rows += out.tokens
    tokens = np.array(rows)
    assert tokens.shape == (DRAWS * BATCH, NEW)
    hist = out.accept_hist.sum(0)
    assert hist[1:].sum() > 0.15 * hist.sum()  # drafts really are accepted, at every depth
    assert (hist[1:] > 0).all()
    if step_cost is not None:  # paced: plain steps too, in every draw
        assert np.asarray(out.state.plain_steps).sum() > 0
    return tokens


def p_values(tokens: np.ndarray, joint: np.ndarray) -> dict[str, float]:
    counts = lambda cols: np.histogramdd(tokens[:, cols], bins=[np.arange(VOCAB + 1)] * len(cols))[0]
    marg = lambda keep: joint.sum(axis=tuple(i for i in range(NEW) if i not in keep))
    return {"t2": chi_square_p(counts([1]), marg([1])), "t3": chi_square_p(counts([2]), marg([2])),
            "t4": chi_square_p(counts([3]), marg([3])), "t2,t3": chi_square_p(counts([1, 2]), marg([1, 2])),
            "t3,t4": chi_square_p(counts([2, 3]), marg([2, 3]))}


# Dynamic trees: Clover's sampler draws its children into a shape fixed beforehand, eagle2 chooses them
# (each tested against a point mass); "table" heads know the base model's bigrams (see table_heads).
CASES = [("medusa", SamplingConfig(temperature=1.0), TREE),
         ("clover2", SamplingConfig(temperature=1.0), TREE), ("clover2", SamplingConfig(temperature=0.7), TREE),
         ("clover", SamplingConfig(temperature=1.0, top_p=0.9), TREE),
         ("eagle", SamplingConfig(temperature=1.0), TREE), ("eagle3", SamplingConfig(temperature=0.7), TREE),
         ("eagle", SamplingConfig(temperature=1.0), "dynamic:7"), ("eagle3", SamplingConfig(temperature=1.0), "eagle2:7,4,2"),
         ("table", SamplingConfig(temperature=1.0), "eagle2:7"),
         ("table", SamplingConfig(temperature=0.7, top_p=0.9), "dynamic:7"),
         # drafts drawn flatter or sharper than the base model samples (--draft-temperature)
         ("clover2", SamplingConfig(temperature=1.0, draft_temperature=1.6), TREE),
         ("table", SamplingConfig(temperature=1.0, draft_temperature=0.6), "dynamic:7")]


@pytest.mark.parametrize("method, tree", [("clover2", TREE), ("table", "dynamic:7"), ("eagle3", TREE)],
                         ids=["static", "dynamic", "eagle3"])
def test_sampling_stays_exact_with_a_draft_vocabulary(base, method, tree):
    """Drafting from 16 of the 24 tokens: q is 0 on the other 8, which the base model still writes
    (through the residual), and the output keeps its distribution."""
    sampling = SamplingConfig(temperature=1.0)
    joint = exact_joint(base, sampling)
    assert joint.sum(axis=(0, 2, 3))[16:].sum() > 0.05  # the left-out tokens matter at t2
    tokens = sample_tokens(base, method, sampling, tree, draft_vocab=16)
    pv = p_values(tokens, joint)
    assert min(pv.values()) > 1e-3, pv


@pytest.mark.parametrize("method, sampling, tree", CASES,
                         ids=[f"{m}-T{s.temperature}-p{s.top_p}-x{s.draft_temperature}-{t.split(':')[0]}"
                              for m, s, t in CASES])
def test_speculative_sampling_has_the_base_distribution(base, method, sampling, tree):
    pv = p_values(sample_tokens(base, method, sampling, tree), exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv


@pytest.mark.parametrize("method, tree", [("clover2", TREE), ("table", "eagle2:7")], ids=["static", "dynamic"])
def test_speculative_sampling_on_gemma3_has_the_base_distribution(gemma3_base, method, tree):
    sampling = SamplingConfig(temperature=1.0)
    pv = p_values(sample_tokens(gemma3_base, method, sampling, tree), exact_joint(gemma3_base, sampling))
    assert min(pv.values()) > 1e-3, pv


def test_paced_sampling_has_the_base_distribution(base):
    """Paced by a step cost of 3 plain steps, the loop drafts at its first step (the running mean
    starts at what pays) and, accepting fewer than two drafts a step on average, takes plain steps
    after: every sample mixes both kinds of step, and the output keeps its distribution."""
    sampling = SamplingConfig(temperature=1.0)
    pv = p_values(sample_tokens(base, "clover2", sampling, step_cost=3.0), exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv


@pytest.mark.parametrize("method, tree", [("clover2", TREE), ("table", "eagle2:7")], ids=["static", "dynamic"])
def test_a_wrong_acceptance_rule_fails_the_same_test(base, monkeypatch, method, tree):
    """Accepting drafts twice as readily (min(1, 2p/q)) skews the output; the test must see it."""
    monkeypatch.setattr(speculative, "accept_probability", lambda p, q: jnp.minimum(1.0, 2 * p / q))
    jax.clear_caches()  # the same program was traced with the right rule by an earlier test
    sampling = SamplingConfig(temperature=1.0)
    pv = p_values(sample_tokens(base, method, sampling, tree), exact_joint(base, sampling))
    jax.clear_caches()  # leave no program traced with the wrong rule behind
    assert min(pv.values()) < 1e-6, pv


def test_the_draft_temperature_moves_what_is_drafted(base):
    """The same seeds at draft temperature 1 and 1.6 draw other drafts, and accept other numbers of them
    (the distribution tests above cannot tell an ignored draft temperature from a used one)."""
    gen = SpeculativeGenerator(base, noisy_heads(base, "clover2"), resolve_tree(TREE, "clover2", 3), buckets=(8,))
    hists = [gen.generate([PREFIX] * 256, NEW, SamplingConfig(temperature=1.0, draft_temperature=x), seed=0,
                          eos_ids=()).accept_hist.sum(0) for x in (1.0, 1.0, 1.6)]
    np.testing.assert_array_equal(hists[0], hists[1])
    assert (hists[0] != hists[2]).any(), hists
