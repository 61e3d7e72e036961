"""DFlash 2: DFlash's block drafter with two additions (the authors' `DFlash2DraftModel`).

- Grouped dynamic causal convolutions around each layer's attention and MLP (`attention_conv`,
  `mlp_conv`): causal over the block's positions, kernel_size taps, each tap a per-channel base weight
  plus a weight per group of `conv_group_size` channels projected from the sub-layer's normed input
  at the output position. One kernel set convolves what enters the sub-layer, the other its output.
- A candidate selector (`candidate_selector`): at block position k the top `selector_top_k` tokens of
  DFlash's logits, each scored by its logit plus a low-rank bilinear term,
  predecessor_codebook[parent token] * hidden_projection(hidden_k) . successor_codebook[candidate].
  A node's children therefore depend on the node's own token: `expand` gives each node its own logits
  (the top-k scores, NO_LOGIT elsewhere), so chains follow the authors' left-to-right choice and static,
  dynamic and EAGLE-2 trees draft from the selector's scores.
Training scores the bilinear term over the whole vocabulary (the top-k restriction has no gradient to
give), with each chain node's parent the data's token, under DFlash's loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_loss
from clover_jax.drafters.draft_model import NO_LOGIT
from clover_jax.drafters.losses import shift_left
from clover_jax.drafters.registry import Method, register
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear, param, product
from clover_jax.model.llama import Llama


@dataclasses.dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    """DFlash 2's options beside DFlash's, as its dflash_config names them: `conv_kernel_size` (taps),
    `conv_group_size` (channels sharing a dynamic weight; divides the hidden size), `selector_rank` and
    `selector_top_k` (the candidates scored per position)."""

    conv_kernel_size: int = 4
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 8

    def __post_init__(self):
        super().__post_init__()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CloverError(f"{name}={value!r} must be an integer >= 1")


class DynamicCausalConv(nnx.Module):
    """The authors' GroupedDynamicCausalConv: base_kernel [2, taps, D] (one set before the sub-layer,
    one after), kernel_projection D -> 2 x taps x groups. Starts as the identity (tap 0 one, the rest
    and the projection zero), so a fresh DFlash 2 drafts as DFlash."""

    def __init__(self, d: int, taps: int, group_size: int, *, dtype, rngs: nnx.Rngs):
        self.taps, self.group_size = taps, group_size
        self.base_kernel = param(jnp.zeros((2, taps, d), dtype).at[:, 0].set(1), (None, None, "embed"))
        self.kernel_projection = Linear(d, 2 * taps * (d // group_size), ("embed", None), dtype=dtype, rngs=rngs)
        self.kernel_projection.kernel[...] = jnp.zeros_like(self.kernel_projection.kernel[...])

    def _convolve(self, h, dynamic, base):
        """sum over taps o of (base[o] + dynamic[..., l, o, group]) * h[..., l - o, :] (zero before the
        block's start). h [..., L, D], dynamic [..., L, taps, G], base [taps, D]."""
        *lead, length, d = h.shape
        groups = d // self.group_size
        blocks = h.reshape(*lead, length, groups, self.group_size)
        out = jnp.zeros_like(blocks)
        for o in range(self.taps):
            pad = [(0, 0)] * len(lead) + [(o, 0), (0, 0), (0, 0)]
            values = jnp.pad(blocks, pad)[..., :length, :, :]
            kernel = base[o].reshape(groups, self.group_size).astype(h.dtype)
            out = out + kernel * values + dynamic[..., o, :, None].astype(h.dtype) * values
        return out.reshape(h.shape)

    def prepare(self, h):
        """(the convolved input of the sub-layer, the dynamic kernel its output takes) of h [..., L, D]."""
        groups = h.shape[-1] // self.group_size
        dynamic = self.kernel_projection(h).reshape(*h.shape[:-1], 2, self.taps, groups)
        return self._convolve(h, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, out, dynamic):
        return self._convolve(out, dynamic, self.base_kernel[1])


class CandidateSelector(nnx.Module):
    """The codebooks [V, R] (stored as `candidate_selector.{predecessor,successor}_codebook`, without
    `.weight`) and hidden_projection D -> R."""

    def __init__(self, v: int, d: int, rank: int, top_k: int, *, dtype, rngs: nnx.Rngs):
        self.top_k = top_k
        self.predecessor_codebook = param(0.02 * jax.random.normal(rngs.params(), (v, rank), dtype), ("vocab", None))
        self.successor_codebook = param(0.02 * jax.random.normal(rngs.params(), (v, rank), dtype), ("vocab", None))
        self.hidden_projection = Linear(d, rank, ("embed", None), dtype=dtype, rngs=rngs)

    def bilinear(self, parents, hidden, candidates):
        """[..., F, C] pred[parent] * proj(hidden) . succ[candidate] for parents [..., F], hidden [..., D],
        candidates [..., C] (token ids)."""
        pred = jnp.take(self.predecessor_codebook[...], parents, axis=0)  # [..., F, R]
        succ = jnp.take(self.successor_codebook[...], candidates, axis=0)  # [..., C, R]
        h = self.hidden_projection(hidden)[..., None, :]  # [..., 1, R]
        return product("...fr,...cr->...fc", pred * h.astype(pred.dtype), succ).astype(jnp.float32)


class DFlash2Drafter(DFlashDrafter):
    """DFlash with the convolutions and the candidate selector (the module docstring)."""

    def __init__(self, hcfg: DFlash2Config, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base, rngs=rngs)
        d, dtype = base.cfg.hidden_size, base.dtype
        if d % hcfg.conv_group_size:
            raise CloverError(f"conv_group_size {hcfg.conv_group_size} does not divide the hidden size {d}; "
                              "pick one that does")
        for layer in self.layers:
            layer.attention_conv = DynamicCausalConv(d, hcfg.conv_kernel_size, hcfg.conv_group_size, dtype=dtype, rngs=rngs)
            layer.mlp_conv = DynamicCausalConv(d, hcfg.conv_kernel_size, hcfg.conv_group_size, dtype=dtype, rngs=rngs)
        self.candidate_selector = CandidateSelector(base.cfg.vocab_size, d, hcfg.selector_rank, hcfg.selector_top_k,
                                                    dtype=dtype, rngs=rngs)

    def _conv(self, i: int, where: str) -> DynamicCausalConv:
        return getattr(self.layers[i], f"{where}_conv")

    def mix_in(self, i, where, h):
        return self._conv(i, where).prepare(h)

    def mix_out(self, i, where, out, later):
        return self._conv(i, where).finish(out, later)

    def level_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """[B, F, V or N]: each node's selector scores over the top-k of the position's logits (its own
        token the predecessor), NO_LOGIT on every other token."""
        unary = self.scores(base, out, vocab)  # [B, V or N]
        top, index = jax.lax.top_k(unary, min(self.candidate_selector.top_k, unary.shape[-1]))
        ids = index if vocab is None else vocab.token(index)
        scores = top[:, None, :] + self.candidate_selector.bilinear(tokens, out, ids)  # [B, F, C]
        b, f = tokens.shape
        rows = jnp.arange(b)[:, None, None]
        full = jnp.full((b, f, unary.shape[-1]), NO_LOGIT, jnp.float32)
        return full.at[rows, jnp.arange(f)[None, :, None], index[:, None, :]].set(scores)

    def train_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """The selector's score of every token (the loss vocabulary's): position k's logits plus the
        bilinear term with the data's token t + 1 + k as the predecessor."""
        unary = self.scores(base, out, vocab)  # [K, B, T, V or N]
        ids = jnp.arange(unary.shape[-1]) if vocab is None else vocab.ids
        parents = jnp.stack([shift_left(tokens, k + 1) for k in range(out.shape[0])])  # [K, B, T]
        sel = self.candidate_selector
        pred = jnp.take(sel.predecessor_codebook[...], parents, axis=0) * sel.hidden_projection(out)  # [K, B, T, R]
        succ = jnp.take(sel.successor_codebook[...], ids, axis=0)  # [V or N, R]
        return unary + product("kbtr,vr->kbtv", pred, succ.astype(pred.dtype)).astype(jnp.float32)

    def drafted_logits(self, base: Llama, hidden, logits, vocab: DraftVocab | None = None):
        """Training's selector scores kept on the top `selector_top_k` tokens of each position's own
        logits, NO_LOGIT elsewhere, as `level_logits` keeps them (a tie at the k-th logit keeps both)."""
        unary = self.scores(base, hidden, vocab)
        kth = jax.lax.top_k(unary, min(self.candidate_selector.top_k, unary.shape[-1]))[0][..., -1:]
        return jnp.where(unary >= kth, logits, NO_LOGIT)


register(Method("dflash2", DFlash2Drafter, DFlash2Config, depth=15, tree="medusa_mc_sim_7b_63", loss=dflash_loss,
                title="DFlash 2"))
