"""Pacing: plain steps while the drafts accepted do not pay for a speculative step's cost.

Where a speculative step costs more than a plain one (a CPU, where each verified row costs compute),
drafting pays only while enough drafts are accepted. Given that cost (`step_cost`, in plain steps), the
loop keeps a running mean of the drafts accepted per speculative step and takes a plain step (the root
alone: one row, no drafting) whenever 1 + that mean falls short of the cost, with a speculative step
(a probe) after PROBE_EVERY plain steps to see whether drafts pay again. Each probe that does not pay
doubles the plain steps before the next, up to MAX_WAIT; a speculative step that pays brings them back
to PROBE_EVERY. The choice depends only on earlier steps, so each step's token keeps plain decoding's
distribution either way. A plain step costs what plain decoding's does: what it commits waits
(`Pace.pending`, PROBE_EVERY rows) and reaches the drafter in one `commit` every PROBE_EVERY plain
steps and at the end of each run of them.

The speculative loop (`speculative.generate_speculative`) sees a pacer through three calls: `start`
(its state, `Pace`, or None), `update` (after each speculative step, with the drafts it accepted) and
`loop` (runs the steps). `Unpaced` drafts at every step and puts nothing in the program; `Paced` owns
the plain step and the two inner loops. The loop's state is `speculative.SpecState`: a pacer reads and
replaces its `plain` (`decode.DecodeState`), `draft` (the drafter's state) and `pace` fields only.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from clover_jax.drafters.base import Committed, Drafter
from clover_jax.engine.chunks import chunked
from clover_jax.engine.sampling import BONUS, SamplingConfig, sample, step_keys, use_keys
from clover_jax.model.cache import causal_mask
from clover_jax.model.llama import Llama

# The running mean's weight on the newest speculative step; the plain steps before the first probe of a
# run of them, and the most they double to while probes keep failing. A probe that does not pay costs
# (step_cost - 1) plain steps, and a CPU's chain step costs 1.3-5.5 plain steps (`plan.auto`): where
# nothing is accepted (sampling with weak heads), one probe in 9 costs 3-50% of plain decoding's time,
# one in 65 0.5-7%, while a lull in drafts that pay (greedy) still ends within 8 plain steps.
GAIN_WEIGHT = 0.25
PROBE_EVERY = 8
MAX_WAIT = 64


@flax.struct.dataclass
class Pace:
    """What a paced loop carries besides the speculative state (B sequences)."""

    gain: jax.Array  # [] running mean of drafted tokens accepted per speculative step
    idle: jax.Array  # [] plain steps since the last speculative one
    wait: jax.Array  # [] plain steps before the next probe: PROBE_EVERY, doubled by each failed probe
    plain_steps: jax.Array  # [B] steps a sequence took without drafting
    pending: Committed  # [B, PROBE_EVERY, ...] what plain steps committed since the last flush
    pending_n: jax.Array  # [B] how many of those each sequence holds


def speculate_now(pace: Pace, step_cost: float) -> jax.Array:
    """Whether the next step of a paced loop drafts: while the drafts' recent acceptance pays for the
    step cost, or to probe after `pace.wait` plain steps."""
    return (1.0 + pace.gain >= step_cost) | (pace.idle >= pace.wait)


class Unpaced:
    """Drafting at every step: no state, and nothing of pacing in the program; the steps are taken
    `chunk` at a time, masked past the loop's end (`chunks.chunked`)."""

    def __init__(self, chunk: int = 1):
        self.chunk = chunk

    def start(self, like: Committed) -> None:
        return None

    def update(self, pace: None, accepted: jax.Array, live: jax.Array) -> None:
        return pace

    def loop(self, cond: Callable, speculative_step: Callable, advance: Callable, state):
        return chunked(cond, speculative_step, state, self.chunk, lambda s, go, step: s.masked(go, step))


