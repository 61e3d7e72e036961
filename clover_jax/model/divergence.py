"""Where two greedy texts of one prompt part, and how near a tie the base model's logits were there.

Greedy speculative decoding writes plain decoding's tokens exactly in float32. In bfloat16 it cannot
promise that bit for bit: a verification pass multiplies many rows at once and plain decoding one,
the products round apart, and where the base model's two best tokens lie within that rounding of each
other the argmax can go the other way; the texts part there. `first_divergence` finds where two texts
part; `divergences` runs the base model once over a prompt and a reference text (plain decoding's)
and reads, at each other text's first divergence, how far apart its two best logits were, so that a
benchmark (and a test) can show that every parting sits at such a near-tie.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.model.llama import Llama, causal_self_mask


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where a text first differs from a reference text of the same prompt, and the base model's logits
    there, from one forward pass over the prompt and the tokens the two texts share."""

    index: int  # the first token index (0: the first generated token) at which the texts differ
    token: int | None  # the reference's token there (None: the reference ended first)
    other: int | None  # the other text's token there (None: it ended first)
    gap: float | None  # logit[token] - logit[other] there (None where a text ended first)
    top2_gap: float | None  # the largest logit there minus the second largest
    scale: float | None  # the largest |logit| there, what the logits' rounding is relative to
    ulp: float | None  # the model dtype's spacing at `scale`: 2**(floor(log2 scale) - mantissa bits)

    @property
    def gap_ulps(self) -> float | None:
        """|gap| in units of `ulp`: a few of them is within the logits' rounding."""
        return None if self.gap is None or not self.ulp else abs(self.gap) / self.ulp


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first index at which the two token lists differ, the shorter one's length where one is a
    prefix of the other; None where they are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def spacing(value: float, dtype) -> float:
    """The distance between `value` (> 0) and the next larger number of `dtype`: bfloat16 keeps 7 bits
    of mantissa, so 2**-7 of the power of two at or below `value`; float32 keeps 23."""
    return 2.0 ** (math.floor(math.log2(value)) - jnp.finfo(dtype).nmant)


def _padded(n: int, least: int) -> int:
    """A power of two >= n (and >= least): few compiled shapes for any prompt and text length."""
    return max(least, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, params, tokens: jax.Array, rows: jax.Array) -> jax.Array:
    """tokens [1, T] (padded after the text; causal, so the padding reaches no row before it), rows [K]
    -> the logits [K, V] float32 of those positions, from one cache-free forward."""
    model = nnx.merge(graphdef, params)
    t = tokens.shape[1]
    out = model(tokens, jnp.arange(t, dtype=jnp.int32)[None], causal_self_mask(1, t), with_logits=False, causal=True)
    return model.logits(out.hidden_normed[0, rows])


def logits_along(model: Llama, prompt: Sequence[int], text: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """The base model's logits [len(indices), V] float32 that predict `text[i]` for each i of `indices`
    (0: the first token after `prompt`), from one forward over the prompt and `text` up to the latest
    index, padded to a power of two so that few lengths compile."""
    if not prompt:
        raise ValueError("logits_along needs the prompt (at least one token) the text continues")
    indices = list(indices)
    seq = list(prompt) + list(text[: max(indices)])
    tokens = np.zeros((1, _padded(len(seq), 16)), np.int32)
    tokens[0, : len(seq)] = seq
    rows = np.zeros((_padded(len(indices), 4),), np.int32)  # the logits predicting token i sit at row P + i - 1
    rows[: len(indices)] = [len(prompt) + i - 1 for i in indices]
    graphdef, params = nnx.split(model)
    return np.asarray(_logits_at(graphdef, params, jnp.asarray(tokens), jnp.asarray(rows)))[: len(indices)]


def divergences(model: Llama, prompt: Sequence[int], reference: Sequence[int],
                texts: Sequence[Sequence[int]]) -> list[Divergence | None]:
    """For each of `texts` (generated after `prompt`, like `reference`): None where it equals
    `reference`, else its `Divergence` from it. One forward of `model` over the prompt and the
    reference, as far as the latest first divergence needs, gives every text's logits: the texts agree
    with the reference up to their divergence, so the reference's prefix is theirs too.

    The logits come from a pass over many positions at once, so they round as a verification pass
    rounds, not as plain decoding's one-token steps do; either run's logits lie within the rounding
    bound of these, which is what a near-tie is measured against."""
    found = [first_divergence(reference, t) for t in texts]
    wanted = sorted({i for i in found if i is not None})
    if not wanted:
        return [None] * len(texts)
    at = dict(zip(wanted, logits_along(model, prompt, reference, wanted)))
    out = []
    for i, text in zip(found, texts):
        if i is None:
            out.append(None)
            continue
        row = at[i]
        token = reference[i] if i < len(reference) else None
        other = text[i] if i < len(text) else None
        top2 = np.sort(row)[-2:]
        scale = float(np.abs(row).max())
        out.append(Divergence(
            index=i, token=token, other=other,
            gap=None if token is None or other is None else float(row[token] - row[other]),
            top2_gap=float(top2[1] - top2[0]), scale=scale,
            ulp=spacing(scale, model.dtype) if scale > 0 else None))
    return out


def compare(model: Llama, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
            texts: Sequence[Sequence[int]]) -> list[Divergence | None]:
    """Per prompt: None where its text is its reference (plain decoding's), else where it parted
    (`divergences`); one forward of `model` per prompt that parted, none for the rest."""
    if not len(prompts) == len(references) == len(texts):
        raise ValueError(f"{len(prompts)} prompts, {len(references)} references and {len(texts)} texts")
    return [divergences(model, p, r, [t])[0] for p, r, t in zip(prompts, references, texts)]
