"""The draft heads pinned against their papers' equations, written out again in plain NumPy (float64).

Every parameter (heads and base) is re-drawn at random before the comparison, so a zero or identity
initialisation cannot hide a missing or misplaced term. The initialisations are checked on their own,
before any re-draw. Letters: B batch, T positions, D model dim, V vocab, N attention heads.
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters import registry
from clover_jax.model.cache import causal_mask
from clover_jax.model.config import ModelConfig
from clover_jax.errors import CloverError
from clover_jax.drafters.heads import make_heads, token_embeddings
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.layers import to_stored
from clover_jax.model.llama import Llama, causal_self_mask

B, T = 2, 4
TOL = dict(atol=1e-4, rtol=1e-4)
NOISE = 0.01


# ---------------------------------------------------------------- fixtures and parameter access


def randomise(module, seed: int, scale: float = 0.3) -> None:
    """Re-draw every nnx.Param: norm weights 1 + noise, everything else noise."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        noise = scale * rng.standard_normal(x.shape)
        is_norm = "weight" in str(path[-1]) and x.ndim == 1
        return jnp.asarray(1 + noise if is_norm else noise, x.dtype)

    nnx.update(module, jax.tree_util.tree_map_with_path(draw, nnx.state(module, nnx.Param)))


def params(module) -> dict[str, np.ndarray]:
    """Every Param of `module` as float64, keyed by its dotted path ('self_attn.q_proj.kernel'), the
    fused q/k/v projection as HF's three tensors."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(map(str, part)): np.asarray(array, np.float64) for path, var in flat
            for part, array in to_stored(path, np.asarray(var[...]))}


# Compiled whole: eager initialisation compiles every random draw's shape on its own (seconds). NNX
# keeps object identity across the boundary, so a head sharing a base module would still show.
make_heads_jit = nnx.jit(make_heads, static_argnums=(0, 2))


def build(method: str, num_heads: int, seed: int = 0, randomised: bool = True, tied: bool = False,
          embed_source: str = "lm_head", **cfg):
    """A random base (weights of order one, drawn on the host) and heads for it, fresh from
    `make_heads` or re-drawn too."""
    config = ModelConfig.tiny(tie_word_embeddings=tied, **cfg)
    base = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    randomise(base, seed + 100)
    hcfg = drafter_config(method, num_heads, embed_source=embed_source)
    if not randomised:
        return base, make_heads_jit(hcfg, base, seed + 1)
    heads = nnx.eval_shape(lambda: make_heads(hcfg, base, seed=seed + 1))
    randomise(heads, seed + 200)
    return base, heads


def inputs(base, seed: int = 0):
    """Random pre-norm hidden states [B, T, D] (with their normed twin) and tokens [B, T]."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((B, T, base.cfg.hidden_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, base.cfg.vocab_size, (B, T)), jnp.int32)
    return hidden, base.norm(hidden), tokens


def positions():
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


# ---------------------------------------------------------------- the NumPy reference


def rmsnorm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1 + np.exp(-x))


def linear(x, p, name):
    return x @ p[f"{name}.kernel"] + p.get(f"{name}.bias", 0.0)


def lm_rows(base) -> np.ndarray:
    """[V, D] rows of the output projection: the embedding table when tied, else lm_head^T."""
    if base.cfg.tie_word_embeddings:
        return np.asarray(base.embed_tokens.embedding[...], np.float64)
    return np.asarray(base.lm_head.kernel[...], np.float64).T


