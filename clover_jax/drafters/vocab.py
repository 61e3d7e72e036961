"""A draft vocabulary: the heads score only the tokens the base model actually writes.

Every draft level multiplies its nodes' vectors by the base model's lm_head, [V, D]: at batch 1 that
read is the cost of drafting (a quarter of the reference model's weights; 1 GB of Llama-3-8B's 128K
vocabulary in bfloat16), paid once per depth. Scoring only the N most frequent tokens of the heads'
training data (counted at export, `token_counts.safetensors`) cuts it to N/V, as EAGLE-3 and FR-Spec
do. It is lossless: verification still scores the whole vocabulary, so greedy output is unchanged,
and speculative sampling stays exact because a draft distribution q may be any distribution (tokens
outside the subset have q = 0: never drafted, still reachable through the residual). What it can cost
is acceptance, when the base model writes a token outside the subset, which `auto` sizes to make rare.

Greedy and sampled decoding need different subsets. Greedy text is the argmax, so counting the tokens
it writes ranks them. Sampling draws from the whole distribution, whose tail no count of greedy tokens
sees, so the export also sums the base model's probabilities (temperature 1) over the same positions,
the `mass` beside the counts, and sampling ranks tokens by that.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from clover_jax.errors import CloverError
from clover_jax.model.layers import product
from clover_jax.model.sharding import spec_for

AUTO_COVERAGE = 0.999  # greedy `auto` keeps the most frequent tokens that make up this share of the counts
# Sampling `auto` keeps the most probable tokens holding this share of the base model's probability mass:
# a draft can lose at most the mass outside the subset, so 1% bounds what acceptance gives up.
AUTO_MASS_COVERAGE = 0.99
ALIGN = 128  # `auto` rounds its size up to a multiple of this (TPU lanes; divides over a model axis)


def token_counts(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[V] int64 occurrences of each token among the trained-on targets (the tokens the heads learnt
    to predict: the base model's own responses in a self-distilled data set)."""
    return np.bincount(np.asarray(tokens)[np.asarray(loss_mask).astype(bool)], minlength=vocab_size).astype(np.int64)


