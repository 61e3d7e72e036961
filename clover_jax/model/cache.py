"""The KV cache: static buffers plus per-sequence lengths, and the attention masks over it.

Shapes never change during generation, so one compiled step serves every step. A forward pass writes
its T new keys/values at slots `lengths[b] + t` but does not move `lengths`: the caller commits what it
keeps (one token in plain decoding, the accepted path of a tree after compaction). The mask says which
slots each new token may read, which is how one forward serves a causal prompt and a token tree alike.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

# Logical axis names of the cache buffers, mapped to mesh axes by the sharding rule table.
CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Per-layer key/value buffers of fixed size S and each sequence's committed length."""

    # One [B, K, S, H] buffer per layer: each (sequence, kv head) reads S contiguous slots, the layout
    # attention's two matmuls take as is. (A stacked [L, B, S, K, H] buffer cost a slicing and a
    # transposing copy per layer and step on XLA:CPU, more than the layer's matmuls.)
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32: slots [0, lengths[b]) hold sequence b's committed tokens
    # Static: nothing committed yet (a new cache until its first `advance`), so attention skips reading it.
    fresh: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> "KVCache":
        """An empty cache: zero buffers, every length 0."""
        buffers = lambda: tuple(jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype) for _ in range(num_layers))
        return cls(k=buffers(), v=buffers(), lengths=jnp.zeros((batch,), jnp.int32), fresh=True)

    @property
    def max_len(self) -> int:
        """S, the slots per sequence."""
        return self.k[0].shape[2]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> "KVCache":
        """Write new keys/values [B, K, T, H] of one layer at slots lengths[b] .. lengths[b] + T - 1."""
        b, _, t, _ = k_new.shape
        rows = jnp.arange(b)[:, None]
        slots = self.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]

        def put(buf, new):  # one scatter for the batch, which XLA does in place
            return buf.at[rows, :, slots].set(jnp.swapaxes(new, 1, 2).astype(buf.dtype), mode="drop",
                                              unique_indices=True)

        write = lambda bufs, new: tuple(put(buf, new) if i == layer else buf for i, buf in enumerate(bufs))
        return self.replace(k=write(self.k, k_new), v=write(self.v, v_new))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, K, S, H] of one layer."""
        return self.k[layer], self.v[layer]

    def advance(self, n: jax.Array) -> "KVCache":
        """Commit n[b] more tokens of sequence b (the ones just written at the head of its slots)."""
        return self.replace(lengths=self.lengths + n.astype(jnp.int32), fresh=False)


def causal_mask(lengths: jax.Array, num_new: int, max_len: int) -> jax.Array:
    """[B, T, S] mask for T new tokens appended after `lengths[b]` committed ones: each reads every
    committed slot and the new tokens up to itself."""
    slot = jnp.arange(max_len)[None, None, :]
    query = lengths[:, None, None] + jnp.arange(num_new)[None, :, None]
    return slot <= query


def tree_mask(lengths: jax.Array, ancestor_mask: jax.Array, max_len: int) -> jax.Array:
    """[B, F, S] mask for F nodes of a tree of N slots written after `lengths[b]` committed tokens: each
    node reads the committed prefix and its own ancestors (itself included), given by `ancestor_mask`
    [F, N] or [1, F, N] (one tree for the batch) or [B, F, N] (a tree per sequence); F = N when the
    whole tree is verified, fewer when a drafter runs one level of it."""
    if ancestor_mask.ndim == 3 and ancestor_mask.shape[0] == 1:
        ancestor_mask = ancestor_mask[0]
    b, n = lengths.shape[0], ancestor_mask.shape[-1]
    slot = jnp.arange(max_len)
    rel = slot[None, :] - lengths[:, None]  # [B, S]: position of each slot inside the tree
    in_tree = (rel >= 0) & (rel < n)
    idx = jnp.clip(rel, 0, n - 1)
    if ancestor_mask.ndim == 2:
        anc = jnp.transpose(jnp.take(ancestor_mask, idx, axis=1), (1, 0, 2))  # [B, N, S]
    else:
        rows = ancestor_mask.shape[1]
        anc = jnp.take_along_axis(ancestor_mask, jnp.broadcast_to(idx[:, None, :], (b, rows, max_len)), axis=2)
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & anc)
