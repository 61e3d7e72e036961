"""DSpark: DFlash's block drafter with a Markov head, a regressive correction of the block's logits by
the token chosen at the previous position (SpecForge 0.2.0, `modeling/draft/dspark.py`,
`DSparkDraftModel`, its heads built by `build_markov_head`).

The block is DFlash's (`dflash.py`). Block position k (1..b-1) has DFlash's logits u_k = lm_head(h_k)
of its normed output h_k; the head adds a bias of the previous position's token x_{k-1} (the root at
k = 1), e = markov_w1[x_{k-1}] [R]:
- `vanilla`: bias = markov_w2(e);
- `gated`: bias = markov_w2(sigmoid(gate_proj([h_k; e])) * e);
- `rnn`: a state s [R] along the block, s_0 = 0; gate, candidate, output = joint_proj([s; e; h_k]) (thirds),
  s' = sigmoid(gate) * s + (1 - sigmoid(gate)) * tanh(candidate), bias = markov_w2(tanh(output)).
A node's children therefore depend on its own token (and, for `rnn`, on its ancestors' through s), so
`expand` gives each node its own logits and, for `rnn`, hands its s' to its children as the Frontier's
carry: a node's state is a function of its path, kept per tree node. Chains draft what their
`sample_block_tokens` draws greedily; static, dynamic and EAGLE-2 trees draft from the same scores.

Their `AcceptRatePredictor` (the confidence head) only predicts the chance a draft is accepted, for
their confidence-based stopping and its loss; it never changes the logits, so it is not here. Their
trainer (`OnlineDSparkModel`) pairs block position n's output with token n as the predecessor and
token n + 1 as the label, where their drafting (`_sample_draft_tokens`) pairs it with token n - 1 and
drafts token n; here training scores what drafting drafts:
entry [k, :, t] is block position k + 1 with the data's token t + 1 + k as its predecessor, under
DFlash's loss.
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
from clover_jax.model.layers import Linear, param
from clover_jax.model.llama import Llama

MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DSpark's options beside DFlash's, as its dspark_config names them: `markov_head_type` (vanilla,
    gated or rnn) and `markov_rank` (R, the head's width; their 0, no head, is DFlash itself)."""

    markov_head_type: str = "vanilla"
    markov_rank: int = 64

    def __post_init__(self):
        super().__post_init__()
        kind = self.markov_head_type
        if not isinstance(kind, str) or kind.lower() not in MARKOV_HEADS:
            raise CloverError(f"markov_head_type={kind!r} must be one of {', '.join(MARKOV_HEADS)}")
        object.__setattr__(self, "markov_head_type", kind.lower())
        rank = self.markov_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise CloverError(f"markov_rank={rank!r} must be an integer >= 1 (0, no Markov head, is --method dflash)")


class MarkovHead(nnx.Module):
    """Their VanillaMarkovHead, GatedMarkovHead or RNNMarkovHead (`kind`): markov_w1 [V, R] (an
    embedding), markov_w2 R -> V (no bias), gated's gate_proj [D; R] -> R and rnn's joint_proj
    [R; R; D] -> 3R (with biases)."""

    def __init__(self, kind: str, v: int, d: int, rank: int, *, dtype, rngs: nnx.Rngs):
        self.kind, self.rank = kind, rank
        self.markov_w1 = param(0.02 * jax.random.normal(rngs.params(), (v, rank), dtype), ("vocab", None))
        self.markov_w2 = Linear(rank, v, (None, "vocab"), dtype=dtype, rngs=rngs)
        if kind == "gated":
            self.gate_proj = Linear(d + rank, rank, ("embed", None), bias=True, dtype=dtype, rngs=rngs)
        if kind == "rnn":
            self.joint_proj = Linear(2 * rank + d, 3 * rank, ("embed", None), bias=True, dtype=dtype, rngs=rngs)

    def project(self, latent, vocab: DraftVocab | None = None) -> jax.Array:
        """markov_w2(latent) [..., V], or its columns of the draft vocabulary [..., N], in float32."""
        kernel = self.markov_w2.kernel[...]
        if vocab is not None:
            kernel = jnp.take(kernel, vocab.ids, axis=1)
        return jnp.einsum("...r,rv->...v", latent, kernel.astype(latent.dtype)).astype(jnp.float32)

    def step(self, tokens, hidden, state, vocab: DraftVocab | None = None):
        """(bias [..., F, V or N], the next state [..., F, R] or None) for predecessors tokens [..., F],
        the position's output hidden [..., D] and the state [..., F, R] (rnn; None: zeros)."""
        e = jnp.take(self.markov_w1[...], tokens, axis=0)  # [..., F, R]
        h = jnp.broadcast_to(hidden[..., None, :].astype(e.dtype), (*e.shape[:-1], hidden.shape[-1]))
        if self.kind == "vanilla":
            return self.project(e, vocab), None
        if self.kind == "gated":
            return self.project(jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, e], -1))) * e, vocab), None
        s = jnp.zeros_like(e) if state is None else state.astype(e.dtype)
        gate, candidate, output = jnp.split(self.joint_proj(jnp.concatenate([s, e, h], -1)), 3, axis=-1)
        gate = jax.nn.sigmoid(gate)
        return self.project(jnp.tanh(output), vocab), gate * s + (1.0 - gate) * jnp.tanh(candidate)


class DSparkDrafter(DFlashDrafter):
    """DFlash with a Markov head (`markov_head`, the module docstring)."""

    backbone = "dflash"  # its frozen part, for train.train --backbone: the parameters a dflash drafter has

    def __init__(self, hcfg: DSparkConfig, base: Llama, *, rngs: nnx.Rngs):
        super().__init__(hcfg, base, rngs=rngs)
        self.markov_head = MarkovHead(hcfg.markov_head_type, base.cfg.vocab_size, base.cfg.hidden_size,
                                      hcfg.markov_rank, dtype=base.dtype, rngs=rngs)

    def expand(self, base: Llama, state, frontier: Frontier, vocab: DraftVocab | None = None):
        """The root runs the block; each node of depth d scores its children at block position d + 1,
        DFlash's logits plus its own token's bias ([B, F, V]); an rnn head hands its state down."""
        if frontier.depth == 0:
            state = state.replace(block=self.run_block(base, state.cache, frontier.tokens[:, 0]))
        out = state.block[:, frontier.depth]  # [B, D]
        bias, carry = self.markov_head.step(frontier.tokens, out, frontier.carry, vocab)
        return self.scores(base, out, vocab)[:, None, :] + bias, carry, state

    def train_logits(self, base: Llama, out, tokens, vocab: DraftVocab | None = None):
        """[K, B, T, V or N]: position k + 1's logits plus the head's bias of the data's token t + 1 + k,
        the rnn state carried along each block from its root."""
        unary = self.scores(base, out, vocab)
        biases, state = [], None
        for k in range(out.shape[0]):
            parents = shift_left(tokens, k + 1)[..., None]  # [B, T, 1]
            bias, state = self.markov_head.step(parents, out[k], state, vocab)
            biases.append(bias[..., 0, :])
        return unary + jnp.stack(biases)


register(Method("dspark", DSparkDrafter, DSparkConfig, depth=15, tree="medusa_mc_sim_7b_63", loss=dflash_loss,
                title="DSpark"))
