"""Building blocks of a decoder layer (Llama's, and what Qwen3 and Gemma 3 add to it), named and laid
out as Hugging Face names them.

Parameter names follow `transformers` (`o_proj`, `gate_proj`, `input_layernorm`, `q_norm`,
`pre_feedforward_layernorm`, ...) and RoPE uses HF's rotate-half layout, so importing a checkpoint
is a renaming plus transposes; the one exception is `qkv_proj`, HF's q/k/v projections held as one
parameter (`QKVProjection`). Every parameter carries logical axis names (`out_sharding` metadata)
that `sharding.py` maps to a device mesh.
Letters: B batch, T new tokens, S cache slots, N query heads, K kv heads, G = N/K, H head dim, D model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.model.cache import KVCache
from clover_jax.model.config import ModelConfig, rope_inv_freq


def param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter with logical axis names; sharding is applied later, by the mesh rule table."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, a, b)`, at full float32 precision when the operands are float32.

    By default accelerators multiply float32 at less than its precision (XLA:GPU in TF32, a TPU in one
    bfloat16 pass), and the rounding then depends on the product's shape: a verify step's many rows and
    plain decoding's one row round apart, so greedy speculative text left plain decoding's at near-ties
    (four methods of five on MT-Bench, SmolLM2 on an H200, 2026-11-27; the two rerun at full precision matched). Float32
    here means float32 on every backend, as the promise that greedy speculative text is plain decoding's
    assumes; XLA:CPU multiplies float32 fully either way, and bfloat16 is unchanged (the fast setting on
    an accelerator, and not exact)."""
    full = jnp.result_type(a, b) == jnp.float32
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST if full else None)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] (HF stores the transpose)."""

    def __init__(self, din: int, dout: int, axes: tuple[str, str], *, bias: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs, std: float = 0.02):
        self.kernel = param(std * jax.random.normal(rngs.params(), (din, dout), dtype), axes)
        self.bias = param(jnp.zeros((dout,), dtype), axes[1:]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = product("...i,io->...o", x, self.kernel[...].astype(x.dtype))
        return y + self.bias[...].astype(x.dtype) if self.bias is not None else y


class QKVProjection(nnx.Module):
    """q, k and v in one product: kernel [D, K, G + 2, H], each kv head's G query heads, then its key,
    then its value (bias [K, G + 2, H]).

    One parameter, because XLA:GPU turns a vector-matrix product whose operands total under 10M
    elements (a one-token step's k and v projections of Llama-3-8B) into a multiply-and-reduce at a
    third of the bandwidth, and kernels concatenated at call time are copied on every step rather than
    hoisted out of the loop. Laid out per kv head so that a mesh still splits it over kv heads. On disk
    it stays HF's three tensors (`stored_parts`, `to_stored`, `from_stored`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shape = (k, n // k + 2, h)
        self.kernel = param(std * jax.random.normal(rngs.params(), (d, *shape), dtype),
                            ("embed", "kv_heads", "qkv", "head_dim"))
        self.bias = param(jnp.zeros(shape, dtype), ("kv_heads", "qkv", "head_dim")) if cfg.qkv_bias else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H]."""
        y = product("btd,dkgh->btkgh", x, self.kernel[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        b, t, k, g2, h = y.shape  # g2 = G + 2
        return y[:, :, :, : g2 - 2].reshape(b, t, k * (g2 - 2), h), y[:, :, :, g2 - 2], y[:, :, :, g2 - 1]


QKV_PARTS = ("q_proj", "k_proj", "v_proj")  # HF's names for the three parts of `QKVProjection`


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_heads: int) -> np.ndarray:
    """HF's q, k, v ([..., N*H], [..., K*H], [..., K*H]; kernels as [in, out]) -> [..., K, G+2, H].
    Query head n reads kv head n // G, as in HF's `repeat_kv`, so a kv head's queries are contiguous."""
    *lead, kh = k.shape
    h = kh // kv_heads
    q = q.reshape(*lead, kv_heads, q.shape[-1] // kh, h)
    return np.concatenate([q, k.reshape(*lead, kv_heads, 1, h), v.reshape(*lead, kv_heads, 1, h)], axis=-2)


def _fused(path: tuple) -> bool:
    return len(path) >= 2 and path[-2] == "qkv_proj"


def stored_parts(path: tuple, shape: tuple[int, ...]) -> list[tuple[tuple, tuple[int, ...]]]:
    """(path, shape) of each tensor a parameter is stored as on disk (our [in, out] layout): the fused
    q/k/v projection as HF's three, any other parameter as itself."""
    if not _fused(path):
        return [(path, tuple(shape))]
    *lead, k, g2, h = shape  # g2 = G + 2
    return [(path[:-2] + (name, path[-1]), (*lead, width))
            for name, width in zip(QKV_PARTS, (k * (g2 - 2) * h, k * h, k * h))]


def to_stored(path: tuple, value: np.ndarray) -> list[tuple[tuple, np.ndarray]]:
    """A parameter's value as the tensors `stored_parts` names."""
    if not _fused(path):
        return [(path, value)]
    *lead, k, g2, h = value.shape  # g2 = G + 2
    parts = (value[..., : g2 - 2, :].reshape(*lead, k * (g2 - 2) * h), value[..., g2 - 2, :].reshape(*lead, k * h),
             value[..., g2 - 1, :].reshape(*lead, k * h))
    return [(p, part) for (p, _), part in zip(stored_parts(path, value.shape), parts)]


def from_stored(parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of `to_stored`: a parameter of `shape` from its stored tensors."""
    return fuse_qkv(*parts, shape[-3]) if len(parts) == 3 else parts[0]


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, normalised in float32. Llama's (HF's LlamaRMSNorm): cast back to x's
    dtype, then times w. `unit_offset` (Gemma's): times (1 + w) still in float32, then cast, with w
    starting at 0. `axes`: the weight's logical axis (a q/k norm's is the head dim)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32, unit_offset: bool = False,
                 axes: tuple[str] = ("embed",)):
        self.weight = param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype), axes)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)

    def scale(self) -> jax.Array:
        """The per-channel factor it applies, w or 1 + w: the weight a Llama-style norm copies."""
        return self.weight[...] + 1 if self.unit_offset else jnp.copy(self.weight[...])


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, rotate-half layout. x [B, T, N, H], positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _grouped(q: jax.Array, kv: int) -> jax.Array:
    """q [B, T, N, H] -> [B, K, T*G, H]: the G = N/K query heads sharing a kv head and the T tokens form
    one block per kv head, so both attention products are batched matmuls over K/V as they are laid out."""
    b, t, n, h = q.shape
    return jnp.swapaxes(q.reshape(b, t, kv, n // kv, h), 1, 2).reshape(b, kv, t * (n // kv), h)


def _scores(qg: jax.Array, k: jax.Array, mask: jax.Array, scalar: float | None = None) -> jax.Array:
    """Float32 scores [B, K, T*G, S] of grouped queries against keys [B, K, S, H], divided by
    sqrt(scalar) (H by default); the lowest float where mask [B, T, S] is off."""
    b, kv, tg, h = qg.shape
    t, s = mask.shape[1], k.shape[2]
    scores = product("bkqh,bksh->bkqs", qg, k.astype(qg.dtype)).astype(jnp.float32)
    scores = scores / np.sqrt(h if scalar is None else scalar)
    scores = jnp.where(mask[:, None, :, None, :], scores.reshape(b, kv, t, tg // t, s), jnp.finfo(jnp.float32).min)
    return scores.reshape(b, kv, tg, s)


def _split_softmax(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The softmax over the last axis of [a | b], returned as its a and b parts: the two share one
    maximum and one denominator, but the blocks are never concatenated (which made XLA:GPU build the
    softmax in one small kernel that took a sixth of a single-token layer's time)."""
    top = jnp.maximum(a.max(-1, keepdims=True), b.max(-1, keepdims=True))
    p_a, p_b = jnp.exp(a - top), jnp.exp(b - top)
    total = p_a.sum(-1, keepdims=True) + p_b.sum(-1, keepdims=True)
    return p_a / total, p_b / total


QUERY_BLOCK = 512
MAX_QUERY_BLOCKS = 8


def query_blocks(t: int) -> list[tuple[int, int]]:
    """[start, end) of the query blocks a causal forward of `t` tokens is attended in: blocks of at
    least QUERY_BLOCK tokens, at most MAX_QUERY_BLOCKS of them (each is its own products in the program)."""
    n = max(1, min(MAX_QUERY_BLOCKS, t // QUERY_BLOCK))
    edges = [t * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _attend_fresh(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scalar: float | None = None) -> jax.Array:
    """Softmax attention of grouped queries qg [B, K, T*G, H] over keys/values [B, K, S, H] under mask [B, T, S]."""
    p = jax.nn.softmax(_scores(qg, k, mask, scalar), axis=-1)
    return product("bkqs,bksh->bkqh", p.astype(qg.dtype), v)


def _attend_causal(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scalar: float | None = None) -> jax.Array:
    """Softmax attention of grouped queries qg [B, K, T*G, H] over their own keys/values [B, K, T, H]
    under mask [B, T, T] and causality: a block of queries reads only the keys up to its last token.
    The keys after it are masked anyway; skipping them leaves 5/8 of the scores in four blocks, and
    smaller score arrays (SmolLM2's forward over 2,048 tokens on a 2-core CPU: 10.1 s in one block,
    6.9 s in four, 1 s more compiling; smaller blocks gained nothing more there). A sliding window is
    in the mask already; a block still reads the keys before it that the window masks."""
    b, kv, tg, h = qg.shape
    t = mask.shape[1]
    g = tg // t
    q5 = qg.reshape(b, kv, t, g, h)
    outs = []
    for s, e in query_blocks(t):
        block = q5[:, :, s:e].reshape(b, kv, (e - s) * g, h)
        out = _attend_fresh(block, k[:, :, :e], v[:, :, :e], mask[:, s:e, :e], scalar)
        outs.append(out.reshape(b, kv, e - s, g, h))
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, 2)).reshape(b, kv, tg, h)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cache: KVCache | None = None,
           layer: int = 0, causal: bool = False, *, positions: jax.Array | None = None,
           window: int | None = None, scalar: float | None = None) -> jax.Array:
    """Grouped-query attention of T new tokens. q [B, T, N, H]; their own keys/values k/v [B, K, T, H].

    Without a cache, mask [B, T, T] says which new tokens each reads. With one, mask [B, T, S] is over
    the cache's slots, the new tokens counting as slots lengths[b] .. lengths[b] + T - 1, and the
    committed slots of `layer` are read as they are, before the new K/V are written: nothing then
    reads a cache buffer after its write, so XLA updates it in place (attending over the written
    buffer made XLA:CPU copy every layer's buffer two or three times per step, a fifth of a step).
    `causal` (static; a forward without a cache or with a fresh one, as a prefill is): no token reads a
    later one, whatever the mask says, which lets a long forward attend in blocks (`_attend_causal`).
    `window` W (static; a sliding-window layer's, with the new tokens' `positions` [B, T]): a query at
    position p reads, of what the mask allows, only keys at positions k with p - k < W (transformers'
    convention). A new token's key is at its own position and committed slot i at position i: a prefill
    writes the prompt from slot 0 and a speculative step moves its accepted path to the slots right
    after the committed ones. So a tree's nodes are windowed by their depth, not by their slot, and
    tree verification is exact with no more from its caller than the positions it passes anyway.
    `scalar`: scores are divided by sqrt(scalar), H by default (Gemma 3's query_pre_attn_scalar)."""
    b, t, n, h = q.shape
    kv = k.shape[1]
    qg = _grouped(q, kv)
    v = v.astype(q.dtype)
    near = lambda key_positions: positions[:, :, None] - key_positions < window  # [B, T, *]
    among_new = mask
    if cache is not None:  # the new tokens' own slots, read off the mask over slots
        own = jnp.clip(cache.lengths[:, None] + jnp.arange(t)[None, :], 0, cache.max_len - 1)  # [B, T]
        among_new = jnp.take_along_axis(mask, jnp.broadcast_to(own[:, None, :], (b, t, t)), axis=2)
    if window is not None:
        among_new = among_new & near(positions[:, None, :])
    fresh = cache is None or cache.fresh  # a fresh cache (prefill) has no committed slot to read
    if causal and not fresh:
        raise ValueError("causal attention in blocks is for a forward with no committed slot to read")
    if causal:
        out = _attend_causal(qg, k, v, among_new & jnp.tril(jnp.ones((t, t), bool)), scalar)
    elif fresh:
        out = _attend_fresh(qg, k, v, among_new, scalar)
    else:
        # One softmax over the committed slots and the new tokens, taken in two parts.
        cache_k, cache_v = cache.layer(layer)
        slots = jnp.arange(cache.max_len)[None, None, :]
        committed = mask & (slots < cache.lengths[:, None, None])
        if window is not None:
            committed = committed & near(slots)
        old = _scores(qg, cache_k, committed, scalar)
        p_old, p_new = _split_softmax(old, _scores(qg, k, among_new, scalar))
        mix = lambda p, values: product("bkqs,bksh->bkqh", p.astype(q.dtype), values.astype(q.dtype))
        out = mix(p_old, cache_v) + mix(p_new, v)
    return jnp.swapaxes(out.reshape(b, kv, t, n // kv, h), 1, 2).reshape(b, t, n, h)


def attend_unrolled(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, own_k: list, own_v: list) -> jax.Array:
    """Attention of a draft model's training-time test step: T queries q [B, T, N, H] read the first
    step's keys/values k/v [B, K, T, H] under mask [B, T, T], and each query reads, at its own position
    only, every later step's key/value so far (own_k/own_v, each [B, K, T, H]): the block-diagonal
    part of the unrolled mask. Scored position by position, that part costs T * steps; concatenated
    and masked it cost T * T * steps (EAGLE-3's seven steps on SmolLM2, 4 x 512: 4x the time)."""
    if not own_k:
        return attend(q, k, v, mask)
    b, t, n, h = q.shape
    kv, g = k.shape[1], n // k.shape[1]
    qg = _grouped(q, kv)
    first = _scores(qg, k, mask)  # [B, K, T*G, T]
    q5 = qg.reshape(b, kv, t, g, h)
    own = jnp.stack([product("bktgh,bkth->bktg", q5, x.astype(q.dtype)) for x in own_k], -1)  # [B, K, T, G, J]
    own = own.astype(jnp.float32).reshape(b, kv, t * g, len(own_k)) / np.sqrt(h)
    p_first, p_own = _split_softmax(first, own)
    out = product("bkqs,bksh->bkqh", p_first.astype(q.dtype), v.astype(q.dtype))
    p_own = p_own.astype(q.dtype).reshape(b, kv, t, g, len(own_v))
    values = jnp.stack([x.astype(q.dtype) for x in own_v], 3)  # [B, K, T, J, H]
    out = out + product("bktgj,bktjh->bktgh", p_own, values).reshape(out.shape)
    return jnp.swapaxes(out.reshape(b, kv, t, g, h), 1, 2).reshape(b, t, n, h)


def after(x: jax.Array, dep: jax.Array) -> jax.Array:
    """x + 0 * dep (dep broadcast to x): x's value, made to depend on dep. XLA updates a buffer in place
    only after the reads of it that the update depends on; others it orders by copying the buffer first.
    The value differs from x only where dep is not finite, which the decoding loops report anyway."""
    return x + 0 * dep.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions, reading and writing the KV cache. With
    `cfg.qk_norm`, each head's q and k are RMS-normalised over H before RoPE (Qwen3, Gemma 3). `local`:
    a sliding-window layer (`attend`'s `window`), with the local RoPE where the family has one."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, local: bool = False):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = QKVProjection(cfg, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(n * h, d, ("heads", "embed"), dtype=dtype, rngs=rngs)
        head_norm = lambda: RMSNorm(h, cfg.rms_norm_eps, dtype, cfg.norm_unit_offset, axes=("head_dim",))
        self.q_norm = head_norm() if cfg.qk_norm else None
        self.k_norm = head_norm() if cfg.qk_norm else None
        self.shape = (n, k, h)
        self.cfg = cfg  # static: RoPE frequencies are derived from it at trace time
        self.local = local
        self.window = cfg.sliding_window if local else None

    def project(self, x, positions):
        """q [B, T, N, H] and k, v [B, K, T, H] (the cache's layout) of x [B, T, D], rotated to their positions."""
        inv_freq = rope_inv_freq(self.cfg, self.local)
        q, k, v = self.qkv_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

    def __call__(self, x, positions, mask, cache: KVCache | None, layer: int, causal: bool = False):
        """x [B, T, D]; with a cache, attention reads its committed slots and the new tokens (mask
        [B, T, S] over slots) and the new K/V are written at its head; without one (training), attention
        runs over the T tokens themselves with mask [B, T, T]. `causal`: as `attend`'s."""
        b, t, _ = x.shape
        n, k, h = self.shape
        q, kk, vv = self.project(x, positions)
        out = attend(q, kk, vv, mask, cache, layer, causal, positions=positions, window=self.window,
                     scalar=self.cfg.query_pre_attn_scalar)
        if cache is not None:  # written after the attention has read the cache
            # one output element per (sequence, kv head): the tie stays on each device of a mesh
            tie = jnp.swapaxes(out.reshape(b, t, k, n // k, h)[:, :1, :, :1, 0], 1, 2)  # [B, K, 1, 1]
            cache = cache.write(layer, after(kk, tie), after(vv, tie))
        return self.o_proj(out.reshape(b, t, n * h)), cache


# The MLP's gate: SwiGLU's SiLU, GeGLU's tanh-approximated GELU (transformers' gelu_pytorch_tanh).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh GELU (GeGLU, Gemma)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm transformer layer. Also the Augmenting Block of Clover / Clover-2 (own cache).

    Llama's: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)). Gemma 3's
    (`cfg.sandwich_norms`) also normalises each branch's output: x + post_attention_layernorm(attn(
    input_layernorm(x))), then + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))).
    `local`: the attention is a sliding-window layer's."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, local: bool = False):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_unit_offset)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, local=local)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, mask, cache: KVCache | None = None, layer: int = 0, causal: bool = False):
        attn, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache, layer, causal)
        if self.pre_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x)), cache
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache


class Embed(nnx.Module):
    """The token embedding table; with tied embeddings it is the lm_head too. `scale` (Gemma's
    sqrt(D)): looked-up rows are multiplied by it in the table's dtype, as HF does (in bfloat16
    sqrt(3072) = 55.43 becomes 55.5); the output projection reads the table unscaled."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs, scale: float | None = None):
        self.embedding = param(0.02 * jax.random.normal(rngs.params(), (vocab, dim), dtype), ("vocab", "embed"))
        # HF keeps the scale as a float32 tensor and casts that to the table's dtype
        self.scale = None if scale is None else float(np.float32(scale))

    def __call__(self, tokens: jax.Array, dtype) -> jax.Array:
        rows = jnp.take(self.embedding[...], tokens, axis=0)
        if self.scale is not None:
            rows = rows * jnp.asarray(self.scale, rows.dtype)
        return rows.astype(dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output projection: logits = x @ embedding^T."""
        # Contracting the table's own last axis: `x @ table.T` made XLA:CPU copy the transpose every step.
        return product("...d,vd->...v", x, self.embedding[...].astype(x.dtype))