def probability_mass(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """[V] float32: the base model's next-token distributions (temperature 1) summed over the positions
    `mask` [...] marks, from its logits [..., V]. What sampling draws from, where `token_counts` only
    sees the argmax greedy decoding writes."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.einsum("...v,...->v", probs, mask.astype(jnp.float32))


def _covering(weights: np.ndarray, coverage: float) -> int:
    """How many of the heaviest `weights` it takes to hold `coverage` of their sum, rounded up to ALIGN."""
    cumulative = np.cumsum(np.sort(np.asarray(weights, np.float64))[::-1]) / float(np.sum(weights, dtype=np.float64))
    return -(-(int(np.searchsorted(cumulative, coverage)) + 1) // ALIGN) * ALIGN


def parse_size(spec: str | int | None) -> str | int:
    """A `--draft-vocab` value: "auto" (also for None) or a token count >= 0 (0: the whole vocabulary)."""
    spec = "auto" if spec is None else str(spec).strip()
    if spec == "auto":
        return spec
    try:
        size = int(spec)
    except ValueError:
        raise CloverError(f"draft_vocab={spec!r}: give auto, 0 (the whole vocabulary) or a token count",
                          arguments=("draft_vocab",)) from None
    if size < 0:
        raise CloverError(f"draft_vocab={size} must be >= 0", arguments=("draft_vocab",))
    return size


def resolve_size(spec: str | int | None, counts: np.ndarray | None, vocab_size: int, greedy: bool = True,
                 mass: np.ndarray | None = None) -> int:
    """The draft vocabulary size a `--draft-vocab` value asks for; 0 means the whole vocabulary.

    auto, greedy: the most frequent tokens covering AUTO_COVERAGE of the counts. auto, sampling: the
    most probable tokens holding AUTO_MASS_COVERAGE of the probability mass; without it (heads exported
    before it existed) the whole vocabulary, since greedy counts miss the tail sampling draws from (on
    the reference model at temperature 1 a 128-token subset cut Clover-2's tau from 2.06 to 1.42).
    Either is rounded up to ALIGN; without counts, the whole vocabulary. 0: the whole vocabulary; N:
    the N top tokens (the whole vocabulary when N >= V), which needs counts (`ranking` says which)."""
    size = parse_size(spec)
    if size == "auto":
        weights, coverage = (counts, AUTO_COVERAGE) if greedy else (mass, AUTO_MASS_COVERAGE)
        if weights is None or np.sum(weights) <= 0:
            return 0
        size = _covering(weights, coverage)
    else:
        if 0 < size < vocab_size and counts is None and mass is None:
            raise CloverError(f"draft_vocab={size}: these heads carry no token counts to pick the most frequent "
                              "tokens from; re-export them with train.train, or pass draft_vocab=0",
                              arguments=("draft_vocab",))
    return 0 if size >= vocab_size else size


def ranking(counts: np.ndarray | None, mass: np.ndarray | None, greedy: bool) -> np.ndarray | None:
    """What orders the tokens for a draft vocabulary: the probability mass when sampling and the heads
    carry it, else the counts of the greedy tokens."""
    return mass if not greedy and mass is not None else counts


@flax.struct.dataclass
class DraftVocab:
    """The N tokens drafts are drawn from and their lm_head rows, kept as a copy so a draft level reads
    N rows, not V. A pytree: it travels into the jitted program beside the parameters."""

    ids: jax.Array  # [N] int32 token ids, in id order
    rows: jax.Array  # [N, D] the base model's lm_head rows of those ids

    @classmethod
    def most_frequent(cls, lm_head: jax.Array, counts: np.ndarray | None, size: int) -> "DraftVocab":
        """The `size` tokens with the largest `counts` (token counts or probability mass; ties by id; no
        counts: the first ids), with their rows of `lm_head` [V, D]."""
        v = lm_head.shape[0]
        if not 0 < size <= v:
            raise CloverError(f"a draft vocabulary of {size} tokens does not fit a vocabulary of {v}")
        if counts is not None and len(counts) != v:
            raise CloverError(f"token counts cover {len(counts)} tokens but the model has {v}; "
                              "the heads were exported for another vocabulary")
        order = np.arange(v) if counts is None else np.argsort(-np.asarray(counts), kind="stable")
        ids = jnp.asarray(np.sort(order[:size]).astype(np.int32))  # in id order: gathers read rows in order
        return cls(ids=ids, rows=jnp.take(lm_head, ids, axis=0))

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def logits(self, hidden_normed: jax.Array) -> jax.Array:
        """Draft logits over the subset: [..., D] -> [..., N] float32, index i scoring token ids[i]."""
        return product("...d,nd->...n", hidden_normed, self.rows.astype(hidden_normed.dtype)).astype(jnp.float32)

    def on_mesh(self, mesh) -> "DraftVocab":
        """Its rows split over `mesh` like the lm_head they were copied from (over the vocabulary), its
        ids replicated."""
        rows = NamedSharding(mesh, spec_for(("vocab", "embed"), self.rows.shape, mesh, "draft vocabulary"))
        return self.replace(ids=jax.device_put(self.ids, NamedSharding(mesh, PartitionSpec())),
                            rows=jax.device_put(self.rows, rows))

    def take(self, full_logits: jax.Array) -> jax.Array:
        """The subset's columns of logits over the whole vocabulary (for drafters that score all of it)."""
        return jnp.take(full_logits, self.ids, axis=-1)

    def token(self, index: jax.Array) -> jax.Array:
        """Token ids of subset indices."""
        return jnp.take(self.ids, index, axis=0)

    def index_of(self, tokens: jax.Array, vocab_size: int) -> jax.Array:
        """Subset indices of token ids (any shape), -1 for a token outside the subset: the inverse of
        `token`, which training over the subset needs for its targets."""
        table = jnp.full((vocab_size,), -1, jnp.int32).at[self.ids].set(jnp.arange(self.size, dtype=jnp.int32))
        return jnp.take(table, tokens, axis=0)

    def expand(self, q: jax.Array, vocab_size: int) -> jax.Array:
        """A distribution over the subset [..., N] as one over the whole vocabulary [..., V] (0 elsewhere),
        the q that speculative sampling's acceptance and residuals are taken against."""
        full = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype)
        return full.at[..., self.ids].set(q)
