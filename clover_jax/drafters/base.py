"""The drafting interface every method implements: a drafter that owns its state.

The engine talks to a drafter through three calls and two small structures:
- `init(base, batch, cache_len, mesh) -> state`: the drafter's state for a batch (any pytree: a KV
  cache of its own, the context at the last committed position, ...);
- `commit(base, state, new: Committed, count, live) -> state`, after the prefill and after every
  verification: the base model's states at the T newly committed positions (the first count[b] of
  them are real) and the token that follows each; sequences with live[b] False must not move;
- `expand(base, state, frontier: Frontier, vocab) -> (logits, carry, state)`: logits [B, F, V] (or
  [B, 1, V] when the nodes of a depth share them) over the children of each of the F nodes of one
  tree level, and what each node hands its children (`carry`, any pytree with leading [B, F], or None).
The tree driver (`drafting.draft_tree`) calls `expand` depth by depth for static, dynamic and EAGLE-2
trees alike; verification, acceptance and the loop never look inside the state. A drafter with a KV
cache of its own (EAGLE's draft layer) writes each frontier node at slot length + `frontier.slots` and
reads the committed prefix plus `frontier.ancestors`, the mask verification uses; heads that need
neither (Medusa, Clover) ignore them. `feature_layers` names the base layers whose outputs (from the
same forward pass) reach `commit` as `Committed.features`: EAGLE-3's low, middle and high ones.
A draft vocabulary (`draft_vocab.DraftVocab`) reaches `expand` as `drafting_vocab` made it from the one
the engine picked: the base model's lm_head rows of those tokens, unless the drafter scores with rows of
its own.

Training needs two more calls, the same for heads and draft models, so no tool asks which method it runs:
- `train_forward(base, tokens, hidden, hidden_normed, features, vocab, key, steps) -> (hidden, logits)`:
  teacher-forced drafts at every position of the training windows, [K, B, T, D] and [K, B, T, V or N],
  entry [k, :, t] drafting token t+2+k; the method's loss (its registry entry's `Method.loss`, defined
  beside the drafter; `losses` has the signature) reads them;
- `loss_vocab(base, vocab)`: which tokens that loss scores (a run may restrict it to the most frequent
  ones, as decoding does), unless the drafter has a vocabulary of its own (`own_vocab`, EAGLE-3's,
  picked with `set_vocab`).
`depth` is the deepest tree a drafter drafts (its head count, a draft model's chained steps); heads.json
and --num-heads still call it num_heads. Saved with the weights: the variables of the types in `SAVED`.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
from flax import nnx

from clover_jax.errors import CloverError


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Which drafter (method, depth): the fields every method has. Each method subclasses it with the
    options it has, each checked in its own `__post_init__` (which calls this one), and registers the
    class as its `registry.Method.config`; saved beside the weights in heads.json, built by
    `registry.drafter_config`."""

    method: str  # a `registry` name
    num_heads: int  # the drafter's depth (heads.json's name for it)

    def __post_init__(self):
        if not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise CloverError(f"num_heads={self.num_heads!r} must be an integer >= 1")


class DraftIds(nnx.Variable):
    """Token ids a drafter's own lm_head scores (not trained; saved with the parameters): EAGLE-3's."""


SAVED = (nnx.Param, DraftIds)  # the variable types a drafter's weights file holds


@flax.struct.dataclass
class Committed:
    """What the base model computed at T newly committed positions of each sequence."""

    hidden: jax.Array  # [B, T, D] last layer's output, before the final norm
    hidden_normed: jax.Array  # [B, T, D] after the final norm
    tokens: jax.Array  # [B, T] the token that follows each position (the next root for the last one)
    features: jax.Array | None = None  # [B, T, F, D] outputs of the drafter's `feature_layers`


@flax.struct.dataclass
class Frontier:
    """The F nodes of one draft-tree level, per sequence; the slot space of one step has S slots."""

    tokens: jax.Array  # [B, F] int32 the token each node holds
    parents: jax.Array  # [B, F] int32 each node's index in the previous level's frontier (0 at the root)
    slots: jax.Array  # [B, F] int32 each node's draft slot in [0, S) (0: the root)
    ancestors: jax.Array  # [B|1, F, S] bool: the node's own slot and its ancestors'
    positions: jax.Array  # [B, F] int32 sequence position: committed length + depth
    carry: object  # what the parents handed down (`expand`'s carry gathered by `parents`); None at the root
    depth: int = flax.struct.field(pytree_node=False, default=0)  # the level's depth (0: the root)


class Drafter:
    """The interface (see the module docstring); `heads.Heads` implements it for Medusa, Clover and
    Clover-2, `draft_model.EagleDrafter` for EAGLE-1 and EAGLE-3."""

    hcfg: DrafterConfig  # its method's own config class
    feature_layers: tuple[int, ...] = ()
    # True for a draft model that chains one layer, and so drafts trees deeper than `depth` (its trained
    # steps): EAGLE-3's authors draft 8 deep with 7. Heads stop at their own count.
    chained = False
    own_vocab = False  # True: it scores with an lm_head of its own over token ids of its own (`set_vocab`)

    @property
    def depth(self) -> int:
        """The deepest tree this drafter drafts: its number of heads, or a draft model's chained steps."""
        raise NotImplementedError

    @property
    def num_heads(self) -> int:
        """`depth`, under the name heads.json, --num-heads and the engine use."""
        return self.depth

    def init(self, base, batch: int, cache_len: int, mesh=None):
        raise NotImplementedError

    def commit(self, base, state, new: Committed, count: jax.Array, live: jax.Array):
        raise NotImplementedError

    def expand(self, base, state, frontier: Frontier, vocab=None):
        raise NotImplementedError

    def drafting_vocab(self, base, vocab):
        """The draft vocabulary `expand` receives when the engine picked `vocab` (None: the whole
        vocabulary), made once before decoding: by default `vocab` itself."""
        return vocab

    def train_forward(self, base, tokens, hidden, hidden_normed, features=None, vocab=None, key=None,
                      steps: int | None = None):
        """Training's drafts, teacher-forced at every position of windows tokens [B, T] from the frozen
        base model's states there: hidden [B, T, D] (before the final norm), hidden_normed [B, T, D]
        and the outputs of `feature_layers`, features [B, T, F, D] (None without). Returns (hidden
        [K, B, T, D], logits [K, B, T, V], or [.., N] over `vocab`, `loss_vocab`'s), entry [k, :, t]
        being depth k of the chain whose root is token t+1: the vector that scores token t+2+k and its
        logits. `key`: a training step's randomness (None in evaluation); `steps`: only the first
        K = steps depths (None: all `depth`), since the loss weights no other."""
        raise NotImplementedError

    def drafted_logits(self, base, hidden, logits, vocab=None):
        """What decoding would draft from at `train_forward`'s entries (its hidden and logits): the logits
        themselves, unless decoding scores fewer tokens than training does. Evaluation's accuracies, ranks
        and sampled acceptance read these, so what it replays is what decoding drafts."""
        return logits

    def loss_vocab(self, base, vocab):
        """The vocabulary training scores this drafter over (a `draft_vocab.DraftVocab`, or None for the
        whole one): the one the run asked for, unless the drafter has one of its own."""
        return vocab

    def set_vocab(self, base, ids) -> None:
        """Score token ids [N] (ascending) with an lm_head of its own; only where `own_vocab`."""
        raise CloverError(f"{type(self).__name__} drafts from the base model's lm_head: no vocabulary of its own")
