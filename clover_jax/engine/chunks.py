"""Decoding loops in chunks of K steps, so that an accelerator does not wait on the host at every step.

XLA's GPU runtime runs a `while_loop` whose trip count depends on data by copying its predicate to the
host at every iteration (and a `lax.cond` the same way, for its branch), so the host cannot queue the
next step's kernels before the last one has finished. A loop with a fixed trip count runs without that
copy (or unrolled). `chunked` runs `while cond: body` as an outer `while_loop` over chunks, each chunk K
steps of a fixed-trip-count `lax.fori_loop`, in which a step past the loop's end changes nothing that
is read afterwards. Two ways to make such a step a no-op:

- `mask` (the plain and unpaced speculative loops, the ones an accelerator runs): the step runs, with
  every sequence marked done, so it appends no token, counts nothing and advances no cache length, and
  the state's `done` and `step` are put back; no host predicate anywhere, at the cost of at most K - 1
  steps of compute at the loop's end. It relies on the loop's condition staying false once false (it
  reads only `done` and `step`), so the K/V such a step writes past each cache length are never read.
- a `lax.cond` per step (the paced loop's runs, on a CPU, where a branch costs the host nothing and runs
  of a few steps would otherwise waste most of a chunk): the step is skipped outright.

Either way the tokens are those of the unchunked loop, for every K: a step's sampling key depends on the
step count (`sampling.step_keys`), which only a step that ran advances. K = 1 is the plain `while_loop`.
"""

from __future__ import annotations

from typing import Callable

import jax

from clover_jax.errors import CloverError

# Steps per chunk unless told otherwise (`Generator(loop_chunk=...)`, `--loop-chunk`).
DEFAULT_LOOP_CHUNK = 1


def check_chunk(chunk: int) -> int:
    """`chunk` as a loop chunk (an int >= 1), else a CloverError."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise CloverError(f"loop chunk {chunk!r} must be a whole number of steps >= 1 (1: a step at a time)")
    return chunk


def chunked(cond: Callable, body: Callable, state, chunk: int, mask: Callable | None = None):
    """`lax.while_loop(cond, body, state)`, its steps taken `chunk` at a time (the module docstring).

    `mask(before, go, step)`, when given, runs `step` (the body) as a no-op where `go` [] is false and
    returns the state after it (`DecodeState.masked`); without it each step sits in a `lax.cond`."""
    if chunk == 1:
        return jax.lax.while_loop(cond, body, state)
    if mask is None:
        one = lambda s: jax.lax.cond(cond(s), body, lambda t: t, s)
    else:
        one = lambda s: mask(s, cond(s), body)
    return jax.lax.while_loop(cond, lambda s: jax.lax.fori_loop(0, chunk, lambda _, t: one(t), s), state)

