"""The heads' training losses (SPEC section 2), on teacher-forced drafts from `Heads.unroll`.

Head k at position t drafts token t+2+k. Medusa and Clover learn it by cross-entropy on that token;
Clover-2 distils the base model at position t+1+k instead (the position whose output is that token's
distribution): 10 * SmoothL1 between the head's lm_head input and the base model's normed hidden state
there, plus the soft cross-entropy against the base model's softmax. Head k is weighted 0.7^k; only
targets inside the response (loss mask) and inside the sequence count.

`tree_steps` replays decoding's steps over the same teacher-forced drafts (where each target ranks,
`target_ranks`), which gives the tokens per step a chain through every head, or any static tree, will
reach; per-head accuracy overstates it (docs/history/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clover_jax.engine.decode import to_host

HEAD_DECAY = 0.7
HIDDEN_WEIGHT = 10.0
EAGLE_CE_WEIGHT = 0.1  # EAGLE-1: SmoothL1 on the feature + 0.1 x cross-entropy
EAGLE3_DECAY = 0.8  # EAGLE-3: training-time test step k weighted 0.8^k (the authors' main.py)


def shift_left(x: jax.Array, n: int) -> jax.Array:
    """x[:, t + n] at position t, zero past the end. x [B, T, ...]."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)[:, : x.shape[1]]


