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
its own. Training: the method's registry entry names the loss (`methods.Method.loss`); `loss_vocab`
says which tokens that loss scores (a training run may restrict it to the most frequent ones, as
decoding does).
"""

from __future__ import annotations

import flax.struct
import jax


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
    Clover-2 and a test implements it with a draft layer of its own."""

    feature_layers: tuple[int, ...] = ()

    @property
    def num_heads(self) -> int:
        """The deepest tree this drafter drafts."""
        raise NotImplementedError

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

    def loss_vocab(self, base, vocab):
        """The vocabulary training scores this drafter over (a `draft_vocab.DraftVocab`, or None for the
        whole one): the one the run asked for, unless the drafter has one of its own."""
        return vocab
