"""EAGLE-1 and EAGLE-3 draft models: the training-time test drafts what decoding drafts.

(Greedy equals plain on every tree, the draft cache's contents and the tree-versus-chain check are in
tests/test_drafter.py; sampling in tests/test_spec_sampling.py; heads files in tests/test_checkpoint.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.model.config import ModelConfig
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.drafters.base import Committed
from clover_jax.errors import CloverError
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.llama import Llama, causal_self_mask
from test_drafter import chain_logits, perturbed
from clover_jax.drafters.eagle3 import eagle3_loss

pytestmark = pytest.mark.optimized  # its time goes into running programs, not compiling them

DEPTH = 3


@pytest.fixture(scope="module")
def base():
    return Llama(ModelConfig.tiny(num_layers=4), rngs=nnx.Rngs(1))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_training_drafts_what_decoding_drafts(base, method):
    """`train_forward` step k at position t (the training-time test, fed the true tokens and its own outputs)
    equals decoding: commit the prefix 0..t, then draft the chain x_{t+1}, x_{t+2}, ... node by node;
    depth k's logits are step k's."""
    drafter = perturbed(method, base, DEPTH)
    b, t_len = 2, 7
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, base.cfg.vocab_size, (b, t_len)), jnp.int32)
    out = base(tokens, jnp.broadcast_to(jnp.arange(t_len), (b, t_len)), causal_self_mask(b, t_len),
               feature_layers=drafter.feature_layers)
    _, logits = drafter.train_forward(base, tokens, out.hidden, out.hidden_normed, out.features)
    assert logits.shape == (DEPTH, b, t_len, base.cfg.vocab_size)
    checked = 0
    for t in range(t_len - 1):
        n = t + 1  # committed entries 0..t, entry t paired with the root x_{t+1}
        feats = None if out.features is None else out.features[:, :n]
        new = Committed(out.hidden[:, :n], out.hidden_normed[:, :n], tokens[:, 1 : n + 1], feats)
        lens = jnp.full((b,), n, jnp.int32)
        state = drafter.commit(base, drafter.init(base, b, 32), new, lens, jnp.ones((b,), bool))
        path = tokens[:, n : min(n + DEPTH, t_len)]
        for k, got in enumerate(chain_logits(base, drafter, state, path, lens)):
            np.testing.assert_allclose(got, np.asarray(logits[k, :, t]), atol=2e-4, rtol=2e-4)
            checked += 1
    assert checked == 6 + 5 + 4


def test_eagle3_scores_only_its_draft_vocabulary(base):
    """Its own lm_head over N ids, spread back over the vocabulary: other tokens get no probability,
    and its loss learns the base distribution restricted to those ids."""
    drafter = perturbed("eagle3", base, 2)
    ids = jnp.asarray([3, 5, 8, 13, 21, 34], jnp.int32)
    small = type(drafter)(drafter_config("eagle3", 2, draft_vocab=6), base, rngs=nnx.Rngs(0))
    small.set_vocab(base, ids)
    np.testing.assert_array_equal(np.asarray(small.lm_head.kernel[...]), np.asarray(base.lm_head_weight()[ids].T))
    logits = small.logits(base, jnp.ones((2, base.cfg.hidden_size)))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    assert probs.shape == (2, base.cfg.vocab_size)
    np.testing.assert_allclose(probs[:, np.asarray(ids)].sum(-1), 1.0, rtol=1e-6)
    assert (np.delete(probs, np.asarray(ids), axis=1) == 0).all()
    # The loss: soft cross-entropy against the base distribution renormalised over the ids.
    k, b, t, v = 2, 1, 4, base.cfg.vocab_size
    rng = np.random.default_rng(1)
    head = jnp.full((k, b, t, v), -1e9).at[..., ids].set(jnp.asarray(rng.normal(size=(k, b, t, 6)), jnp.float32))
    base_logits = jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32).at[..., ids].add(20.0)
    tokens, mask = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))
    loss, per_head, _, _ = eagle3_loss(None, head, None, base_logits, tokens, mask)
    # Step k counts the positions whose token t+2+k is inside the window (step 0: 0 and 1; step 1: 0),
    # and its target at position t is the base distribution at t+1+k.
    ce = lambda k, pos: -(jax.nn.softmax(base_logits[0, pos + 1 + k, ids])
                          * jax.nn.log_softmax(head[k, 0, pos, ids])).sum()
    np.testing.assert_allclose(per_head[0], (ce(0, 0) + ce(0, 1)) / 2, rtol=1e-5)
    np.testing.assert_allclose(per_head[1], ce(1, 0), rtol=1e-5)
    np.testing.assert_allclose(loss, per_head[0] + 0.8 * per_head[1], rtol=1e-6)


def test_eagle3_drafts_a_draft_vocabulary_from_its_own_rows(base):
    """Given the engine's draft vocabulary, EAGLE-3 keeps the tokens of its own ids and scores them with
    its own lm_head rows alone: the same logits as its full scoring, taken at those ids."""
    drafter = perturbed("eagle3", base, 2)
    own = jnp.asarray([3, 5, 8, 13, 21, 34], jnp.int32)
    small = type(drafter)(drafter_config("eagle3", 2, draft_vocab=6), base, rngs=nnx.Rngs(0))
    small.set_vocab(base, own)
    small.lm_head.kernel[...] += 0.05 * jax.random.normal(jax.random.key(3), small.lm_head.kernel[...].shape)
    asked = DraftVocab.most_frequent(base.lm_head_weight(), None, 16)  # ids 0..15: 3, 5, 8 and 13 are its own
    vocab = small.drafting_vocab(base, asked)
    np.testing.assert_array_equal(np.asarray(vocab.ids), [3, 5, 8, 13])
    out = jax.random.normal(jax.random.key(4), (2, 3, base.cfg.hidden_size))
    np.testing.assert_allclose(np.asarray(small.logits(base, out, vocab)),
                               np.asarray(small.logits(base, out))[..., [3, 5, 8, 13]], rtol=1e-5, atol=1e-5)
    assert small.drafting_vocab(base, None) is None
    assert drafter.drafting_vocab(base, asked).ids.shape == (16,)  # all its ids: the whole vocabulary
    with pytest.raises(CloverError, match="shares no token"):
        small.drafting_vocab(base, DraftVocab.most_frequent(base.lm_head_weight(), None, 3))


def test_eagle_training_step_unrolls_only_the_step_it_trains(base):
    """EAGLE-1's loss weights its first step alone (`Method.trained_steps`): unrolling just that step
    gives the full unroll's loss and gradient, and its metrics cover that one depth."""
    from clover_jax.drafters import registry
    from train.train import head_loss

    steps = registry.get("eagle").trained_steps
    assert steps == 1 and registry.get("eagle3").trained_steps is None
    drafter = perturbed("eagle", base, DEPTH)
    b, t_len = 2, 9
    rng = np.random.default_rng(2)
    batch = {"tokens": jnp.asarray(rng.integers(3, base.cfg.vocab_size, (b, t_len)), jnp.int32),
             "loss_mask": jnp.asarray(rng.integers(0, 2, (b, t_len)), jnp.float32)}
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    key = jax.random.key(5)

    def loss_of(p, cut):
        return head_loss(nnx.merge(graphdef, p, rest), base, batch, key=key, steps=cut)

    (full, full_m), full_g = jax.value_and_grad(loss_of, has_aux=True)(params, None)
    (cut, cut_m), cut_g = jax.value_and_grad(loss_of, has_aux=True)(params, steps)
    assert full_m["top1"].shape == (DEPTH,) and cut_m["top1"].shape == (1,)
    np.testing.assert_allclose(cut, full, rtol=1e-6)
    np.testing.assert_allclose(cut_m["top1"], full_m["top1"][:1])
    flat_full, flat_cut = jax.tree.leaves(full_g), jax.tree.leaves(cut_g)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in flat_cut)
    for g_full, g_cut in zip(flat_full, flat_cut):
        np.testing.assert_allclose(g_cut, g_full, rtol=1e-5, atol=1e-7)


def test_unrolled_attention_is_attention_over_the_concatenated_blocks():
    """`attend_unrolled` reads step 0's keys under the causal mask and every later step's key at the
    query's own position: plain attention over the blocks concatenated, [causal | eye | eye ...]."""
    from clover_jax.model.layers import attend, attend_unrolled

    b, t, n, kv, h, steps = 2, 6, 4, 2, 8, 3
    rng = np.random.default_rng(7)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q = normal(b, t, n, h)
    keys, values = [normal(b, kv, t, h) for _ in range(steps)], [normal(b, kv, t, h) for _ in range(steps)]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    blocks = jnp.concatenate([causal] + [jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))] * (steps - 1), 2)
    want = attend(q, jnp.concatenate(keys, 2), jnp.concatenate(values, 2), blocks)
    got = attend_unrolled(q, keys[0], values[0], causal, keys[1:], values[1:])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    first_step = attend_unrolled(q, keys[0], values[0], causal, [], [])
    np.testing.assert_allclose(first_step, attend(q, keys[0], values[0], causal))