def target_mask(loss_mask: jax.Array, k: int) -> jax.Array:
    """[B, T] float: position t trains head k when token t+2+k exists and is a response token."""
    return shift_left(loss_mask.astype(jnp.float32), k + 2)


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
    """SmoothL1 (beta 1) averaged over the last axis, as PyTorch's SmoothL1Loss then a mean over D."""
    d = jnp.abs(pred.astype(jnp.float32) - target.astype(jnp.float32))
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def soft_cross_entropy(logits: jax.Array, target_probs: jax.Array) -> jax.Array:
    """-sum_v p(v) log q(v), over the last axis."""
    return -jnp.sum(target_probs * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def base_distribution(base_logits: jax.Array) -> jax.Array:
    """The base model's distribution at every position [B, T, V], a constant of the loss. Step (head) k
    learns it at t+1+k: the losses take it once and shift it by k + 1 (`shift_left`; the rows shifted
    in past the end are masked), where a softmax per step made EAGLE-3's loss, forward and backward,
    1.7 s instead of 1.0 at SmolLM2's shapes (7 steps x 4 x 512 x 8,192, 2-core CPU)."""
    return jax.lax.stop_gradient(jax.nn.softmax(base_logits.astype(jnp.float32), -1))


def targets_and_masks(tokens, loss_mask, k_heads):
    """(targets [K, B, T], masks [K, B, T]): head k's target at t is token t+2+k, counted where
    `target_mask` says."""
    return (jnp.stack([shift_left(tokens, k + 2) for k in range(k_heads)]),
            jnp.stack([target_mask(loss_mask, k) for k in range(k_heads)]))


def head_weights(num_heads: int) -> jax.Array:
    return HEAD_DECAY ** jnp.arange(num_heads, dtype=jnp.float32)


def cross_entropy_loss(head_logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array):
    """Medusa / Clover. head_logits [K, B, T, V], tokens and loss_mask [B, T].
    Returns (weighted loss, per-head losses [K], per-head masks [K, B, T], per-head targets [K, B, T])."""
    k_heads = head_logits.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    ce = optax.softmax_cross_entropy_with_integer_labels(head_logits.astype(jnp.float32), targets)
    per_head = jax.vmap(masked_mean)(ce, masks)
    return jnp.sum(head_weights(k_heads) * per_head), per_head, masks, targets


def distill_loss(head_hidden: jax.Array, head_logits: jax.Array, base_normed: jax.Array,
                 base_logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array, base_hidden=None):
    """Clover-2. head_hidden [K, B, T, D], head_logits [K, B, T, V]; base_normed [B, T, D] and
    base_logits [B, T, V] of the base model at every position. Same returns as `cross_entropy_loss`."""
    k_heads = head_hidden.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    p_base = base_distribution(base_logits)
    per_head = []
    for k in range(k_heads):
        h_target = jax.lax.stop_gradient(shift_left(base_normed, k + 1))
        p_target = shift_left(p_base, k + 1)
        loss = HIDDEN_WEIGHT * smooth_l1(head_hidden[k], h_target) + soft_cross_entropy(head_logits[k], p_target)
        per_head.append(masked_mean(loss, masks[k]))
    per_head = jnp.stack(per_head)
    return jnp.sum(head_weights(k_heads) * per_head), per_head, masks, targets


def method_cross_entropy(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """`cross_entropy_loss` under the signature every entry of LOSSES shares."""
    return cross_entropy_loss(head_logits, tokens, loss_mask)


def eagle_loss(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """EAGLE-1 on the training-time test's steps (`eagle.EagleDrafter.unroll`): at step k the draft
    layer's output predicts the base model's feature at t+1+k (before the final norm, base_hidden
    [B, T, D]): SmoothL1 to it plus 0.1 x the soft cross-entropy against the base model's distribution
    there. EAGLE-1 trains the first step alone (on the target features); the deeper steps are scored
    (per-head losses, accuracy) but weighted 0."""
    k_heads = head_hidden.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    p_base = base_distribution(base_logits)
    per_head = []
    for k in range(k_heads):
        f_target = jax.lax.stop_gradient(shift_left(base_hidden, k + 1))
        p_target = shift_left(p_base, k + 1)
        loss = smooth_l1(head_hidden[k], f_target) + EAGLE_CE_WEIGHT * soft_cross_entropy(head_logits[k], p_target)
        per_head.append(masked_mean(loss, masks[k]))
    per_head = jnp.stack(per_head)
    return per_head[0], per_head, masks, targets


def eagle3_loss(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """EAGLE-3's training-time test: step k (weighted 0.8^k) learns the base model's distribution at
    t+1+k restricted to the draft vocabulary (the tokens whose head logits are not `eagle.NO_LOGIT`),
    by soft cross-entropy, where the base model's own choice there is in that vocabulary. No feature
    loss. `train.train` hands it logits over the draft vocabulary itself (`Eagle3.loss_vocab`), all of
    them finite, with the targets outside it already masked: the same loss where the data's tokens are
    the base model's own choices (self-distilled data)."""
    k_heads = head_logits.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    in_vocab = head_logits[0, :1, :1] > -1e8  # [1, 1, V]: the draft vocabulary
    p_base = base_distribution(jnp.where(in_vocab, base_logits, -1e9))
    base_drafted = jnp.take(in_vocab[0, 0], jnp.argmax(base_logits, -1)).astype(jnp.float32)  # [B, T]
    per_head = []
    for k in range(k_heads):
        p_target, drafted = shift_left(p_base, k + 1), shift_left(base_drafted, k + 1)
        per_head.append(masked_mean(soft_cross_entropy(head_logits[k], p_target), masks[k] * drafted))
    per_head = jnp.stack(per_head)
    return jnp.sum(EAGLE3_DECAY ** jnp.arange(k_heads, dtype=jnp.float32) * per_head), per_head, masks, targets


# The training losses a method's registry entry (`clover_jax.drafters.registry.Method.loss`) can name; each takes
# (head_hidden [K, B, T, D], head_logits [K, B, T, V], base_normed [B, T, D], base_logits [B, T, V],
# tokens [B, T], loss_mask [B, T], base_hidden [B, T, D]) and returns (loss, per-head losses [K],
# masks [K, B, T], targets [K, B, T]).
LOSSES = {"cross_entropy": method_cross_entropy, "distill": distill_loss, "eagle": eagle_loss, "eagle3": eagle3_loss}


def topk_accuracy(head_logits: jax.Array, targets: jax.Array, masks: jax.Array, k: int) -> jax.Array:
    """Per-head top-k accuracy [K] of the drafted token against the data's next tokens."""
    top = jax.lax.top_k(head_logits, k)[1]
    hit = jnp.any(top == targets[..., None], axis=-1).astype(jnp.float32)
    return jax.vmap(masked_mean)(hit, masks)


RANK_CAP = 64  # a target ranked this low or lower is a miss: no tree drafts that many children of one node


def target_ranks(head_logits: jax.Array, targets: jax.Array, masks: jax.Array, cap: int = RANK_CAP) -> jax.Array:
    """[K, B, T] int32: where the data's token t+2+k ranks in head k's logits at position t (0: the top-1
    draft; ties go to the lower token id, as argmax and top_k break them); `cap` where the target is not
    counted (mask), lies outside the scored vocabulary (target < 0) or ranks `cap` or lower. A tree node
    whose path of child ranks equals these ranks drafts exactly the data's tokens."""
    safe = jnp.maximum(targets, 0)[..., None]
    target_logit = jnp.take_along_axis(head_logits, safe, axis=-1)
    ids = jnp.arange(head_logits.shape[-1])
    ahead = (head_logits > target_logit) | ((head_logits == target_logit) & (ids < safe))
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)
    return jnp.where((masks > 0) & (targets >= 0) & (rank < cap), rank, cap)


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


def tau_of(hist: np.ndarray) -> float:
    """Mean tokens per step, the bonus token included, of a [K+1] histogram of accepted drafts."""
    return float(1 + hist @ np.arange(len(hist)) / max(hist.sum(), 1))


def held_out_figures(batch_metrics, batches, limit: int, kept: list | None = None) -> dict:
    """The held-out figures train.train records and train.evaluate measures: over the first `limit` of
    `batches`, the mean loss, each head's top-1 and top-5 accuracy, and the chain tau of chains through
    the first 1, 2, ... heads (decoding's steps replayed over the responses). `batch_metrics(batch)`
    gives `head_loss`'s metrics with ranks. Each batch's (ranks, loss mask) on the host is appended to
    `kept` when given, for replaying trees afterwards. Empty when there is no batch."""
    sums, n, steps = None, 0, {}
    for i, batch in enumerate(batches):
        if i >= limit:
            break
        m = batch_metrics(batch)
        ranks = to_host(m.pop("ranks"))
        for depth in range(1, len(ranks) + 1):  # a chain through the first `depth` heads
            steps[depth] = steps.get(depth, 0) + tree_steps(ranks, batch["loss_mask"], chain_paths(depth))
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
            "val_chain_tau_by_depth": [tau_of(steps[d]) for d in sorted(steps)]}