def decoder_layer(x, p, cfg, pos):
    """One pre-norm Llama layer, causal over the T positions: RMSNorm, rotate-half RoPE, grouped-query
    softmax attention (query head j reads kv head j // (N/K), as HF's repeat_kv), SwiGLU."""
    b, t, _ = x.shape
    n, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rmsnorm(x, p["input_layernorm.weight"], cfg.rms_norm_eps)
    q = linear(h, p, "self_attn.q_proj").reshape(b, t, n, hd)
    k = linear(h, p, "self_attn.k_proj").reshape(b, t, kv, hd)
    v = linear(h, p, "self_attn.v_proj").reshape(b, t, kv, hd)
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, :, None], np.sin(np.concatenate([ang, ang], -1))[:, :, None]
    rope = lambda z: z * cos + np.concatenate([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin
    q, k = rope(q), np.repeat(rope(k), n // kv, axis=2)
    v = np.repeat(v, n // kv, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("bnts,bsnh->btnh", probs, v).reshape(b, t, n * hd)
    x = x + linear(attn, p, "self_attn.o_proj")
    h = rmsnorm(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    return x + linear(silu(linear(h, p, "mlp.gate_proj")) * linear(h, p, "mlp.up_proj"), p, "mlp.down_proj")


def gate_decoder(x, e, p, num_heads, eps=1e-6):
    """Clover-2's AD: per attention head j, x + v_j * cos(q_j, k_j), q from RMSNorm(x), k/v from e."""
    split = lambda z: z.reshape(*z.shape[:-1], num_heads, -1)
    q = split(linear(rmsnorm(x, p["norm.weight"], eps), p, "q"))
    k, v = split(linear(e, p, "k")), split(linear(e, p, "v"))
    cos = np.sum(q * k, -1, keepdims=True) / (np.linalg.norm(q, axis=-1, keepdims=True)
                                              * np.linalg.norm(k, axis=-1, keepdims=True))
    return x + (v * cos).reshape(x.shape)


def sub(p: dict, prefix: str) -> dict:
    return {k[len(prefix) + 1:]: v for k, v in p.items() if k.startswith(prefix + ".")}


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **TOL)


# ---------------------------------------------------------------- configuration


def test_heads_config_defaults_and_errors():
    assert registry.get("clover").depth == 3 and registry.get("clover2").depth == 5
    cfg = drafter_config("clover2", 5)
    assert cfg.embed_source == "lm_head" and cfg.noise == NOISE
    assert [registry.get(m).drafter.aug_layers for m in ("medusa", "clover", "clover2")] == [0, 1, 2]
    assert {registry.get(m).chained for m in ("medusa", "clover", "clover2")} == {False}
    assert registry.get("eagle").chained and registry.get("eagle3").chained
    assert set(vars(drafter_config("medusa", 2))) == {"method", "num_heads", "head_layers", "own_lm_head"}
    for bad in (dict(method="eagle-9", num_heads=3), dict(method="clover", num_heads=0),
                dict(method="clover2", num_heads=5, embed_source="output"), dict(method="eagle3", num_heads=2, draft_vocab=-1)):
        with pytest.raises(CloverError):
            drafter_config(**bad)


SHIPPED_CONFIGS = sorted((Path(__file__).parent.parent / "models").glob("*/heads/*/heads.json"))


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: f"{p.parts[-4]}-{p.parts[-2]}")
def test_heads_json_written_before_each_method_had_its_config_still_reads(path):
    """Every shipped heads.json was written by the one config class of every method, holding other
    methods' fields at their defaults: each reads as its own method's config, keeping its own values."""
    fields = json.loads(path.read_text())["heads"]
    cfg = drafter_config(**fields)
    assert type(cfg) is registry.get(fields["method"]).config
    assert all(fields[k] == (list(v) if isinstance(v, tuple) else v)
               for k, v in dataclasses.asdict(cfg).items() if k in fields)


def test_a_foreign_option_away_from_its_old_default_is_refused_by_name():
    with pytest.raises(CloverError, match="Medusa drafters have no option embed_source") as e:
        drafter_config("medusa", 2, embed_source="input")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- forward formulas against NumPy


@functools.partial(nnx.jit, static_argnums=2)
def unroll(heads, base, depth, hidden, normed, path, mask, cache=None):
    """`context`, then `depth` nodes down one path of a draft tree: path[0] [B, T] is the base model's
    own next token (held by the root), path[k] the token drafted at depth k. Compiled whole, because
    op-by-op dispatch compiles each op on its own (seconds on a busy CPU).
    -> ctx [B, T, D], cache, states [depth][B, T, D], logits [depth][B, T, V]."""
    pos = jnp.broadcast_to(jnp.arange(hidden.shape[1], dtype=jnp.int32), hidden.shape[:2])
    ctx, cache = heads.context(base, hidden, normed, path[0], pos, mask, cache)
    state, states, logits = ctx, [], []
    for k in range(depth):
        state = heads.node_state(base, k, state, path[k])
        states.append(state)
        logits.append(heads.node_logits(base, k, state, path[k]))
    return ctx, cache, states, logits


@nnx.jit
def base_forward(base, tokens, mask):
    return base(tokens, positions(), mask)


def token_path(base, depth: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, base.cfg.vocab_size, (depth, B, T)), jnp.int32)


@pytest.mark.parametrize("tied", [False, True])
def test_medusa_matches_numpy(tied):
    """Head i: lm_head(h + SiLU(W_i h + b_i)), h after the base's final norm; tokens play no part."""
    base, heads = build("medusa", 3, tied=tied)
    hidden, normed, _ = inputs(base)
    assert heads.init_aug_cache(B, 8, jnp.float32) is None
    ctx, cache, states, logits = unroll(heads, base, 3, hidden, normed, token_path(base, 3), causal_self_mask(B, T))
    assert cache is None
    np.testing.assert_array_equal(ctx, normed)
    h, rows, p = np.asarray(normed, np.float64), lm_rows(base), params(heads)
    for k in range(3):
        np.testing.assert_array_equal(states[k], ctx)
        close(logits[k], (h + silu(linear(h, p, f"blocks.{k}.linear"))) @ rows.T)


@pytest.mark.parametrize("tied", [False, True])
def test_clover_matches_numpy(tied):
    """Augmenting Block = one Llama layer over the pre-norm hidden states; node state
    s + W_V e (one key per query, so the attention output is v whatever W_Q, W_K and the AD's own norm
    hold) with e the normalised lm_head row; logits lm_head(final_norm(s + SiLU(W_k s + b_k)))."""
    base, heads = build("clover", 3, tied=tied)
    hidden, normed, _ = inputs(base)
    cfg, p, rows = base.cfg, params(heads), lm_rows(base)
    assert "decoder.norm.weight" in p and not np.allclose(p["decoder.q.kernel"], 0)
    path = token_path(base, 3)
    ctx, cache, states, logits = unroll(heads, base, 3, hidden, normed, path, causal_self_mask(B, T))
    assert cache is None
    s = decoder_layer(np.asarray(hidden, np.float64), sub(p, "aug.0"), cfg, positions())
    close(ctx, s)
    unit = rows / (np.linalg.norm(rows, axis=-1, keepdims=True) + 1e-6)
    final_norm = np.asarray(base.norm.weight[...], np.float64)
    for k in range(3):
        s = s + unit[np.asarray(path[k])] @ p["decoder.v.kernel"]
        close(states[k], s)
        close(logits[k], rmsnorm(s + silu(linear(s, p, f"blocks.{k}.linear")), final_norm, cfg.rms_norm_eps) @ rows.T)


CLOVER2_CASES = [  # (embed_source, ModelConfig.tiny overrides); tied output heads are Medusa's and Clover's
    ("lm_head", {}),
    ("input", dict(head_dim=16, qkv_bias=True)),  # gate heads D/N = 8 wide while attention heads are 16
]


@pytest.mark.parametrize("embed_source,cfg", CLOVER2_CASES)
def test_clover2_matches_numpy(embed_source, cfg):
    """context = aug_norm(L2(L1(h + AD_in(h, E[next])))); head 0: lm_head(head_norm(W0 s + b0));
    k >= 1: s <- AD_cell(s, E[tok]), lm_head(head_norm(W2 [s; E[tok]] + b2))."""
    base, heads = build("clover2", 3, embed_source=embed_source, **cfg)
    hidden, normed, _ = inputs(base)
    c, p, rows = base.cfg, params(heads), lm_rows(base)
    table = rows if embed_source == "lm_head" else np.asarray(base.embed_tokens.embedding[...], np.float64)
    assert not np.allclose(rows, np.asarray(base.embed_tokens.embedding[...]))  # the source matters
    path = token_path(base, 3)
    ctx, cache, states, logits = unroll(heads, base, 3, hidden, normed, path, causal_self_mask(B, T))
    assert cache is None
    e = [table[np.asarray(tok)] for tok in path]
    x = gate_decoder(np.asarray(hidden, np.float64), e[0], sub(p, "decoder_in"), c.num_heads)
    for i in range(2):
        x = decoder_layer(x, sub(p, f"aug.{i}"), c, positions())
    s = rmsnorm(x, p["aug_norm.weight"], c.rms_norm_eps)
    close(ctx, s)

    head = lambda z: rmsnorm(z, p["head_norm.weight"], c.rms_norm_eps) @ rows.T
    np.testing.assert_array_equal(states[0], ctx)  # the root's token was fused into the context
    close(logits[0], head(linear(s, p, "w0")))
    for k in range(1, 3):
        s = gate_decoder(s, e[k], sub(p, "decoder_cell"), c.num_heads)
        close(states[k], s)
        close(logits[k], head(linear(np.concatenate([s, e[k]], -1), p, "w2")))

    if cfg:
        return
    # The same prompt through the Augmenting Block's own cache, longer than the prompt.
    aug_cache = heads.init_aug_cache(B, T + 3, jnp.float32)
    assert len(aug_cache.k) == 2
    cached, _, _, _ = unroll(heads, base, 1, hidden, normed, path, causal_mask(aug_cache.lengths, T, T + 3), aug_cache)
    close(cached, np.asarray(ctx, np.float64))


# ---------------------------------------------------------------- initialisation


def assert_noise(x):
    """x ~ U[0, NOISE), really drawn (not zero, not constant)."""
    assert x.min() >= 0 and x.max() < NOISE
    assert x.max() > NOISE / 2 and x.std() > NOISE / 5


def assert_eye_plus_noise(kernel):
    assert kernel.shape[0] == kernel.shape[1]
    assert_noise(kernel - np.eye(kernel.shape[0]))


def assert_equal_params(got: dict, want: dict):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_medusa_init_is_the_base_model():
    """Zero residual blocks: every fresh head gives exactly the base model's own logits."""
    base, heads = build("medusa", 3, randomised=False, tied=True)
    assert len(heads.blocks) == 3
    for name, value in params(heads).items():
        assert not value.any(), name
    path = token_path(base, 3)
    out = base_forward(base, path[0], causal_self_mask(B, T))
    _, _, _, logits = unroll(heads, base, 3, out.hidden, out.hidden_normed, path, causal_self_mask(B, T))
    for k in range(3):
        np.testing.assert_array_equal(logits[k], out.logits)


def test_clover_init():
    base, heads = build("clover", 3, randomised=False)
    p = params(heads)
    assert not p["decoder.v.kernel"].any()
    assert_eye_plus_noise(p["decoder.q.kernel"])
    assert_eye_plus_noise(p["decoder.k.kernel"])
    assert not np.array_equal(p["decoder.q.kernel"], p["decoder.k.kernel"])  # independent draws
    assert len(heads.blocks) == 3
    for k in range(3):
        assert not p[f"blocks.{k}.linear.kernel"].any() and not p[f"blocks.{k}.linear.bias"].any()
    assert len(heads.aug) == 1
    assert_equal_params(params(heads.aug[0]), params(base.layers[-1]))
    hidden, normed, _ = inputs(base)
    ctx, _, states, _ = unroll(heads, base, 3, hidden, normed, token_path(base, 3), causal_self_mask(B, T))
    for state in states:
        np.testing.assert_array_equal(state, ctx)  # W_V = 0: the Attention Decoder starts as identity


def test_clover2_init():
    base, heads = build("clover2", 5, randomised=False)
    p = params(heads)
    d = base.cfg.hidden_size
    for dec in ("decoder_in", "decoder_cell"):
        assert_eye_plus_noise(p[f"{dec}.q.kernel"])
        assert_eye_plus_noise(p[f"{dec}.k.kernel"])
        assert_noise(p[f"{dec}.v.kernel"])
        for name in "qkv":
            assert not p[f"{dec}.{name}.bias"].any()
    assert not np.array_equal(p["decoder_in.q.kernel"], p["decoder_cell.q.kernel"])  # independent draws
    assert not np.array_equal(p["decoder_in.q.kernel"], p["decoder_in.k.kernel"])
    assert_eye_plus_noise(p["w0.kernel"])
    w2 = p["w2.kernel"]
    assert w2.shape == (2 * d, d)
    assert_eye_plus_noise(w2[:d])  # input rows that read s: identity + noise
    assert_noise(w2[d:])  # input rows that read the token embedding: noise only
    assert not p["w0.bias"].any() and not p["w2.bias"].any()
    final_norm = np.asarray(base.norm.weight[...], np.float64)
    np.testing.assert_array_equal(p["aug_norm.weight"], final_norm)
    np.testing.assert_array_equal(p["head_norm.weight"], final_norm)
    assert len(heads.aug) == 2
    for layer in heads.aug:
        assert_equal_params(params(layer), params(base.layers[-1]))


@pytest.mark.parametrize("method", ["clover", "clover2"])
def test_aug_block_is_a_copy(method):
    """The Augmenting Block (and Clover-2's norms) start equal to the base's but share no storage:
    changing either side leaves the other as it was."""
    base, heads = build(method, registry.get(method).depth, randomised=False)  # test_*_init's: compiled
    heads_before = params(heads)
    randomise(base.layers[-1], 11)
    randomise(base.norm, 12)
    assert_equal_params(params(heads), heads_before)
    base_before = params(base)
    randomise(heads.aug[0], 13)
    if method == "clover2":
        randomise(heads.aug_norm, 14)
        randomise(heads.head_norm, 15)
        aug1 = {k: v for k, v in heads_before.items() if k.startswith("aug.1.")}
        assert_equal_params({k: params(heads)[k] for k in aug1}, aug1)  # the two layers are separate too
    assert_equal_params(params(base), base_before)


# ---------------------------------------------------------------- frozen token embeddings


def base_grads(base, losses) -> list[list[jax.Array]]:
    """Gradients w.r.t. every base Param of each loss(base) -> scalar, in one compiled program."""
    graphdef, base_params, rest = nnx.split(base, nnx.Param, ...)
    grad_all = jax.jit(lambda bp: [jax.grad(lambda q: f(nnx.merge(graphdef, q, rest)))(bp) for f in losses])
    return [jax.tree.leaves(g) for g in grad_all(base_params)]


def all_zero(leaves) -> bool:
    return bool(leaves) and all(not np.asarray(x).any() for x in leaves)


@pytest.mark.parametrize("tied", [False, True])
def test_token_embeddings_values_and_frozen(tied):
    base, heads = build("clover", 2, tied=tied)
    rows, table = lm_rows(base), np.asarray(base.embed_tokens.embedding[...], np.float64)
    close(token_embeddings(base, "lm_head", False), rows)
    close(token_embeddings(base, "input", False), table)
    close(token_embeddings(base, "lm_head", True), rows / (np.linalg.norm(rows, axis=-1, keepdims=True) + 1e-6))

    weights = jnp.asarray(np.random.default_rng(0).standard_normal(rows.shape), jnp.float32)
    hidden, _, tokens = inputs(base)
    sources = [(s, n) for s in ("lm_head", "input") for n in (False, True)]
    losses = [lambda b, s=s, n=n: jnp.sum(token_embeddings(b, s, n) * weights) for s, n in sources]
    # Through the head: a Clover node state reads the base only through the frozen embeddings ...
    losses.append(lambda b: jnp.sum(heads.node_state(b, 0, hidden, tokens) ** 2))
    # ... while its logits do reach lm_head (the optimizer, not stop_gradient, leaves the base out).
    losses.append(lambda b: jnp.sum(heads.node_logits(b, 0, hidden, tokens) ** 2))
    *frozen, through_lm_head = base_grads(base, losses)
    for (source, normalise), g in zip(sources + [("node_state", None)], frozen):
        assert all_zero(g), (source, normalise)
    assert not all_zero(through_lm_head)


def test_clover2_context_reads_the_base_only_through_frozen_embeddings():
    base, heads = build("clover2", 2)
    hidden, normed, tokens = inputs(base)

    def loss(b):
        ctx, _ = heads.context(b, hidden, normed, tokens, positions(), causal_self_mask(B, T), None)
        return jnp.sum(heads.node_state(b, 1, ctx, tokens) ** 2)

    assert all_zero(base_grads(base, [loss])[0])
