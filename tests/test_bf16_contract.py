"""bfloat16's contract: greedy speculative text may part from plain decoding's, but only at near-ties.

In float32 greedy speculative output is plain decoding's token for token (tests/test_speculative.py).
In bfloat16 a verification pass multiplies many rows at once and plain decoding one, the two round
apart, and where the base model's two best logits lie within that rounding the argmax can go the other
way. These tests show both halves on tiny random models on the CPU: the texts do part, and every first
parting sits at a near-tie of the base model's own logits, under the bound below.

The bound. bfloat16 keeps 8 significant bits, so each rounding moves a value by at most u = 2**-8 of
itself. A logit is the end of a chain of R roundings: per decoder layer 13 (the two RMSNorms, the q/k/v
projection, attention's scores, softmax and weighted sum, the output projection, the MLP's gate and up
projections, their product and the down projection, the two residual sums), then the final norm and the
output projection: R = 13 L + 2. A rounding that comes out differently in the two runs moves the hidden
state by about u of its size, and a logit by about u of the logits' size (`scale`, the largest |logit|
there); such errors add with random signs, so one run's logits stray from exact arithmetic by about
sqrt(R) u scale, and the gap between two tokens differs between two runs by about sqrt(2 R) u scale.
Two runs rank two tokens apart only where that gap is under this bound, and a third computation of the
logits (`divergence.logits_along`, the measurement) lies within it too. For the two-layer models here,
R = 28 and the bound is 0.029 scale (4 to 7 of bfloat16's spacings at the largest logit). It must also
say something: most positions of the texts have a wider top-2 gap, so that partings at random places
would not all fall under it. (Measured on a 2-core x86 CPU: about 15 partings, each within 1.2 spacings;
15-30% of all positions under the bound.)
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters import registry
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.engine.decode import Generator, prefill
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.model.cache import causal_mask
from clover_jax.model.config import ModelConfig
from clover_jax.model.divergence import Divergence, divergences, first_divergence, logits_along, spacing
from clover_jax.model.llama import Llama
from clover_jax.trees.spec import resolve_tree

CFG = ModelConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2)
ROUNDINGS = 13 * CFG.num_layers + 2  # R above
BOUND = math.sqrt(2 * ROUNDINGS) * 2.0 ** -8  # of the largest |logit|
_rng = np.random.default_rng(1)
PROMPTS = [[1] + _rng.integers(3, CFG.vocab_size, size=int(_rng.integers(3, 20))).tolist() for _ in range(32)]
MAX_NEW = 48
SEEDS = (0, 2)  # base models whose plain and speculative bfloat16 texts part on several prompts
METHODS = (("medusa", "widths:4,2"), ("clover2", "widths:4,2"))


def perturb(heads, seed: int, scale: float = 0.02):
    """Heads moved off their identity-like init by N(0, scale^2) noise, so they draft varied (partly
    wrong) tokens, as tests/test_speculative.py's random heads do."""
    leaves, treedef = jax.tree.flatten(nnx.state(heads, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(heads, jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                                   for x, k in zip(leaves, keys)]))
    return heads


def base_model(seed: int, dtype=jnp.bfloat16) -> Llama:
    return Llama(CFG, dtype=dtype, rngs=nnx.Rngs(seed))


