"""The building blocks of the draft methods' training losses, and the cross-entropy Medusa and Clover share.

A drafter's `train_forward` drafts teacher-forced at every position: entry [k, :, t] of its outputs is
depth k of a chain whose root is token t+1, so it drafts token t+2+k, and only targets inside the
response (loss mask) and inside the sequence count (`targets_and_masks`). A method's loss (its registry
entry's `Method.loss`, defined beside its drafter) has the signature of `cross_entropy`:

    loss(head_hidden [K, B, T, D], head_logits [K, B, T, V], base_normed [B, T, D], base_logits [B, T, V],
         tokens [B, T], loss_mask [B, T], base_hidden [B, T, D] | None)
      -> (weighted loss, per-depth losses [K], masks [K, B, T], targets [K, B, T])

with head_hidden and head_logits what `train_forward` returns and the base_* arrays the frozen base
model's states at every position (V may be a loss vocabulary's N tokens: then tokens are indices into it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

HEAD_DECAY = 0.7  # Medusa, Clover and Clover-2 weight head k by 0.7^k


def shift_left(x: jax.Array, n: int) -> jax.Array:
    """x[:, t + n] at position t, zero past the end. x [B, T, ...]."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)[:, : x.shape[1]]


def shifted(x: jax.Array, k_heads: int) -> jax.Array:
    """[K, B, T, ...]: entry k is `shift_left(x, k + 1)`, what step (head) k learns at each position, in
    one gather. A loss whose K steps' logits come from one projection (EAGLE-3's) scores them all at
    once on it: scored one slice at a time, each slice's gradient was padded to the full [K, B, T, V]
    and the K summed, which at SmolLM2's shapes (7 x 4 x 512 x 8,192 logits) made EAGLE-3's training
    step 15-20% slower on a 2-core CPU and held 2.6 GB more (5.8 GB of temporaries against 3.2).
    Clover-2's and EAGLE-1's losses keep their slices: at their shapes the gather measured slower."""
    b, t = x.shape[:2]
    rows = x.reshape((b * t,) + x.shape[2:])
    rows = jnp.concatenate([rows, jnp.zeros((1,) + x.shape[2:], x.dtype)])  # row b * t: zeros, past the end
    source = jnp.arange(t)[None, :] + jnp.arange(1, k_heads + 1)[:, None]  # [K, T]
    index = jnp.where(source < t, jnp.arange(b)[:, None, None] * t + source[None], b * t)  # [B, K, T]
    return jnp.take(rows, jnp.swapaxes(index, 0, 1), axis=0, mode="clip")  # every index is in range


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
    """The mean of `values` where `mask` is 1 (0 when nothing is counted)."""
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
    """[K] head k's weight in the summed loss: 0.7^k."""
    return HEAD_DECAY ** jnp.arange(num_heads, dtype=jnp.float32)


def cross_entropy_loss(head_logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array):
    """Cross-entropy on the data's token t+2+k, head k weighted 0.7^k. head_logits [K, B, T, V], tokens
    and loss_mask [B, T]. Returns (weighted loss, per-head losses [K], per-head masks [K, B, T],
    per-head targets [K, B, T])."""
    k_heads = head_logits.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    ce = optax.softmax_cross_entropy_with_integer_labels(head_logits.astype(jnp.float32), targets)
    per_head = jax.vmap(masked_mean)(ce, masks)
    return jnp.sum(head_weights(k_heads) * per_head), per_head, masks, targets


def distill_steps(head_hidden: jax.Array, head_logits: jax.Array, feature: jax.Array, base_logits: jax.Array,
                  tokens: jax.Array, loss_mask: jax.Array, feature_weight: float, ce_weight: float):
    """The distillation Clover-2's and EAGLE-1's losses share: step (head) k at t learns the base model at
    t+1+k (the position whose output is token t+2+k's distribution), feature_weight x SmoothL1 between
    head_hidden[k] and the base model's `feature` there plus ce_weight x the soft cross-entropy of
    head_logits[k] against its distribution there. head_hidden [K, B, T, D], head_logits [K, B, T, V],
    feature [B, T, D] and base_logits [B, T, V] at every position, constants of the loss. Returns
    (per-step losses [K], masks [K, B, T], targets [K, B, T]); the method weighs the steps. The steps
    are slices, not one `shifted` gather: at these methods' shapes the gather measured slower."""
    k_heads = head_hidden.shape[0]
    targets, masks = targets_and_masks(tokens, loss_mask, k_heads)
    p_base = base_distribution(base_logits)
    per_step = []
    for k in range(k_heads):
        f_target = jax.lax.stop_gradient(shift_left(feature, k + 1))
        p_target = shift_left(p_base, k + 1)
        loss = (feature_weight * smooth_l1(head_hidden[k], f_target)
                + ce_weight * soft_cross_entropy(head_logits[k], p_target))
        per_step.append(masked_mean(loss, masks[k]))
    return jnp.stack(per_step), masks, targets


def cross_entropy(head_hidden, head_logits, base_normed, base_logits, tokens, loss_mask, base_hidden=None):
    """Medusa's and Clover's loss: `cross_entropy_loss` under the signature every method's loss shares
    (the module docstring); it reads the heads' logits alone."""
    return cross_entropy_loss(head_logits, tokens, loss_mask)
