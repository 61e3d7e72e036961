"""The held-out chain tau when sampling: a draft is kept with sum_v min(p, q) (speculative sampling's
acceptance), and a chain step at position t accepts draft d with the product of the first d of those."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import losses


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_accept_probability_is_the_overlap_of_the_two_distributions(temperature):
    k, b, t, v = 3, 2, 6, 11
    rng = np.random.default_rng(0)
    head, base = rng.normal(size=(k, b, t, v)) * 2, rng.normal(size=(b, t, v)) * 2
    masks = rng.random((k, b, t)) > 0.3
    got = np.asarray(losses.accept_probability(jnp.asarray(head), jnp.asarray(base), jnp.asarray(masks), temperature))
    for kk in range(k):
        for bb in range(b):
            for tt in range(t):
                want = 0.0
                if masks[kk, bb, tt] and tt + 1 + kk < t:
                    p, q = softmax(base[bb, tt + 1 + kk] / temperature), softmax(head[kk, bb, tt] / temperature)
                    want = np.minimum(p, q).sum()
                np.testing.assert_allclose(got[kk, bb, tt], want, rtol=1e-5, atol=1e-6)


def test_a_head_that_is_the_base_model_is_always_kept():
    base = jax.random.normal(jax.random.key(1), (1, 8, 5))
    head = jnp.stack([losses.shifted(base, 2)[k] for k in range(2)])
    got = losses.accept_probability(head, base, jnp.ones((2, 1, 8)), 1.0)
    np.testing.assert_allclose(np.asarray(got)[:, 0, :5], 1.0, rtol=1e-5)


def test_sampled_chain_steps_multiply_the_acceptances_along_the_chain():
    # One window: prompt token 0, response tokens 1..5. Depth 2: steps start where the root (t + 1) is a
    # response token and stop once the deepest target (t + 3) leaves the window: t = 0, 1, 2.
    loss_mask = np.array([[0, 1, 1, 1, 1, 1]])
    accept = np.zeros((2, 1, 6))
    accept[0, 0, :3] = [0.5, 1.0, 0.2]
    accept[1, 0, :3] = [0.5, 0.0, 1.0]
    total, steps = losses.sampled_chain_steps(accept, loss_mask, 2)
    assert steps == 3
    assert total == pytest.approx((0.5 + 0.25) + (1.0 + 0.0) + (0.2 + 0.2))


def test_held_out_figures_record_the_sampled_chain_tau():
    loss_mask = np.array([[0, 1, 1, 1, 1, 1]])
    ranks = np.zeros((2, 1, 6), np.int32)  # every greedy draft hits
    accept = np.full((1, 2, 1, 6), 0.5)

    def metrics(batch):
        return {"loss": jnp.float32(1.0), "head_loss": jnp.ones(2), "top1": jnp.ones(2), "top5": jnp.ones(2),
                "ranks": jnp.asarray(ranks), "accept": jnp.asarray(accept)}
    figures = losses.held_out_figures(metrics, [{"loss_mask": loss_mask}], 1)
    sampled = figures["val_sampled_chain_tau_by_depth"]
    assert list(sampled) == ["1"]
    assert sampled["1"] == pytest.approx([1.5, 1.75])
    assert figures["val_chain_tau_by_depth"][-1] > sampled["1"][-1]


def test_heads_json_gives_the_greedy_or_the_sampled_chain_tau(tmp_path):
    import json

    from clover_jax.errors import CloverError
    from clover_jax.io.heads_dir import held_out_chain_tau

    (tmp_path / "heads.json").write_text(json.dumps({"heads": {"method": "medusa", "num_heads": 2}, "held_out": {
        "val_chain_tau_by_depth": [1.4, 1.5], "val_sampled_chain_tau_by_depth": {"1": [1.2, 1.25]}}}))
    assert held_out_chain_tau(tmp_path) == [1.4, 1.5]
    assert held_out_chain_tau(tmp_path, sampling=True) == [1.2, 1.25]
    (tmp_path / "heads.json").write_text(json.dumps({"heads": {"method": "medusa", "num_heads": 2}, "held_out": {
        "val_chain_tau_by_depth": [1.4, 1.5]}}))
    assert held_out_chain_tau(tmp_path, sampling=True) is None  # heads measured before: no sampled figure
    (tmp_path / "heads.json").write_text(json.dumps({"heads": {"method": "medusa", "num_heads": 2}, "held_out": {
        "val_sampled_chain_tau_by_depth": {"0.7": [1.3]}}}))
    with pytest.raises(CloverError, match="temperature '1'"):
        held_out_chain_tau(tmp_path, sampling=True)