def top2_gaps(model: Llama, prompt: list[int], text: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per position of `text`: the base model's top-2 logit gap and its largest |logit|."""
    logits = logits_along(model, prompt, text, range(len(text)))
    top = np.sort(logits, -1)[:, -2:]
    return top[:, 1] - top[:, 0], np.abs(logits).max(-1)


def test_first_divergence_and_the_logits_it_reads():
    assert first_divergence([4, 5, 6], [4, 5, 6]) is None
    assert first_divergence([4, 5, 6], [4, 9, 6]) == 1
    assert first_divergence([4, 5], [4, 5, 6]) == 2  # the reference ended first
    model = base_model(0)
    prompt, text = PROMPTS[0], [7, 8, 9, 10]
    logits = logits_along(model, prompt, text, [0, 2])
    assert logits.shape == (2, CFG.vocab_size) and logits.dtype == np.float32
    same, parted, shorter = divergences(model, prompt, text, [text, [7, 8, 30, 10], [7, 8]])
    assert same is None and isinstance(parted, Divergence)
    assert (parted.index, parted.token, parted.other) == (2, 9, 30)
    np.testing.assert_allclose(parted.gap, logits[1, 9] - logits[1, 30])
    assert parted.scale == pytest.approx(float(np.abs(logits[1]).max()))
    assert parted.ulp == spacing(parted.scale, jnp.bfloat16) and parted.scale / 2 ** 7 >= parted.ulp > parted.scale / 2 ** 8
    assert (shorter.index, shorter.other, shorter.gap) == (2, None, None)


def test_bfloat16_texts_part_from_plain_only_at_near_ties_of_the_base_model():
    """Over two random models, two methods and 32 prompts of 48 tokens, some speculative texts part
    from plain decoding's (so exactness cannot be promised in bfloat16), every first parting has the
    two tokens' logits within BOUND of the largest |logit| there, and most positions of the texts do
    not: were the partings placed at random, all of them landing under it would be a long shot."""
    parted: dict[tuple, Divergence] = {}  # (seed, prompt, index): a parting, whichever method found it
    gaps, scales = [], []
    for seed in SEEDS:
        base = base_model(seed)
        plain = Generator(base).generate(PROMPTS, MAX_NEW, eos_ids=[]).tokens
        for method, spec in METHODS:
            heads = perturb(make_heads(drafter_config(method, registry.get(method).depth), base, seed=3), seed=4)
            gen = SpeculativeGenerator(base, heads, resolve_tree(spec, method, heads.num_heads))
            out = gen.generate(PROMPTS, MAX_NEW, eos_ids=[])
            assert out.tau > 1  # verification passes of several rows did run
            for k, (prompt, ref, text) in enumerate(zip(PROMPTS, plain, out.tokens)):
                [d] = divergences(base, prompt, ref, [text])
                if d is not None:
                    parted[seed, k, d.index] = d
        for prompt, ref in zip(PROMPTS, plain):
            g, s = top2_gaps(base, prompt, ref)
            gaps.append(g)
            scales.append(s)
    assert len(parted) >= 4, f"bfloat16 texts parted from plain decoding's at only {len(parted)} places"
    for where, d in parted.items():
        assert d.gap is not None and abs(d.gap) <= BOUND * d.scale, (where, d)
    gaps, scales = np.concatenate(gaps), np.concatenate(scales)
    under = float(np.mean(gaps <= BOUND * scales))
    assert under < 0.5, f"{under:.0%} of all positions are near-ties: the bound says nothing"
    assert under ** len(parted) < 1e-3


@functools.partial(jax.jit, static_argnums=(0, 5))
def _one_token_logits(graphdef, params, prompt, length, text, cache_len: int):
    """Plain decoding's logits along `text` [1, M] after `prompt` [1, P] (its first `length` [1] tokens;
    padded, so that every prompt runs one program): the prefill's at the prompt's
    last token, then one one-token step per token of the text, each over the cache, as
    `engine.decode.continue_plain` steps. -> [M, V] (the last one predicts past the text)."""
    model = nnx.merge(graphdef, params)
    out, first = prefill(model, prompt, length, cache_len)

    def step(cache, token):
        o = model(token[None, None], cache.lengths[:, None], causal_mask(cache.lengths, 1, cache_len), cache)
        return o.cache.advance(jnp.ones((1,), jnp.int32)), o.logits[0, 0]

    _, rest = jax.lax.scan(step, out.cache, text[0])
    return jnp.concatenate([first, rest[:-1]], 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_a_pass_over_many_tokens_rounds_apart_from_one_token_steps_within_the_bound(dtype):
    """The cause, constructed: the logits a forward over many positions computes (as verification
    does) against those of one-token steps over the cache (as plain decoding does), along plain
    decoding's texts. In float32 they agree to float32's rounding; in bfloat16 they differ somewhere, always by
    less than BOUND of the largest |logit|."""
    model = base_model(0, dtype)
    gen = Generator(model)
    plain = gen.generate(PROMPTS[:8], MAX_NEW, eos_ids=[]).tokens
    graphdef, params = nnx.split(model)
    worst, differs = 0.0, False
    for prompt, text in zip(PROMPTS[:8], plain):
        padded = jnp.asarray([prompt + [0] * (32 - len(prompt))])
        steps = np.asarray(_one_token_logits(graphdef, params, padded, jnp.asarray([len(prompt)]),
                                             jnp.asarray([text]), gen.max_len))
        many = logits_along(model, prompt, text, range(len(text)))
        scale = np.abs(steps).max(-1, keepdims=True)
        worst = max(worst, float((np.abs(steps - many) / scale).max()))
        differs |= not np.array_equal(steps, many)
        # The replay is plain decoding's own steps, but at batch 1, where the generator ran a batch
        # of 8: in float32 it writes the same tokens; in bfloat16 too, but for near-ties.
        top = np.sort(steps, -1)[:, -2:]
        other = steps.argmax(-1) != np.asarray(text)
        assert not (other.any() and dtype == jnp.float32)
        assert (top[other, 1] - top[other, 0] <= BOUND * scale[other, 0]).all()
    if dtype == jnp.float32:
        assert worst < 1e-5
    else:
        assert differs and worst < BOUND, worst
