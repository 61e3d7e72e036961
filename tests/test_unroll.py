"""What training's teacher forcing sees is what drafting sees: `Heads.unroll`, the heads' states at every
position and depth in one pass, against the decoding path's context / node_state / node_hidden calls,
position by position. (EAGLE's draft models: tests/test_eagle.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters import HEADS
from clover_jax.model.llama import causal_self_mask


@pytest.mark.parametrize("method", HEADS)  # EAGLE's draft models: tests/test_eagle.py
def test_unroll_equals_the_decoding_path(method, loaded):
    """Entry [k, :, t] of `unroll` equals the decoding path's calls at position t: the heads' context
    (cache-free, causal) at t, computed with every token after x_{t+1} replaced so nothing later can
    leak in, then node_state / node_hidden fed x_{t+1}, x_{t+2}, ... as drafting feeds a tree path."""
    base = loaded("llama2")[3]
    heads = make_heads(drafter_config(method, 3), base, seed=1)
    # Zero-initialised parts (Medusa's W, Clover's W_V) would hide mistakes: perturb every parameter.
    leaves, treedef = jax.tree.flatten(nnx.state(heads, nnx.Param))
    keys = jax.random.split(jax.random.key(7), len(leaves))
    nnx.update(heads, jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                                   for x, k in zip(leaves, keys)]))
    b, t_len = 2, 7
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, base.cfg.vocab_size, (b, t_len)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(t_len), (b, t_len))
    mask = causal_self_mask(b, t_len)

    def forward(x):
        out = base(jnp.asarray(x), positions, mask)
        return out.hidden, out.hidden_normed

    unrolled = np.asarray(heads.unroll(base, *forward(tokens), jnp.asarray(tokens)))
    assert unrolled.shape == (3, b, t_len, base.cfg.hidden_size)
    checked = 0
    for t in range(t_len - 1):
        seen = tokens.copy()
        seen[:, t + 2:] = rng.integers(3, base.cfg.vocab_size, (b, t_len - t - 2))
        next_tokens = np.concatenate([seen[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
        ctx, _ = heads.context(base, *forward(seen), jnp.asarray(next_tokens), positions, mask, None)
        token = jnp.asarray(tokens[:, t + 1])
        s = heads.node_state(base, 0, ctx[:, t], token)
        for k in range(3):
            if t + 1 + k >= t_len:
                break
            np.testing.assert_allclose(unrolled[k, :, t], heads.node_hidden(base, k, s, token), atol=1e-4, rtol=1e-4)
            checked += 1
            if t + 2 + k < t_len:
                token = jnp.asarray(tokens[:, t + 2 + k])
                s = heads.node_state(base, k + 1, s, token)
    assert checked == 6 + 5 + 4
