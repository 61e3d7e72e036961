"""Turning logits into tokens: temperature, top-k and top-p, with one RNG key per sequence.

`distribution` is the single definition of "the base model's distribution" under a sampling setting:
plain sampling draws from it, and speculative sampling must reproduce it exactly. Keys are per
sequence and folded with the step, so a sequence's draws do not depend on what else is in the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from clover_jax.errors import CloverError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (hashable: a jit static argument). temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0  # 1: no nucleus truncation
    # The drafts' distribution q is the drafter's logits at temperature x draft_temperature (same top-k/top-p).
    # Any q keeps the output's distribution (a draft is kept with min(1, p/q)); q only moves how often.
    draft_temperature: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise CloverError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise CloverError(f"top_k={self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise CloverError(f"top_p={self.top_p} must be in (0, 1] (1 turns it off)")
        if not self.draft_temperature > 0:
            raise CloverError(f"draft_temperature={self.draft_temperature} must be > 0 (1 drafts at the temperature)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Up to this k, `top_k` takes k argmax passes instead of lax.top_k.
_ARGMAX_TOP_K = 64


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) of the k largest entries along the last axis, largest first, ties to the lower
    index, as `lax.top_k`. For small k it takes k argmax passes: XLA:CPU lowers `lax.top_k` over more than
    one row to a full sort, about 2 ms per 8192-wide row, which made drafting a tree dearer than verifying it."""
    if k > _ARGMAX_TOP_K:
        return jax.lax.top_k(x, k)
    vocab = jnp.arange(x.shape[-1])
    values, indices = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)
        values.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        indices.append(i.astype(jnp.int32))
        x = jnp.where(vocab == i[..., None], -jnp.inf, x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def distribution(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Probabilities [..., V] (float32) after temperature, top-k and top-p. Greedy gives one-hot argmax."""
    logits = logits.astype(jnp.float32)
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    logits = logits / cfg.temperature
    neg = jnp.finfo(jnp.float32).min
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, neg)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (HF's rule).
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        keep_sorted = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < cfg.top_p
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def draft_distribution(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The distribution sampled drafts are drawn from: `distribution` with the temperature scaled by
    `cfg.draft_temperature`. Heads distilled from greedy text can be sharper or flatter than the base model
    at the sampling temperature; a q nearer p is kept more often."""
    return distribution(logits.astype(jnp.float32) / cfg.draft_temperature, cfg)


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
    """Per-sequence keys [B, 2] for one step: each sequence's key folded with the step number."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)


# What a speculative step's key is used for; `use_keys` folds one of these in first, then the indices.
DRAW, ACCEPT, BONUS = 0, 1, 2


def use_keys(keys: jax.Array, use: int, *index) -> jax.Array:
    """Per-sequence keys [B, 2] for one use of a step's keys [B, 2] (`DRAW` a depth's children, `ACCEPT`
    the test of child r at depth d, `BONUS` the bonus token), one fold per index: distinct uses and
    indices give distinct keys however many children a level has (a single salted integer such as
    1000 d + r would repeat once r reaches 1000)."""
    for tag in (use, *index):
        keys = step_keys(keys, tag)
    return keys


def draw(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """One index per row of probs [B, ..., V] (non-negative, any scale, not all 0) with per-sequence keys
    [B, 2]: indices [B, ...] int32, by the inverse CDF. One uniform per row, where a Gumbel draw
    (`jax.random.categorical`) makes V of them and two logs of each: on a CPU, for SmolLM2's 49,152
    tokens, 0.24 ms against 1.8 ms (a twentieth of a decoding step)."""
    cdf = jnp.cumsum(probs.astype(jnp.float32), axis=-1)
    total = cdf[..., -1:]
    u = jax.vmap(lambda key: jax.random.uniform(key, probs.shape[1:-1]))(keys)[..., None]
    # u < 1, but u * total can round up to total; below it, the first index past it has mass.
    threshold = jnp.minimum(u * total, jnp.nextafter(total, 0.0))
    return jnp.argmax(cdf > threshold, axis=-1).astype(jnp.int32)


# Up to this many draws, `draw_without_replacement` draws one at a time; past it, one Gumbel top-k.
_SEQUENTIAL_DRAWS = 2


def draw_without_replacement(q: jax.Array, keys: jax.Array, k: int) -> jax.Array:
    """k draws without replacement from each row of q [B, ..., V], in draw order, with per-sequence keys
    [B, 2]: indices [B, ..., k]. Few draws are made in turn (`draw`, each from q without the ones before);
    more as the Gumbel top-k, which costs a Gumbel draw per entry for all k at once."""
    if k > _SEQUENTIAL_DRAWS:
        gumbel = jax.vmap(lambda key, x: jax.random.gumbel(key, x.shape))(keys, q)
        return top_k(jnp.log(q) + gumbel, k)[1]
    vocab, drawn = jnp.arange(q.shape[-1]), []
    for r in range(k):
        drawn.append(draw(q, step_keys(keys, r)))
        q = jnp.where(vocab == drawn[-1][..., None], 0.0, q)
    return jnp.stack(drawn, axis=-1)


def sample(logits: jax.Array, keys: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Draw one token per row. logits [B, V], keys [B, 2] -> [B] int32."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draw(distribution(logits, cfg), keys)
