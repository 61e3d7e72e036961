"""DFlash + Clover cell: DFlash's block drafter with a Clover-2-style recurrent cell correcting each
block position by the tokens drafted before it (issue 86, item 6).

DFlash drafts a whole block in one pass, so block position k's distribution cannot know which token a
tree chose at k - 1: depth d's nodes share position d + 1's logits. Clover-2's answer for heads is a
small recurrent cell fed the previous token; here it runs on DFlash's output vectors:

    s_d = GRU(s_{d-1}, [embed_norm(E[x_d]); o_{d+1}]),   h = o_{d+1} + W_out s_d,   logits = lm_head(h)

for the node at depth d holding token x_d (the root: the block's root token, s_{-1} = 0), o_{d+1} the
normed DFlash output at block position d + 1 and E the base model's raw input embedding (as the block
is embedded, times `input_embedding_scale`). s_d is the node's own state, handed to its children as
the tree's carry, so every node (of a chain, a static or a dynamic tree) scores its children by its own
path's tokens: one cell step and one lm_head row per node, no draft-model pass. W_out starts at zero,
so a fresh correction drafts exactly as DFlash.

Training (`train_logits`) steps the cell along each window's block with the data's tokens as the
chosen ones (teacher forcing): the scores decoding gives a chain of those tokens. The cell's width
defaults to the one whose parameter count matches DFlash 2's candidate selector at its default rank on
the base model (`matched_width`); `backbone` names the method whose trained drafter is the frozen DFlash
part, so `train.train --backbone DIR` trains the cell alone on a trained DFlash drafter.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import Frontier
from clover_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_loss
from clover_jax.drafters.dflash2 import DFlash2Config
from clover_jax.drafters.losses import shift_left
from clover_jax.drafters.registry import Method, register
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear, RMSNorm
from clover_jax.model.llama import Llama

SELECTOR_RANK = DFlash2Config.selector_rank  # DFlash 2's default rank, the budget the default width matches


def selector_params(d: int, v: int, rank: int = SELECTOR_RANK) -> int:
    """DFlash 2's candidate selector's parameters: two [V, R] codebooks and a D -> R projection."""
    return 2 * v * rank + d * rank


def cell_params(d: int, width: int) -> int:
    """The cell's parameters (`CloverCell`): embed_norm D, input 2D -> 3W with bias, recurrent W -> 3W,
    output W -> D."""
    return d + (2 * d + 1) * 3 * width + width * 3 * width + width * d


def matched_width(d: int, v: int, rank: int = SELECTOR_RANK) -> int:
    """The widest cell with no more parameters than DFlash 2's selector of `rank` (at least 1)."""
    target, a, b = selector_params(d, v, rank) - d, 3, 7 * d + 3  # cell_params = a W^2 + b W + d
    width = int((-b + math.sqrt(b * b + 4 * a * max(target, 0))) / (2 * a))
    while width > 1 and cell_params(d, width) > selector_params(d, v, rank):
        width -= 1
    return max(width, 1)


@dataclasses.dataclass(frozen=True)
class DFlashCloverConfig(DFlashConfig):
    """DFlash's options plus `cell_width`, the recurrent cell's state width (None: `matched_width`, the
    parameter count of DFlash 2's selector at rank 64 on the base model)."""

    cell_width: int | None = None

    def __post_init__(self):
        super().__post_init__()
        w = self.cell_width
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise CloverError(f"cell_width={w!r} must be an integer >= 1 (or null: as many parameters as DFlash 2's "
                              "selector)")


