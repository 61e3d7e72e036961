"""The speculative step and loop: draft a tree, verify it in one base forward, accept, compact.

One step, all static shapes (N tree nodes, depth D, B sequences):
1. draft: the drafter expands the tree level by level (`drafting.draft_tree`, static or dynamic
   trees alike), giving the N tree tokens and the step's topology (`StepTree`);
2. verify: the N tree tokens go through the base model at positions `length + depth`, reading the
   cached prefix and their own ancestors (ancestor mask); their K/V land in slots length .. length+N-1;
3. accept (greedy): a node is accepted when every token on its path equals the base model's argmax at
   its parent; keep the deepest, plus the bonus token the base model predicts there;
4. compact: the accepted path's K/V move to contiguous slots; the drafter commits the newly committed
   positions (`Drafter.commit`: Clover's Augmenting Block runs over them only, so its cache never holds
   rejected tokens).
Each sequence accepts its own number of tokens; the loop stops per sequence at EOS or its budget.

Pacing (`pacing`): given a step cost, where a speculative step costs more than a plain one (a CPU),
the loop takes plain steps while the drafts accepted lately do not pay for it. The pacer owns those
steps and runs the loop; the step above only reports the drafts it accepted. Without a step cost every
step drafts, and the program holds nothing of pacing.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.model.cache import KVCache, tree_mask
from clover_jax.engine.decode import DecodeState, Generator, prefill, stream_tokens, to_host
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.drafters.base import Committed, Drafter
from clover_jax.engine import pacing
from clover_jax.engine.drafting import StepTree, draft_tree, path_to
from clover_jax.errors import CloverError
from clover_jax.model.llama import Llama
from clover_jax.engine.sampling import BONUS, ACCEPT, SamplingConfig, distribution, draw, sample, step_keys, use_keys
from clover_jax.model.sharding import shard_module
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.static import Tree


class SpecGraph(NamedTuple):
    """The static halves (`nnx.split`) of what a speculative program runs."""

    base: object
    drafter: object


class SpecParams(NamedTuple):
    """The arrays a speculative program runs on: the base model's and the drafter's parameters, and the
    draft vocabulary (None: the drafter scores the whole vocabulary)."""

    base: object
    drafter: object
    vocab: DraftVocab | None


@flax.struct.dataclass
class SpecState:
    """What the speculative loop carries from one step to the next (the while_loop's state)."""

    plain: DecodeState  # tokens [B, M + D + 1] (a step may overshoot M; trimmed on the host); `last` is
    # the tree's root: the base model's next token, emitted but not yet in the cache
    draft: object  # the drafter's own state (`Drafter.init`)
    accept_hist: jax.Array  # [B, D + 1] speculative steps that accepted d drafted tokens, per sequence
    node_hits: jax.Array | None  # [B, N] speculative steps whose accepted path holds node i (static trees)
    pace: pacing.Pace | None  # the pacer's state; None: every step drafts

    def masked(self, go: jax.Array, step) -> "SpecState":
        """`step(self)` where `go` [] holds, else one that appends nothing (`DecodeState.masked`): every
        sequence is done in it, and the histograms count live sequences only."""
        after = step(self.replace(plain=self.plain.paused(go)))
        return after.replace(plain=after.plain.resumed(self.plain, go))

    @property
    def plain_steps(self) -> jax.Array:
        """[B] steps each sequence took without drafting (pacing's); zero when every step drafts."""
        return jnp.zeros_like(self.plain.num_new) if self.pace is None else self.pace.plain_steps


def accept_greedy(st: StepTree, tokens: jax.Array, logits: jax.Array, max_depth: int):
    """(best node [B], bonus token [B], path [B, D+1] node indices root..best, padded with best).

    A node is accepted when each node on its path holds the base model's argmax at its parent."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
    at_parent = jnp.take_along_axis(target, jnp.broadcast_to(jnp.maximum(st.parents, 0), target.shape), 1)
    match = ((tokens == at_parent) & st.valid).at[:, 0].set(True)
    accepted = jnp.all(jnp.where(st.ancestors, match[:, None, :], True), axis=-1)  # [B, N]
    best = jnp.argmax(jnp.where(accepted, st.depth + 1, 0), axis=-1)
    bonus = jnp.take_along_axis(target, best[:, None], axis=1)[:, 0]
    return best, bonus, path_to(st, best, max_depth)


def _normalise(x: jax.Array, fallback: jax.Array) -> jax.Array:
    total = x.sum(-1, keepdims=True)
    return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), fallback)


def accept_probability(p_token: jax.Array, q_token: jax.Array) -> jax.Array:
    """The chance a drafted token is kept: min(1, p/q) (speculative sampling's rule)."""
    return jnp.minimum(1.0, p_token / q_token)

def accept_sample(st: StepTree, tokens: jax.Array, logits: jax.Array, sampling: SamplingConfig, key: jax.Array,
                  ranks, draws=None):
    """Speculative sampling on a tree; returns what `accept_greedy` returns, and the emitted tokens have
    exactly the distribution plain sampling under `sampling` gives.

    From the root, depth by depth: the current node's children are tested in order; child c is kept
    with probability min(1, p(c)/q(c)), p the base model's distribution at the node and q the one c was
    drawn from (`draws` [B, N, V] at the node, children drawn without replacement in test order). On a rejection p
    becomes the residual max(p - q, 0) renormalised and q loses c (renormalised: the next child was
    drawn without it). Without `draws` (a dynamic tree, whose children are chosen, not drawn) each child
    is tested as a draw from a point mass on itself: kept with probability p(c), else removed from p,
    which is sequential sampling from p whatever chose the children. A kept child becomes the current
    node, with p its own base distribution; when no child is kept (or at a leaf) the walk stops and the
    bonus token is drawn from p, residual included. ranks[d-1]: children tested at depth d at most."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    take = lambda x, idx: x[rows, idx]
    uniform = lambda d, r: jax.vmap(jax.random.uniform)(use_keys(key, ACCEPT, d, r))
    cur = jnp.zeros((b,), jnp.int32)
    p = distribution(logits[:, 0], sampling)
    active = jnp.ones((b,), bool)
    for d in range(1, len(ranks) + 1):
        q = None if draws is None else draws[rows, cur]  # [B, V]
        moved = jnp.zeros((b,), bool)
        nxt = cur
        for r in range(ranks[d - 1]):
            child = st.at(st.children, cur)[:, r]  # -1: cur has fewer children
            tok = take(tokens, jnp.maximum(child, 0))
            q_tok = jnp.ones((b,)) if q is None else take(q, tok)
            test = active & ~moved & (child >= 0) & (q_tok > 0)
            keep = test & (uniform(d, r) < accept_probability(take(p, tok), q_tok))
            nxt = jnp.where(keep, child, nxt)
            moved = moved | keep
            reject = (test & ~keep)[:, None]
            drawn_from = jax.nn.one_hot(tok, p.shape[-1], dtype=p.dtype) if q is None else q
            p = jnp.where(reject, _normalise(jnp.maximum(p - drawn_from, 0.0), p), p)
            if q is not None:
                q = jnp.where(reject, _normalise(q.at[rows, tok].set(0.0), jnp.zeros_like(q)), q)
        p = jnp.where(moved[:, None], distribution(take(logits, nxt), sampling), p)
        cur, active = nxt, active & moved
    return cur, draw(p, use_keys(key, BONUS)), path_to(st, cur, len(ranks))


def compact(cache: KVCache, path: jax.Array) -> KVCache:
    """Move the K/V of tree slots `length + path[b, d]` to slots `length + d` (the accepted path)."""
    src = cache.lengths[:, None] + path  # [B, D+1]

    def move(buf):  # [B, K, S, H]
        gathered = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)
        put = lambda b_buf, g, start: jax.lax.dynamic_update_slice(b_buf, g, (0, start, 0))
        return jax.vmap(put)(buf, gathered, cache.lengths)

    return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def generate_speculative(graphdefs: SpecGraph, params: SpecParams, prompts, prompt_lens, budgets, keys, *,
                         tree: Tree | DynamicTree, sampling: SamplingConfig, eos_ids: tuple[int, ...], max_new: int,
                         cache_len: int, mesh=None, stream=None, step_cost: float | None = None,
                         loop_chunk: int = 1) -> SpecState:
    """Speculative generation as one pure function (jit with the keyword args static); stream: a host
    callback given the tokens after each step (`decode.stream_tokens`); step_cost: a speculative step's
    cost in plain steps, to pace drafting by (`pacing`), or None to draft at every step; loop_chunk: steps
    per chunk of the loop (`chunks.chunked`)."""
    base = nnx.merge(graphdefs.base, params.base)
    drafter: Drafter = nnx.merge(graphdefs.drafter, params.drafter)
    pacer = pacing.pacer(step_cost, base, drafter, sampling=sampling, cache_len=cache_len, chunk=loop_chunk)
    b, depth = prompts.shape[0], tree.max_depth
    rows = jnp.arange(b)
    layers = drafter.feature_layers
    out, logits = prefill(base, prompts, prompt_lens, cache_len, mesh, layers)
    root = sample(logits, step_keys(keys, 0), sampling)
    # The drafter's context over the prompt: position t is paired with token t+1 (the root for the last).
    following = jnp.concatenate([prompts[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    following = following.at[rows, prompt_lens - 1].set(root)
    prompt = Committed(out.hidden, out.hidden_normed, following, out.features)
    draft = drafter.init(base, b, cache_len, mesh)
    draft = drafter.commit(base, draft, prompt, prompt_lens, jnp.ones((b,), bool))
    plain = DecodeState(
        cache=out.cache, tokens=jnp.zeros((b, max_new + depth + 1), jnp.int32), num_new=jnp.zeros((b,), jnp.int32),
        last=root, done=budgets <= 0, finite=jnp.isfinite(logits).all(-1), keys=keys, step=jnp.zeros((), jnp.int32))
    state = SpecState(plain=plain.append(root[:, None], jnp.ones((b,), jnp.int32), budgets, eos_ids), draft=draft,
                      accept_hist=jnp.zeros((b, depth + 1), jnp.int32),
                      node_hits=None if isinstance(tree, DynamicTree) else jnp.zeros((b, tree.num_nodes), jnp.int32),
                      pace=pacer.start(prompt))
    ranks = (tree.beam,) * depth if isinstance(tree, DynamicTree) else tree.max_rank

    def cond(s: SpecState):
        return (s.plain.step < max_new) & ~jnp.all(s.plain.done)

    def advance(s: SpecState, cache: KVCache, bonus, emitted, count, logits) -> SpecState:
        """Record a step whose K/V sit at the cache's first `count` [B] new slots, which emits count
        tokens `emitted` [B, P] (the accepted drafts, then the `bonus` token, the next root), `logits`
        [B, V] its bonus token's; the step's last act, so the tokens are streamed here."""
        p = s.plain
        live = ~p.done
        p = p.replace(cache=cache.advance(jnp.where(live, count, 0)), last=jnp.where(live, bonus, p.last),
                      step=p.step + 1, finite=p.finite & (jnp.isfinite(logits).all(-1) | p.done))
        s = s.replace(plain=p.append(emitted, count, budgets, eos_ids))
        stream_tokens(stream, s.plain, mesh, jnp.any(live))
        return s

    def speculative_step(s: SpecState) -> SpecState:
        p = s.plain
        key = step_keys(p.keys, p.step + 1)
        c = p.cache
        drafted, draft = draft_tree(base, drafter, s.draft, tree, p.last, c.lengths, sampling, key, params.vocab)
        tokens, st = drafted.tokens, drafted.tree
        out = base(tokens, c.lengths[:, None] + st.depth, tree_mask(c.lengths, st.ancestors, cache_len), c,
                   feature_layers=layers)
        if sampling.greedy:
            best, bonus, path = accept_greedy(st, tokens, out.logits, depth)
        else:
            best, bonus, path = accept_sample(st, tokens, out.logits, sampling, key, ranks, drafted.draws)
        accepted = st.at(st.depth, best)  # drafted tokens accepted, per sequence
        count = accepted + 1  # tokens committed to the cache (root + accepted) = tokens emitted
        live = ~p.done
        path_tokens = jnp.take_along_axis(tokens, path, axis=1)  # [B, D+1]
        emitted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = emitted.at[rows, accepted].set(bonus)  # accepted drafts, then the bonus
        on_path = lambda x: None if x is None else jnp.take_along_axis(x, path.reshape(b, -1, *(1,) * (x.ndim - 2)), 1)
        new = Committed(on_path(out.hidden), on_path(out.hidden_normed), emitted, on_path(out.features))
        hist = s.accept_hist + jax.nn.one_hot(accepted, depth + 1, dtype=jnp.int32) * live[:, None]
        if s.node_hits is not None:  # the accepted path's nodes, root included
            s = s.replace(node_hits=s.node_hits + (st.at(st.ancestors, best) & live[:, None]).astype(jnp.int32))
        s = s.replace(draft=drafter.commit(base, draft, new, count, live), accept_hist=hist,
                      pace=pacer.update(s.pace, accepted, live))
        path_logits = jnp.take_along_axis(out.logits, best[:, None, None], axis=1)[:, 0]
        return advance(s, compact(out.cache, path), bonus, emitted, count, path_logits)

    return pacer.loop(cond, speculative_step, advance, state)


class SpeculativeGenerator(Generator):
    """`Generator` with a drafter (draft heads) and a static or dynamic tree; greedy decoding or lossless
    speculative sampling; the drafter scores the whole vocabulary or a draft vocabulary
    (`draft_vocab.DraftVocab`)."""

    def __init__(self, model: Llama, drafter: Drafter, tree: Tree | DynamicTree, *,
                 draft_vocab: DraftVocab | None = None, step_cost: float | None = None, **kwargs):
        super().__init__(model, **kwargs)
        if step_cost is not None and not step_cost > 0:
            raise CloverError(f"step cost {step_cost} must be a positive number of plain steps (or none)")
        self.step_cost = step_cost
        draft_vocab = drafter.drafting_vocab(model, draft_vocab)
        if self.mesh is not None:
            shard_module(drafter, self.mesh)
            if draft_vocab is not None:
                draft_vocab = draft_vocab.on_mesh(self.mesh)
        if tree.max_depth > drafter.num_heads and not drafter.chained:
            raise CloverError(f"tree depth {tree.max_depth} exceeds the {drafter.num_heads} draft heads; "
                              "pick a shallower tree")
        self.drafter = drafter
        self.tree = tree
        self.draft_vocab = draft_vocab
        drafter_graphdef, drafter_params = nnx.split(drafter)
        self.graphdef = SpecGraph(self.graphdef, drafter_graphdef)
        self.params = SpecParams(self.params, drafter_params, draft_vocab)

    def _program(self):
        return generate_speculative

    def _static(self) -> dict:
        return {"tree": self.tree, "step_cost": self.step_cost}

    def _slack(self) -> int:
        # The tree's N slots, or the drafter's draft slots when it drafts more (a dynamic tree's beam).
        return max(self.tree.num_nodes, self.tree.draft_slots) + self.tree.max_depth + 1

    def statistics(self, state: SpecState):
        num, hist = to_host(state.plain.num_new), to_host(state.accept_hist)
        hits = None if state.node_hits is None else to_host(state.node_hits)
        plain = 0 if state.pace is None else to_host(state.pace.plain_steps)
        # The prefill's forward pass yields each sequence's first token; paced plain steps one each.
        return state.plain, np.where(num > 0, hist.sum(-1) + plain + 1, 0), hist, hits
