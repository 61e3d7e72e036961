"""The losses (`clover_jax.drafters.losses`, Clover-2's `distill_loss`, EAGLE-1's `eagle_loss`) and `train.losses`' metrics
against explicit loops over tiny NumPy arrays (and PyTorch's smooth L1): each method's loss, per-head
weights and masks, top-k accuracy, and the chain replay that `train.train` reports as held-out chain tau."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clover_jax.drafters import losses as shared
from clover_jax.drafters.clover2 import HIDDEN_WEIGHT, distill_loss
from clover_jax.drafters.eagle import EAGLE_CE_WEIGHT, eagle_loss
from train import losses


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = max(x)
    return x - (m + np.log(sum(np.exp(v - m) for v in x)))


def _smooth_l1(a, b):
    total = 0.0
    for x, y in zip(a, b):
        d = abs(float(x) - float(y))
        total += 0.5 * d * d if d < 1 else d - 0.5
    return total / len(a)


def _counted(loss_mask, k, b, t):
    """Head k at position t has a target: token t+2+k exists and is a response token."""
    return t + 2 + k < loss_mask.shape[1] and loss_mask[b, t + 2 + k] == 1


def _case(seed=0, k_heads=3, b_size=2, t_len=6, vocab=5, dim=3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b_size, t_len)).astype(np.int32)
    loss_mask = np.array([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0]], np.float32)[:b_size, :t_len]
    return dict(tokens=tokens, loss_mask=loss_mask,
                head_logits=rng.normal(size=(k_heads, b_size, t_len, vocab)).astype(np.float32) * 2,
                head_hidden=rng.normal(size=(k_heads, b_size, t_len, dim)).astype(np.float32) * 1.5,
                base_normed=rng.normal(size=(b_size, t_len, dim)).astype(np.float32) * 1.5,
                base_logits=rng.normal(size=(b_size, t_len, vocab)).astype(np.float32) * 2)


def test_elementwise_losses_and_weights():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(2, 4, 3)).astype(np.float32) * 1.5, rng.normal(size=(2, 4, 3)).astype(np.float32)
    got = np.asarray(shared.smooth_l1(a, b))
    want = np.array([[_smooth_l1(a[i, j], b[i, j]) for j in range(4)] for i in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (np.abs(a - b) > 1).any() and (np.abs(a - b) < 1).any()  # both branches are exercised
    torch_ref = torch.nn.functional.smooth_l1_loss(torch.tensor(a), torch.tensor(b), reduction="none", beta=1.0)
    np.testing.assert_allclose(got, torch_ref.mean(-1).numpy(), rtol=1e-6, atol=1e-6)

    logits, p = rng.normal(size=(3, 5)), rng.dirichlet(np.ones(5), size=3)
    want = [-sum(p[i, v] * _log_softmax(logits[i])[v] for v in range(5)) for i in range(3)]
    np.testing.assert_allclose(shared.soft_cross_entropy(jnp.asarray(logits, jnp.float32),
                                                         jnp.asarray(p, jnp.float32)), want, rtol=1e-5)
    np.testing.assert_allclose(shared.head_weights(3), [1.0, 0.7, 0.49], rtol=1e-6)
    np.testing.assert_allclose(shared.masked_mean(jnp.ones(3), jnp.zeros(3)), 0.0)  # nothing counted: 0
    x = np.arange(12, dtype=np.int32).reshape(2, 6)
    np.testing.assert_array_equal(shared.shift_left(x, 2), [[2, 3, 4, 5, 0, 0], [8, 9, 10, 11, 0, 0]])
    mask = np.array([[0, 1, 1, 0, 1, 1]], np.float32)
    for k in range(4):
        want = [float(_counted(mask, k, 0, t)) for t in range(6)]
        np.testing.assert_array_equal(shared.target_mask(mask, k)[0], want)


def test_shifted_stacks_every_steps_shift_in_one_gather():
    """Entry k of `shifted` is `shift_left(x, k + 1)`: x at t + 1 + k, zeros past the end, for arrays with
    and without trailing axes (the base distribution [B, T, V], a mask [B, T])."""
    rng = np.random.default_rng(4)
    for x in (rng.normal(size=(2, 6, 3)).astype(np.float32), rng.integers(0, 9, (3, 5)).astype(np.int32)):
        got = np.asarray(shared.shifted(jnp.asarray(x), 4))
        assert got.shape == (4,) + x.shape and got.dtype == x.dtype
        for k in range(4):
            for t in range(x.shape[1]):
                want = x[:, t + 1 + k] if t + 1 + k < x.shape[1] else np.zeros_like(x[:, 0])
                np.testing.assert_array_equal(got[k, :, t], want)


def test_cross_entropy_loss_by_hand():
    c = _case()
    k_heads, b_size, t_len, _ = c["head_logits"].shape
    loss, per_head, masks, targets = shared.cross_entropy_loss(c["head_logits"], c["tokens"], c["loss_mask"])
    want_per_head = []
    for k in range(k_heads):
        terms = [-_log_softmax(c["head_logits"][k, b, t])[c["tokens"][b, t + 2 + k]]
                 for b in range(b_size) for t in range(t_len) if _counted(c["loss_mask"], k, b, t)]
        want_per_head.append(sum(terms) / max(len(terms), 1))
        for b in range(b_size):
            for t in range(t_len):
                assert masks[k, b, t] == float(_counted(c["loss_mask"], k, b, t))
                if t + 2 + k < t_len:
                    assert targets[k, b, t] == c["tokens"][b, t + 2 + k]
    np.testing.assert_allclose(per_head, want_per_head, rtol=1e-5)
    np.testing.assert_allclose(loss, sum(0.7 ** k * v for k, v in enumerate(want_per_head)), rtol=1e-5)


def test_cross_entropy_loss_head_without_targets_counts_zero():
    """T=5 and three heads: head 2 may only train at t=0 (token 4), which is a prompt token here."""
    c = _case(seed=2, t_len=5)
    c["loss_mask"] = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]], np.float32)
    _, per_head, masks, _ = shared.cross_entropy_loss(c["head_logits"], c["tokens"], c["loss_mask"])
    assert float(jnp.sum(masks[2])) == 0 and float(per_head[2]) == 0
    assert np.isfinite(np.asarray(per_head)).all()


def test_distill_loss_by_hand():
    c = _case(seed=3)
    k_heads, b_size, t_len, _ = c["head_logits"].shape
    loss, per_head, masks, targets = distill_loss(c["head_hidden"], c["head_logits"], c["base_normed"],
                                                         c["base_logits"], c["tokens"], c["loss_mask"])
    want_per_head = []
    for k in range(k_heads):
        terms = []
        for b in range(b_size):
            for t in range(t_len):
                if not _counted(c["loss_mask"], k, b, t):
                    continue
                src = t + 1 + k  # the base model's output at t+1+k is the distribution of token t+2+k
                p = np.exp(_log_softmax(c["base_logits"][b, src]))
                q = _log_softmax(c["head_logits"][k, b, t])
                terms.append(10 * _smooth_l1(c["head_hidden"][k, b, t], c["base_normed"][b, src])
                             - sum(p[v] * q[v] for v in range(len(p))))
        want_per_head.append(sum(terms) / max(len(terms), 1))
    np.testing.assert_allclose(per_head, want_per_head, rtol=1e-5)
    np.testing.assert_allclose(loss, sum(0.7 ** k * v for k, v in enumerate(want_per_head)), rtol=1e-5)
    _, _, ce_masks, ce_targets = shared.cross_entropy_loss(c["head_logits"], c["tokens"], c["loss_mask"])
    np.testing.assert_array_equal(masks, ce_masks)
    np.testing.assert_array_equal(targets, ce_targets)


def _distill_as_written_before(head_hidden, head_logits, feature, base_logits, tokens, loss_mask, feature_weight,
                               ce_weight):
    """The per-step loop Clover-2's and EAGLE-1's losses each wrote out before `distill_steps` held it."""
    targets, masks = shared.targets_and_masks(tokens, loss_mask, head_hidden.shape[0])
    p_base = shared.base_distribution(base_logits)
    per_step = []
    for k in range(head_hidden.shape[0]):
        f_target = jax.lax.stop_gradient(shared.shift_left(feature, k + 1))
        p_target = shared.shift_left(p_base, k + 1)
        loss = (feature_weight * shared.smooth_l1(head_hidden[k], f_target)
                + ce_weight * shared.soft_cross_entropy(head_logits[k], p_target))
        per_step.append(shared.masked_mean(loss, masks[k]))
    return jnp.stack(per_step), masks, targets


@pytest.mark.parametrize("method", ["clover2", "eagle"])
def test_the_shared_distillation_gives_each_methods_numbers_as_before(method):
    """Clover-2's and EAGLE-1's losses through `distill_steps` equal their former loops to the bit, as
    do their gradients, eagerly and jitted; EAGLE-1 regresses base_hidden (before the final norm)."""
    c = _case(seed=5, k_heads=4, t_len=6)
    c["base_hidden"] = np.random.default_rng(6).normal(size=c["base_normed"].shape).astype(np.float32)
    loss_fn, feature, weights, combine = {
        "clover2": (distill_loss, "base_normed", (HIDDEN_WEIGHT, 1.0), lambda per: jnp.sum(shared.head_weights(4) * per)),
        "eagle": (eagle_loss, "base_hidden", (1.0, EAGLE_CE_WEIGHT), lambda per: per[0])}[method]

    def new(hidden, logits):
        return loss_fn(hidden, logits, c["base_normed"], c["base_logits"], c["tokens"], c["loss_mask"], c["base_hidden"])

    def old(hidden, logits):
        per, masks, targets = _distill_as_written_before(hidden, logits, c[feature], c["base_logits"], c["tokens"],
                                                         c["loss_mask"], *weights)
        return combine(per), per, masks, targets

    for run in (lambda f: f, jax.jit):
        got, want = run(new)(c["head_hidden"], c["head_logits"]), run(old)(c["head_hidden"], c["head_logits"])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        grad = lambda f: run(jax.grad(lambda h, x: f(h, x)[0], argnums=(0, 1)))(c["head_hidden"], c["head_logits"])
        for g, w in zip(grad(new), grad(old)):
            np.testing.assert_array_equal(g, w)
    assert float(got[0]) > 0 and np.all(np.asarray(got[1]) > 0)


@pytest.mark.parametrize("top", [1, 2])
def test_topk_accuracy_by_hand(top):
    c = _case(seed=4)
    k_heads, b_size, t_len, _ = c["head_logits"].shape
    _, _, masks, targets = shared.cross_entropy_loss(c["head_logits"], c["tokens"], c["loss_mask"])
    got = losses.topk_accuracy(c["head_logits"], targets, masks, top)
    want = []
    for k in range(k_heads):
        hits = [int(c["tokens"][b, t + 2 + k] in np.argsort(-c["head_logits"][k, b, t])[:top])
                for b in range(b_size) for t in range(t_len) if _counted(c["loss_mask"], k, b, t)]
        want.append(sum(hits) / max(len(hits), 1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _ranks_of(hits):
    """Ranks where a chain reads only whether the top-1 draft hit: 0 for a hit, 1 for a miss."""
    return np.where(hits, 0, 1)


def test_replay_chain_by_hand():
    """Three heads over ten positions: a step at t accepts the leading run of hits[:, t], and the next
    starts at t + accepted + 1 (the bonus token's position), so the hits in between are never read."""
    hits = np.zeros((3, 10), bool)
    hits[:, 0] = [1, 1, 0]  # t=0 accepts 2 -> t=3
    hits[:, 1] = [1, 1, 1]  # skipped
    hits[:, 3] = [0, 1, 1]  # t=3 accepts 0 -> t=4
    hits[:, 4] = [1, 1, 1]  # t=4 accepts 3 -> t=8
    hits[:, 8] = [1, 0, 1]  # t=8 accepts 1 -> t=10, past the stop
    chain = losses.chain_paths(3)
    assert chain == {(0,), (0, 0), (0, 0, 0)}
    ranks = _ranks_of(hits)
    np.testing.assert_array_equal(losses.replay_steps(ranks, chain, 0, 10), [1, 1, 1, 1])
    np.testing.assert_array_equal(losses.replay_steps(ranks, chain, 0, 8), [1, 0, 1, 1])  # t=8 is not a step
    np.testing.assert_array_equal(losses.replay_steps(ranks, chain, 1, 10), [3, 1, 0, 1])  # 1 -> 5 -> 6 -> 7 -> 8 -> 10
    assert losses.tau_of(np.array([1, 1, 1, 1])) == 1 + 6 / 4


def test_replay_on_a_tree_accepts_the_deepest_node_drafting_the_data():
    """Tree [0], [1], [0, 0], [1, 0], [1, 1]: a step accepts as deep as the targets' ranks stay a path of
    the tree, whichever branch that is; ranks past a missing node are never read."""
    paths = frozenset({(0,), (1,), (0, 0), (1, 0), (1, 1)})
    ranks = np.array([[1, 9, 0, 2, 1, 0, 5, 0],
                      [1, 9, 3, 0, 0, 0, 0, 0]])
    # t=0: (1, 1) -> accepts 2 -> t=3: rank 2 at depth 1, no node -> accepts 0 -> t=4: (1, 0) -> 2 -> t=7:
    # (0, 0) -> 2 -> t=10.
    np.testing.assert_array_equal(losses.replay_steps(ranks, paths, 0, 8), [1, 0, 3])
    # From t=2: (0, 3) has no node -> accepts 1 -> t=4 -> t=7 -> done.
    np.testing.assert_array_equal(losses.replay_steps(ranks, paths, 2, 8), [0, 1, 2])
    # A rank at the cap is a miss, even under a tree with a node of that rank.
    wide = frozenset((r,) for r in range(losses.RANK_CAP + 1))
    np.testing.assert_array_equal(losses.replay_steps(np.array([[losses.RANK_CAP, 0]]), wide, 0, 2), [1, 1])


def test_target_ranks_by_hand():
    """Where the target ranks in its head's logits, ties to the lower id (as argmax breaks them); the cap
    where it is not counted, outside the scored vocabulary (-1), or ranked at the cap or below."""
    logits = np.array([[[[0.5, 2.0, 1.0, 2.0], [3.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0],
                         [1.0, 2.0, 3.0, 4.0]]]], np.float32)  # [K=1, B=1, T=4, V=4]
    targets = np.array([[[3, 0, 1, -1]]])
    masks = np.ones((1, 1, 4), np.float32)
    ranks = np.asarray(losses.target_ranks(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(masks)))
    np.testing.assert_array_equal(ranks, [[[1, 0, 1, losses.RANK_CAP]]])  # t=0, t=2: the tie at a lower id first
    np.testing.assert_array_equal(ranks == 0, np.argmax(logits, -1) == targets)  # rank 0 is argmax's hit
    masks[0, 0, 1] = 0
    capped = losses.target_ranks(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(masks), cap=1)
    np.testing.assert_array_equal(capped, [[[1, 1, 1, 1]]])


def test_path_counts_count_every_prefix_up_to_the_first_miss():
    """Each position a step could start at adds one to each prefix of its targets' ranks, up to the first
    rank at the cap; positions outside the response's steps add nothing."""
    cap = losses.RANK_CAP
    ranks = np.array([[[0, 1, 0, cap, 2, 0]],
                      [[0, 0, cap, 0, 1, 0]]])  # [K=2, B=1, T=6]
    loss_mask = np.array([[0, 1, 1, 1, 1, 1]], np.float32)  # steps from t=0 while t+3 is in the response: t <= 2
    got = losses.path_counts(ranks, loss_mask, 2)
    assert got == {(0,): 2, (0, 0): 1, (1,): 1, (1, 0): 1}
    assert losses.path_counts(ranks, loss_mask, 1) == {(0,): 2, (1,): 1}  # t <= 3 now; t=3 misses


def test_chain_steps_start_at_the_response_and_stop_before_the_window_runs_out():
    """Row 0: prompt at 0..2, response at 3..9, so steps start at t=2 (root = token 3) and stop once head
    1's target t+3 leaves the response (t <= 6). Row 1 has no response, and adds no step."""
    k_heads = 2
    loss_mask = np.zeros((2, 10), np.float32)
    loss_mask[0, 3:] = 1
    hits = np.ones((k_heads, 2, 10), bool)
    # t=2 accepts 2 -> t=5 accepts 2 -> t=8: past the last full step (t=6), so two steps.
    chain = losses.chain_paths(k_heads)
    np.testing.assert_array_equal(losses.tree_steps(_ranks_of(hits), loss_mask, chain), [0, 0, 2])
    hits[1, 0, 5] = False  # t=5 now accepts 1 -> t=7, also past t=6
    np.testing.assert_array_equal(losses.tree_steps(_ranks_of(hits), loss_mask, chain), [0, 1, 1])