class CloverCell(nnx.Module):
    """One GRU step over [embed_norm(e); o] and the state s [..., W]; the corrected vector o + output(s').
    Gate order in the fused matrices: update z, reset r, candidate n."""

    def __init__(self, d: int, width: int, eps: float, dtype, rngs: nnx.Rngs):
        self.embed_norm = RMSNorm(d, eps, dtype)
        self.input = Linear(2 * d, 3 * width, ("embed", None), bias=True, dtype=dtype, rngs=rngs,
                            std=1 / math.sqrt(2 * d))
        self.recurrent = Linear(width, 3 * width, (None, None), dtype=dtype, rngs=rngs, std=1 / math.sqrt(width))
        self.output = Linear(width, d, (None, "embed"), dtype=dtype, rngs=rngs)
        self.output.kernel[...] = jnp.zeros_like(self.output.kernel[...])  # a fresh cell corrects nothing

    def __call__(self, state, e, o):
        """(the new state [..., W], the corrected output [..., D]) from the state [..., W], the token's
        embedding e [..., D] and the block position's output o [..., D]."""
        xz, xr, xn = jnp.split(self.input(jnp.concatenate([self.embed_norm(e.astype(o.dtype)), o], -1)), 3, -1)
        hz, hr, hn = jnp.split(self.recurrent(state.astype(o.dtype)), 3, -1)
        z, r = jax.nn.sigmoid(xz + hz), jax.nn.sigmoid(xr + hr)
        state = (1 - z) * jnp.tanh(xn + r * hn) + z * state.astype(o.dtype)
        return state, o + self.output(state)


class DFlashCloverDrafter(DFlashDrafter):
    """DFlash with a Clover cell (the module docstring); its parameters are DFlash's plus `clover_cell`."""

    backbone = "dflash"  # its frozen part, for train.train --backbone: the parameters a dflash drafter has

    def __init__(self, hcfg: DFlashCloverConfig, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base, rngs=rngs)
        d = base.cfg.hidden_size
        width = hcfg.cell_width or matched_width(d, base.cfg.vocab_size)
        self.hcfg = dataclasses.replace(self.hcfg, cell_width=width)  # heads.json names the width it has
        self.clover_cell = CloverCell(d, width, self.layer_cfg.rms_norm_eps, base.dtype, rngs)

    def token_rows(self, base: Llama, tokens) -> jax.Array:
        """[..., D] the tokens' embedding as the block embeds its tokens (`block_input`)."""
        rows = jnp.take(jax.lax.stop_gradient(base.embed_tokens.embedding[...]), tokens, axis=0)
        return (rows * jnp.asarray(self.hcfg.input_embedding_scale, rows.dtype)).astype(base.dtype)

    def expand(self, base: Llama, state, frontier: Frontier, vocab: DraftVocab | None = None):
        """The root runs the block; each node at depth d steps the cell from its parent's state with its
        own token over block position d + 1's output: logits [B, F, V or N], its state the carry."""
        if frontier.depth == 0:
            state = state.replace(block=self.run_block(base, state.cache, frontier.tokens[:, 0]))
        out = state.block[:, frontier.depth]  # [B, D]
        b, f = frontier.tokens.shape
        parent = (jnp.zeros((b, f, self.hcfg.cell_width), out.dtype) if frontier.carry is None
                  else frontier.carry)
        own, hidden = self.clover_cell(parent, self.token_rows(base, frontier.tokens),
                                       jnp.broadcast_to(out[:, None], (b, f, out.shape[-1])))
        return self.scores(base, hidden, vocab), own, state

    def train_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """[K, B, T, V or N]: the cell stepped along each block, step k fed the data's token t + 1 + k (the
        chosen one before position k + 1) and the block's output out[k] [B, T, D]."""
        state = jnp.zeros(out.shape[1:-1] + (self.hcfg.cell_width,), out.dtype)
        hidden = []
        for k in range(out.shape[0]):
            state, h = self.clover_cell(state, self.token_rows(base, shift_left(tokens, k + 1)), out[k])
            hidden.append(h)
        return self.scores(base, jnp.stack(hidden), vocab)


register(Method("dflash_clover", DFlashCloverDrafter, DFlashCloverConfig, depth=15, tree="medusa_mc_sim_7b_63",
                loss=dflash_loss, title="DFlash + Clover cell"))
