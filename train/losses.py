"""What training and evaluation measure of a drafter beyond its loss (the losses live beside the
drafters, `clover_jax.drafters.losses` and each method's module): top-k accuracy, where each target ranks
in the teacher-forced drafts (`target_ranks`), and decoding's steps replayed over those ranks.

`tree_steps` replays decoding's steps over the same teacher-forced drafts, which gives the tokens per
step a chain through every head, or any static tree, will reach; per-head accuracy overstates it
(docs/history/benchmarks.md). When sampling, a draft is kept with probability sum_v min(p(v), q(v))
(`accept_probability`), so `sampled_chain_tau` gives what a chain reaches at a temperature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.training import masked_mean, shifted, to_host


def scoreable(head_logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[K, B, T] bool: whether a prediction can be scored at all: no NaN among its logits and a finite
    logit for the target. A NaN compares false with everything, so an unguarded rank would come out 0
    (the top draft, a hit) and NaN heads would score the best chain tau there is."""
    target_logit = jnp.take_along_axis(head_logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    return ~jnp.any(jnp.isnan(head_logits), axis=-1) & jnp.isfinite(target_logit)


def topk_accuracy(head_logits: jax.Array, targets: jax.Array, masks: jax.Array, k: int) -> jax.Array:
    """Per-head top-k accuracy [K] of the drafted token against the data's next tokens; a prediction
    that is not finite (`scoreable`) is a miss."""
    top = jax.lax.top_k(head_logits, k)[1]
    hit = (jnp.any(top == targets[..., None], axis=-1) & scoreable(head_logits, targets)).astype(jnp.float32)
    return jax.vmap(masked_mean)(hit, masks)


RANK_CAP = 64  # a target ranked this low or lower is a miss: no tree drafts that many children of one node


def target_ranks(head_logits: jax.Array, targets: jax.Array, masks: jax.Array, cap: int = RANK_CAP) -> jax.Array:
    """[K, B, T] int32: where the data's token t+2+k ranks in head k's logits at position t (0: the top-1
    draft; ties go to the lower token id, as argmax and top_k break them); `cap` where the target is not
    counted (mask), lies outside the scored vocabulary (target < 0), ranks `cap` or lower or cannot be
    ranked (a NaN logit, `scoreable`). A tree node
    whose path of child ranks equals these ranks drafts exactly the data's tokens."""
    safe = jnp.maximum(targets, 0)[..., None]
    target_logit = jnp.take_along_axis(head_logits, safe, axis=-1)
    ids = jnp.arange(head_logits.shape[-1])
    ahead = (head_logits > target_logit) | ((head_logits == target_logit) & (ids < safe))
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)
    return jnp.where((masks > 0) & (targets >= 0) & (rank < cap) & scoreable(head_logits, targets), rank, cap)


def chain_paths(depth: int) -> frozenset:
    """A chain through `depth` heads as a set of rank paths: (0,), (0, 0), ..."""
    return frozenset((0,) * d for d in range(1, depth + 1))


def replay_steps(ranks: np.ndarray, paths: frozenset, start: int, stop: int) -> np.ndarray:
    """[D+1] counts of decoding steps accepting 0..D drafts on the static tree `paths` (rank tuples, D the
    deepest), replayed over one sequence from its teacher-forced ranks [K >= D, T]. A step at position t
    (its root being token t+1) accepts the deepest node whose path is the run ranks[:d, t]: the only
    node of each depth that drafts the data's tokens (none past a rank at RANK_CAP, a miss). The next step's root is the bonus token that
    follows them, so it sits at t + accepted + 1. Steps run while start <= t < stop."""
    depth = max(map(len, paths))
    hist = np.zeros(depth + 1, np.int64)
    t = start
    while t < stop:
        accepted = 0
        while (accepted < depth and ranks[accepted, t] < RANK_CAP
               and tuple(ranks[: accepted + 1, t].tolist()) in paths):
            accepted += 1
        hist[accepted] += 1
        t += accepted + 1
    return hist


def _response_steps(loss_mask_row: np.ndarray, depth: int) -> tuple[int, int] | None:
    """(start, stop) of a row's steps for a tree `depth` deep: from its first response token as the root
    until the deepest draft's target leaves the response, so no step is cut short by the window's end."""
    roots = np.flatnonzero(loss_mask_row[1:])  # positions t whose root, token t+1, is a response token
    full = np.flatnonzero(loss_mask_row[depth + 1:])  # positions t whose deepest target, t+1+depth, is one
    return (int(roots[0]), int(full[-1]) + 1) if len(roots) and len(full) else None


def tree_steps(ranks: np.ndarray, loss_mask: np.ndarray, paths: frozenset) -> np.ndarray:
    """[D+1] `replay_steps` counts summed over a batch of windows (ranks [K, B, T] from `target_ranks`,
    loss_mask [B, T])."""
    depth = max(map(len, paths))
    total = np.zeros(depth + 1, np.int64)
    for b, row in enumerate(np.asarray(loss_mask) > 0):
        span = _response_steps(row, depth)
        if span:
            total += replay_steps(ranks[:, b], paths, *span)
    return total


