"""Domino: DFlash's block drafter with a GRU correction of the block's logits by the tokens chosen
before each position (SpecForge 0.2.0, `modeling/draft/domino.py`, `DominoDraftModel`).

The block is DFlash's (`dflash.py`); block position n (1..b-1) has DFlash's logits u_n = lm_head(h_n)
of its normed output h_n. A GRU (`prefix_gru`: one layer, no biases, torch's gate order r, z, n) reads
the embeddings (the base model's `embed_tokens`) of the block's tokens from the root on, from a zero
state: s_j is its state after the tokens at positions 0..j. From position `suffix_start` = 1 +
`pure_draft_prefix_len` on, position n's logits are u_n + embed_proj([h_n; s_{n-1}]), embed_proj being
Linear(D + G -> `emb_dim`, no bias), SiLU, Linear(-> V, no bias); the positions before it keep DFlash's
(their "pure draft prefix"), though the GRU still reads their tokens. A node of depth d (the root at
0) so scores its children, at position d + 1, with the state after its own path; its state is handed
to its children as the Frontier's carry, kept per tree node: chains draft what their
`_sample_draft_tokens` draws greedily, and static, dynamic and EAGLE-2 trees draft from the same scores.

Their `shift_label` variant (position n drafting token n + 1, the root's output scoring the first draft)
reads the block one position earlier than DFlash's drafting here does, and is refused. Training scores
what drafting drafts, the data's tokens read by the GRU, under DFlash's loss (their trainer's with
`lambda_base` 0, its default).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.drafters.base import Frontier
from clover_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_loss
from clover_jax.drafters.losses import shift_left
from clover_jax.drafters.registry import Method, register
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.errors import CloverError
from clover_jax.model.layers import Linear, param, product
from clover_jax.model.llama import Llama


@dataclasses.dataclass(frozen=True)
class DominoConfig(DFlashConfig):
    """Domino's options beside DFlash's, as its dflash_config names them: `emb_dim` (embed_proj's
    width), `gru_hidden_dim` (G), `pure_draft_prefix_len` (block positions after the root left
    uncorrected) and `shift_label` (False only)."""

    emb_dim: int = 256
    gru_hidden_dim: int = 256
    pure_draft_prefix_len: int = 0
    shift_label: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name, least in (("emb_dim", 1), ("gru_hidden_dim", 1), ("pure_draft_prefix_len", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CloverError(f"{name}={value!r} must be an integer >= {least}")
        if self.shift_label is not False:
            raise CloverError(f"shift_label={self.shift_label!r}: only False is drafted here (block position n "
                              "drafting token n); shift_label=True reads the block one position earlier")


class GRU(nnx.Module):
    """torch's one-layer nn.GRU without biases, its tensors as torch stores them: weight_ih_l0 [3G, In],
    weight_hh_l0 [3G, G], each in the gate order r, z, n; s' = (1 - z) * n + z * s, with
    n = tanh(W_in x + r * W_hn s)."""

    def __init__(self, din: int, g: int, *, dtype, rngs: nnx.Rngs):
        self.weight_ih_l0 = param(0.02 * jax.random.normal(rngs.params(), (3 * g, din), dtype), (None, "embed"))
        self.weight_hh_l0 = param(0.02 * jax.random.normal(rngs.params(), (3 * g, g), dtype), (None, None))

    def __call__(self, x, s):
        """The state [..., G] after input x [..., In] from state s [..., G]."""
        s = s.astype(x.dtype)
        ri, zi, ni = jnp.split(product("...i,gi->...g", x, self.weight_ih_l0[...].astype(x.dtype)), 3, axis=-1)
        rh, zh, nh = jnp.split(product("...i,gi->...g", s, self.weight_hh_l0[...].astype(x.dtype)), 3, axis=-1)
        r, z = jax.nn.sigmoid(ri + rh), jax.nn.sigmoid(zi + zh)
        return (1.0 - z) * jnp.tanh(ni + r * nh) + z * s


class EmbedProj(nnx.Module):
    """Their embed_proj: Linear(D + G -> E), SiLU, Linear(E -> V), no biases (their `embed_proj.0`, `.2`)."""

    def __init__(self, din: int, e: int, v: int, *, dtype, rngs: nnx.Rngs):
        self.up = Linear(din, e, ("embed", None), dtype=dtype, rngs=rngs)
        self.out = Linear(e, v, (None, "vocab"), dtype=dtype, rngs=rngs)

    def __call__(self, x, vocab: DraftVocab | None = None):
        """[..., V] (or the draft vocabulary's [..., N]) in float32 of x [..., D + G]."""
        h = jax.nn.silu(self.up(x))
        kernel = self.out.kernel[...] if vocab is None else jnp.take(self.out.kernel[...], vocab.ids, axis=1)
        return jnp.einsum("...e,ev->...v", h, kernel.astype(h.dtype)).astype(jnp.float32)


class DominoDrafter(DFlashDrafter):
    """DFlash with Domino's GRU correction (`prefix_gru`, `embed_proj`; the module docstring)."""

    backbone = "dflash"  # its frozen part, for train.train --backbone: the parameters a dflash drafter has

    def __init__(self, hcfg: DominoConfig, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base, rngs=rngs)
        d, dtype = base.cfg.hidden_size, base.dtype
        self.prefix_gru = GRU(d, hcfg.gru_hidden_dim, dtype=dtype, rngs=rngs)
        self.embed_proj = EmbedProj(d + hcfg.gru_hidden_dim, hcfg.emb_dim, base.cfg.vocab_size, dtype=dtype, rngs=rngs)

    @property
    def suffix_start(self) -> int:
        """The first block position the GRU corrects."""
        return 1 + self.hcfg.pure_draft_prefix_len

    def corrected(self, base: Llama, out, tokens, state, position: int, vocab: DraftVocab | None = None):
        """(logits [..., F or 1, V or N], the states after tokens [..., F]) at block position `position`
        of outputs out [..., D], each node's state [..., F, G] (None: the root's zeros) reading its token."""
        e = jax.lax.stop_gradient(base.embed_tokens(tokens, out.dtype))  # [..., F, D]
        if state is None:
            state = jnp.zeros((*tokens.shape, self.hcfg.gru_hidden_dim), out.dtype)
        state = self.prefix_gru(e, state)
        logits = self.scores(base, out, vocab)[..., None, :]
        if position < self.suffix_start:  # shared by the level's nodes ([..., 1, V])
            return logits, state
        h = jnp.broadcast_to(out[..., None, :], (*state.shape[:-1], out.shape[-1]))
        return logits + self.embed_proj(jnp.concatenate([h, state.astype(h.dtype)], -1), vocab), state

    def expand(self, base: Llama, state, frontier: Frontier, vocab: DraftVocab | None = None):
        """The root runs the block; each node of depth d scores its children at block position d + 1
        with its own GRU state ([B, F, V]; [B, 1, V] before suffix_start), which it hands down."""
        if frontier.depth == 0:
            state = state.replace(block=self.run_block(base, state.cache, frontier.tokens[:, 0]))
        logits, carry = self.corrected(base, state.block[:, frontier.depth], frontier.tokens, frontier.carry,
                                       frontier.depth + 1, vocab)
        return logits, carry, state

    def train_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """[K, B, T, V or N]: position k + 1's corrected logits, the GRU having read the data's tokens
        t + 1 .. t + 1 + k of the block rooted at t + 1."""
        steps, state = [], None
        for k in range(out.shape[0]):
            logits, state = self.corrected(base, out[k], shift_left(tokens, k + 1)[..., None], state, k + 1, vocab)
            steps.append(logits[..., 0, :])
        return jnp.stack(steps)


register(Method("domino", DominoDrafter, DominoConfig, depth=15, tree="medusa_mc_sim_7b_63", loss=dflash_loss,
                title="Domino"))