class Paced:
    """Drafting only while it pays for `step_cost` (the module docstring), plain steps otherwise.

    `advance(s, cache, bonus, emitted, count, logits)` records a step of either kind (the speculative
    loop's own): here, one plain step's token and K/V. Each run of steps is taken `chunk` steps at a time,
    a step past the run's end skipped by a `lax.cond` (`chunks.chunked`): a run often lasts a step or
    two, and a masked step would cost a whole one."""

    def __init__(self, step_cost: float, base: Llama, drafter: Drafter, *, sampling: SamplingConfig,
                 cache_len: int, chunk: int = 1):
        self.step_cost = step_cost
        self.chunk = chunk
        self.base = base
        self.drafter = drafter
        self.sampling = sampling
        self.cache_len = cache_len

    def start(self, like: Committed) -> Pace:
        """The state before the first step: drafting, with empty `pending` slots shaped like `like`
        (the prompt's commit, [B, P, ...])."""
        b = like.tokens.shape[0]
        slots = lambda x: None if x is None else jnp.zeros((b, PROBE_EVERY, *x.shape[2:]), x.dtype)
        return Pace(gain=jnp.asarray(self.step_cost - 1.0, jnp.float32), idle=jnp.zeros((), jnp.int32),
                    wait=jnp.asarray(PROBE_EVERY, jnp.int32),
                    plain_steps=jnp.zeros((b,), jnp.int32),
                    pending=Committed(slots(like.hidden), slots(like.hidden_normed), slots(like.tokens),
                                      slots(like.features)),
                    pending_n=jnp.zeros((b,), jnp.int32))

    def update(self, pace: Pace, accepted: jax.Array, live: jax.Array) -> Pace:
        """After a speculative step that accepted `accepted` [B] drafts in the `live` [B] sequences: a
        step after plain ones was a probe, and if drafting does not pay still, the next waits twice as long."""
        mean = jnp.sum(jnp.where(live, accepted, 0)) / jnp.maximum(jnp.sum(live), 1)
        gain = (1 - GAIN_WEIGHT) * pace.gain + GAIN_WEIGHT * mean
        failed_probe = pace.idle > 0
        wait = jnp.where(1.0 + gain >= self.step_cost, PROBE_EVERY,
                         jnp.where(failed_probe, jnp.minimum(2 * pace.wait, MAX_WAIT), pace.wait))
        return pace.replace(gain=gain, idle=jnp.zeros((), jnp.int32), wait=wait.astype(jnp.int32))

    def plain_step(self, s, advance: Callable):
        """The root alone through the base model, a plain decoding step; what it commits waits in
        `pending` for the drafter (`flush`)."""
        p, pace = s.plain, s.pace
        c = p.cache
        out = self.base(p.last[:, None], c.lengths[:, None], causal_mask(c.lengths, 1, self.cache_len), c,
                        feature_layers=self.drafter.feature_layers)
        bonus = sample(out.logits[:, 0], use_keys(step_keys(p.keys, p.step + 1), BONUS), self.sampling)
        b = bonus.shape[0]
        live = ~p.done
        at = jnp.where(live, pace.pending_n, PROBE_EVERY)  # a finished sequence's row is dropped
        put = lambda buf, x: None if buf is None else buf.at[jnp.arange(b), at].set(x[:, 0], mode="drop")
        q = pace.pending
        pending = Committed(put(q.hidden, out.hidden), put(q.hidden_normed, out.hidden_normed),
                            put(q.tokens, bonus[:, None]), put(q.features, out.features))
        s = s.replace(pace=pace.replace(pending=pending, pending_n=pace.pending_n + live,
                                        plain_steps=pace.plain_steps + live, idle=pace.idle + 1))
        return advance(s, out.cache, bonus, bonus[:, None], jnp.ones((b,), jnp.int32), out.logits[:, 0])

    def flush(self, s):
        """Hand the drafter what plain steps committed since the last flush, in one commit."""
        n = s.pace.pending_n
        return s.replace(draft=self.drafter.commit(self.base, s.draft, s.pace.pending, n, n > 0),
                         pace=s.pace.replace(pending_n=jnp.zeros_like(n)))

    def loop(self, cond: Callable, speculative_step: Callable, advance: Callable, state):
        """Runs of speculative steps and runs of plain steps, each a loop of its own. (A `lax.cond`
        between the two steps made XLA copy the whole KV cache in and out of the branch at every step.)
        A run of plain steps goes PROBE_EVERY steps at a time, each piece flushed, so `pending` holds
        them all and the drafter has every token before the next speculative step."""
        plain_step = lambda s: self.plain_step(s, advance)
        keep = lambda drafting: lambda s: cond(s) & (speculate_now(s.pace, self.step_cost) == drafting)
        room = lambda s: keep(False)(s) & (jnp.max(s.pace.pending_n) < PROBE_EVERY)
        drafting = lambda s: chunked(keep(True), speculative_step, s, self.chunk)
        piece = lambda s: self.flush(chunked(room, plain_step, s, self.chunk))
        plain = lambda s: jax.lax.while_loop(keep(False), piece, s)
        return jax.lax.while_loop(cond, lambda s: plain(drafting(s)), state)


def pacer(step_cost: float | None, base: Llama, drafter: Drafter, *, sampling: SamplingConfig,
          cache_len: int, chunk: int = 1) -> Unpaced | Paced:
    """The pacer for `step_cost` (a speculative step's cost in plain steps; None: draft at every step),
    taking its steps `chunk` at a time."""
    if step_cost is None:
        return Unpaced(chunk)
    return Paced(step_cost, base, drafter, sampling=sampling, cache_len=cache_len, chunk=chunk)