def path_counts(ranks: np.ndarray, loss_mask: np.ndarray, depth: int, counts: dict | None = None) -> dict:
    """How often each rank path (up to `depth` deep) drafts the data's tokens, over every position a step
    could start at: at position t, the prefixes of ranks[:, t] up to its first miss. Summed into and
    returned as `counts` {path tuple: count}, what `clover_jax.tree.fit` builds a tree from."""
    counts = {} if counts is None else counts
    for b, row in enumerate(np.asarray(loss_mask) > 0):
        span = _response_steps(row, depth)
        if not span:
            continue
        for column in ranks[:depth, b, span[0]:span[1]].T.tolist():
            for d in range(depth):
                if column[d] >= RANK_CAP:
                    break
                path = tuple(column[: d + 1])
                counts[path] = counts.get(path, 0) + 1
    return counts


# The temperatures whose held-out chain tau training and evaluation record beside the greedy one, which
# `--tree auto` picks a chain by when sampling.
SAMPLED_TEMPERATURES = (1.0,)


def accept_probability(head_logits: jax.Array, base_logits: jax.Array, masks: jax.Array,
                       temperature: float) -> jax.Array:
    """[K, B, T]: the chance that speculative sampling at `temperature` keeps head k's draft at position t,
    sum_v min(p(v), q(v)), p the base model's distribution of token t+2+k (its logits at position t+1+k)
    and q the head's, both at the temperature over the same vocabulary (drafts drawn at the temperature,
    as `draft_temperature` 1 draws them); 0 where the target does not count (masks), lies past the
    window or a logit is NaN."""
    k = head_logits.shape[0]
    p = jax.nn.softmax(shifted(base_logits, k).astype(jnp.float32) / temperature, axis=-1)
    q = jax.nn.softmax(head_logits.astype(jnp.float32) / temperature, axis=-1)
    kept = jnp.sum(jnp.minimum(p, q), axis=-1)
    t = head_logits.shape[2]
    inside = (jnp.arange(t)[None, :] + jnp.arange(1, k + 1)[:, None] < t)[:, None, :]  # token t+2+k's logits exist
    return jnp.where((masks > 0) & inside & jnp.isfinite(kept), kept, 0.0)


def sampled_chain_steps(accept: np.ndarray, loss_mask: np.ndarray, depth: int) -> tuple[float, int]:
    """(expected accepted drafts summed, steps) of chains `depth` deep started at every position a step
    could start at (`_response_steps`), each accepting draft d with the product of the first d
    `accept_probability` values [K, B, T] there: what a sampled chain step accepts on average."""
    survive = np.cumprod(np.asarray(accept, np.float64)[:depth], axis=0)  # [D, B, T]: drafts 1..d all kept
    total, steps = 0.0, 0
    for b, row in enumerate(np.asarray(loss_mask) > 0):
        span = _response_steps(row, depth)
        if span:
            total += float(survive[:, b, span[0]:span[1]].sum())
            steps += span[1] - span[0]
    return total, steps


def tau_of(hist: np.ndarray) -> float:
    """Mean tokens per step, the bonus token included, of a [K+1] histogram of accepted drafts."""
    return float(1 + hist @ np.arange(len(hist)) / max(hist.sum(), 1))


def held_out_figures(batch_metrics, batches, limit: int, kept: list | None = None) -> dict:
    """The held-out figures train.train records and train.evaluate measures: over the first `limit` of
    `batches`, the mean loss, each head's top-1 and top-5 accuracy, and the chain tau of chains through
    the first 1, 2, ... heads (decoding's steps replayed over the responses). `batch_metrics(batch)`
    gives `head_loss`'s metrics with ranks and acceptance (`accept`: [S, K, B, T], one
    `accept_probability` per SAMPLED_TEMPERATURES); the chain tau when sampling at each of those
    temperatures is `val_sampled_chain_tau_by_depth` {"1": [...]}. Each batch's (ranks, loss mask) on
    the host is appended to `kept` when given, for replaying trees afterwards. Empty when there is no batch."""
    sums, n, steps, sampled = None, 0, {}, {}
    for i, batch in enumerate(batches):
        if i >= limit:
            break
        m = batch_metrics(batch)
        ranks = to_host(m.pop("ranks"))
        for depth in range(1, len(ranks) + 1):  # a chain through the first `depth` heads
            steps[depth] = steps.get(depth, 0) + tree_steps(ranks, batch["loss_mask"], chain_paths(depth))
        for temperature, accept in zip(SAMPLED_TEMPERATURES, to_host(m.pop("accept"))):
            for depth in range(1, len(ranks) + 1):
                got = sampled_chain_steps(accept, batch["loss_mask"], depth)
                was = sampled.get((temperature, depth), (0.0, 0))
                sampled[(temperature, depth)] = (was[0] + got[0], was[1] + got[1])
        if kept is not None:
            kept.append((ranks, np.asarray(batch["loss_mask"])))
        m = jax.device_get(m)
        sums = m if sums is None else jax.tree.map(np.add, sums, m)
        n += 1
    if not n:
        return {}
    m = jax.tree.map(lambda x: np.asarray(x) / n, sums)
    return {"val_loss": float(m["loss"]), "val_top1": m["top1"].tolist(), "val_top5": m["top5"].tolist(),
            "val_chain_tau": tau_of(steps[max(steps)]),
            "val_chain_tau_by_depth": [tau_of(steps[d]) for d in sorted(steps)],
            "val_sampled_chain_tau_by_depth": {
                f"{t:g}": [1 + sampled[(t, d)][0] / max(sampled[(t, d)][1], 1) for d in sorted(steps)]
                for t in SAMPLED_TEMPERATURES}}
