"""Plain (one token per step) generation: prefill plus a `lax.while_loop` (in chunks of a fixed number
of steps: `chunks`), jitted end to end.

Prompts are right-padded to a few length buckets, so a new prompt length reuses a compiled program;
each sequence has its own length, token budget and RNG key, and stops on its own EOS. `Generator`
is the host-side front: it tokenizes nothing, pads, picks the bucket, compiles once per shape
(ahead of time, so compile time is reported apart from run time) and trims the outputs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from clover_jax.engine.chunks import DEFAULT_LOOP_CHUNK, check_chunk, chunked
from clover_jax.model.cache import KVCache, causal_mask
from clover_jax.errors import CloverError
from clover_jax.model.llama import Llama, ModelOutput
from clover_jax.engine.sampling import SamplingConfig, sample, step_keys
from clover_jax.model.sharding import batch_split, constrain_cache, put_batch, replicate, shard_module

BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@flax.struct.dataclass
class DecodeState:
    """What plain decoding carries from one step to the next (the while_loop's state)."""

    cache: KVCache
    tokens: jax.Array  # [B, M] generated tokens, written left to right
    num_new: jax.Array  # [B] tokens generated so far
    last: jax.Array  # [B] the newest token: the next step's input
    done: jax.Array  # [B] hit EOS or the budget
    finite: jax.Array  # [B] every logit so far was finite
    keys: jax.Array  # [B, 2] per-sequence RNG keys
    step: jax.Array  # [] steps taken (forward passes after the prefill)

    def record(self, new: jax.Array, budgets: jax.Array, eos_ids: tuple[int, ...]) -> "DecodeState":
        """Append token `new` [B] to every unfinished sequence (it becomes `last`) and update `done`."""
        live = ~self.done
        appended = self.append(new[:, None], jnp.ones_like(self.num_new), budgets, eos_ids)
        return appended.replace(last=jnp.where(live, new, self.last))

    def append(self, new: jax.Array, count: jax.Array, budgets, eos_ids: tuple[int, ...]) -> "DecodeState":
        """Append new[b, :count[b]] to each live sequence, cut at its first EOS and at its budget."""
        b, t = new.shape
        j = jnp.arange(t)[None, :]
        live = ~self.done
        if eos_ids:
            is_eos = jnp.isin(new, jnp.asarray(eos_ids, jnp.int32)) & (j < count[:, None])
            first = jnp.where(is_eos.any(-1), jnp.argmax(is_eos, -1) + 1, t + 1)
            count = jnp.minimum(count, first)
            hit_eos = first <= t
        else:
            hit_eos = jnp.zeros((b,), bool)
        count = jnp.where(live, jnp.minimum(count, budgets - self.num_new), 0)
        cols = jnp.where(j < count[:, None], self.num_new[:, None] + j, self.tokens.shape[1])
        tokens = self.tokens.at[jnp.arange(b)[:, None], cols].set(new, mode="drop")
        num_new = self.num_new + count
        done = self.done | (live & hit_eos) | (num_new >= budgets)
        return self.replace(tokens=tokens, num_new=num_new, done=done)

    def paused(self, go: jax.Array) -> "DecodeState":
        """This state with every sequence done unless `go` []: a step from it appends nothing."""
        return self.replace(done=self.done | ~go)

    def resumed(self, before: "DecodeState", go: jax.Array) -> "DecodeState":
        """The state after a step from `before.paused(go)`, with `before`'s `done` and `step` unless `go`."""
        return self.replace(done=jnp.where(go, self.done, before.done), step=jnp.where(go, self.step, before.step))

    def masked(self, go: jax.Array, step: Callable[["DecodeState"], "DecodeState"]) -> "DecodeState":
        """`step(self)` where `go` [] holds, else a step that appends nothing (`chunks.chunked`'s mask: the
        K/V it writes past each cache length are never read, as no step follows it)."""
        return step(self.paused(go)).resumed(self, go)


def prefill(model: Llama, prompts: jax.Array, prompt_lens: jax.Array, cache_len: int, mesh=None,
            feature_layers: tuple[int, ...] = ()) -> tuple[ModelOutput, jax.Array]:
    """Run the padded prompts [B, P] through the model; returns (its output: cache with lengths =
    prompt_lens, hidden, normed hidden [B, P, D] and the `feature_layers` outputs [B, P, F, D] of every
    position, no logits; logits [B, V] at each prompt's last token, the one position projected). With a
    mesh, the cache is sharded."""
    b, p = prompts.shape
    cache = constrain_cache(model.init_cache(b, cache_len), mesh)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = model(prompts, positions, causal_mask(cache.lengths, p, cache_len), cache, with_logits=False,
                feature_layers=feature_layers, causal=True)
    last = (prompt_lens - 1)[:, None, None]
    normed_last = jnp.take_along_axis(out.hidden_normed, last, axis=1)[:, 0]
    return out.replace(cache=out.cache.advance(prompt_lens)), model.logits(normed_last)


def start_plain(model: Llama, prompts, prompt_lens, budgets, keys, *, sampling: SamplingConfig,
                eos_ids: tuple[int, ...], max_new: int, cache_len: int, mesh=None) -> DecodeState:
    """The prefill: the prompts in the cache and each sequence's first token recorded."""
    b = prompts.shape[0]
    out, logits = prefill(model, prompts, prompt_lens, cache_len, mesh)
    state = DecodeState(
        cache=out.cache, tokens=jnp.zeros((b, max_new), jnp.int32), num_new=jnp.zeros((b,), jnp.int32),
        last=jnp.zeros((b,), jnp.int32), done=budgets <= 0, finite=jnp.isfinite(logits).all(-1),
        keys=keys, step=jnp.zeros((), jnp.int32))
    return state.record(sample(logits, step_keys(keys, 0), sampling), budgets, eos_ids)


def stream_tokens(stream: Callable | None, state, mesh=None, wrote: jax.Array | None = None):
    """Hand the tokens so far ([B, M] and their counts [B]) to the host callback `stream`, if any, at the
    end of a step: `Generator.generate(on_tokens=...)` shows text as it is written this way. On a mesh
    they are gathered first (a few ints), and the callback runs once, from the first device. `wrote` []:
    whether any sequence was live at the step's start (the host skips a chunked loop's masked steps)."""
    if stream is not None:
        shown = (state.tokens, state.num_new, jnp.asarray(True) if wrote is None else wrote)
        if mesh is not None:
            shown = replicate(shown, mesh)
        io_callback(stream, None, *shown, ordered=True)
    return state


def continue_plain(model: Llama, state: DecodeState, budgets, *, sampling: SamplingConfig,
                   eos_ids: tuple[int, ...], max_new: int, cache_len: int,
                   stream: Callable | None = None, mesh=None, loop_chunk: int = 1) -> DecodeState:
    """The decoding steps after `start_plain`: one token per sequence per step until all are done, taken
    `loop_chunk` at a time (`chunks.chunked`)."""

    def cond(s: DecodeState):
        return (s.step < max_new - 1) & ~jnp.all(s.done)

    def body(s: DecodeState):
        c = s.cache
        out = model(s.last[:, None], c.lengths[:, None], causal_mask(c.lengths, 1, cache_len), c)
        logits = out.logits[:, 0]
        step = s.step + 1
        s = s.replace(cache=out.cache.advance(~s.done), step=step,
                      finite=s.finite & (jnp.isfinite(logits).all(-1) | s.done))
        return stream_tokens(stream, s.record(sample(logits, step_keys(s.keys, step), sampling), budgets, eos_ids),
                             mesh, ~jnp.all(s.done))

    return chunked(cond, body, state, loop_chunk, lambda s, go, step: s.masked(go, step))


def generate_plain(graphdef, params, prompts, prompt_lens, budgets, keys, *, mesh=None, stream=None,
                   loop_chunk: int = 1, **static) -> DecodeState:
    """The whole plain generation as one pure function (jit it with the keyword args static)."""
    model = nnx.merge(graphdef, params)
    state = start_plain(model, prompts, prompt_lens, budgets, keys, mesh=mesh, **static)
    return continue_plain(model, state, budgets, stream=stream, mesh=mesh, loop_chunk=loop_chunk, **static)


@dataclasses.dataclass
class GenerationOutput:
    """The result of `Generator.generate`: tokens per prompt, plus the counts and times statistics need."""

    tokens: list[list[int]]  # per prompt, the new tokens (EOS included when hit)
    steps: int  # forward passes of the batch, the prefill included
    compile_seconds: float  # compiling and a first, set-up run; 0 when the program was already compiled
    run_seconds: float
    sequence_steps: list[int] = dataclasses.field(default_factory=list)  # forward passes each sequence took
    accept_hist: np.ndarray | None = None  # [B, D+1] speculative steps accepting d drafted tokens
    node_hits: np.ndarray | None = None  # [B, N] speculative steps whose accepted path holds node i (static trees)
    state: object = None  # final device state, for further statistics (filler rows included)

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens per forward pass (bonus token included; plain decoding has 1.0)."""
        return self.num_new_tokens / max(sum(self.sequence_steps), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / max(self.run_seconds, 1e-9)

    @property
    def decode_steps(self) -> int:
        """Forward passes after the prefills (each sequence that ran began with one)."""
        return sum(self.sequence_steps) - sum(1 for steps in self.sequence_steps if steps)

    @property
    def drafted_steps(self) -> int:
        """Of `decode_steps`, those that drafted: all of them unless the loop was paced; none when plain."""
        return 0 if self.accept_hist is None else int(self.accept_hist.sum())


def to_host(x: jax.Array) -> np.ndarray:
    """A device array as NumPy on this host, gathered from the other processes when it spans them."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def bucket_for(length: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket that holds a prompt of `length` tokens."""
    for b in buckets:
        if b >= length:
            return b
    raise CloverError(f"prompt of {length} tokens is longer than the largest bucket ({buckets[-1]})")


class Generator:
    """Host-side front of a jitted generation program: padding, buckets, compile cache, trimming.

    Subclasses (speculative decoding) supply `_program` and extra static arguments; the padding,
    budget checks and compile accounting here are shared. `loop_chunk`: decoding steps per chunk of
    the loop (`chunks.chunked`; 1: a data-dependent `while_loop` step by step), the tokens alike for all.
    """

    tree = None  # the draft tree (a speculative generator's `Tree` or `DynamicTree`); None: plain decoding
    draft_vocab = None  # the drafter's `DraftVocab` (None: the whole vocabulary, or no drafter)

    def __init__(self, model: Llama, *, max_len: int | None = None, buckets: Sequence[int] = BUCKETS,
                 mesh: jax.sharding.Mesh | None = None, loop_chunk: int = DEFAULT_LOOP_CHUNK):
        self.model = model
        self.loop_chunk = check_chunk(loop_chunk)  # decoding steps per chunk of the loop (`chunks.chunked`)
        self.cfg = model.cfg
        self.mesh = mesh
        if mesh is not None:
            shard_module(model, mesh)
        self.graphdef, self.params = nnx.split(model)
        self.max_len = max_len or self.cfg.max_position_embeddings
        self.buckets = tuple(b for b in buckets if b < self.max_len) + (self.max_len,)
        self._compiled: dict = {}
        self.compilations = 0
        self._listener: Callable | None = None  # generate's on_tokens, while its timed run lasts
        self._rows = 0  # the real (not filler) rows of the batch being generated, which _emit passes on
        self._listener_error: BaseException | None = None

    # What a subclass changes.
    def _program(self) -> Callable:
        return generate_plain

    def _static(self) -> dict:
        return {}

    def _slack(self) -> int:
        """Cache slots needed past the last kept token (a speculative step writes a whole tree)."""
        return 0

    def statistics(self, state):
        """(the program's final `DecodeState`, forward passes per sequence [B], steps that accepted d
        drafted tokens [B, D+1] or None, steps whose accepted path held tree node i [B, N] or None): one
        token per pass here."""
        return state, to_host(state.num_new), None, None

    def prepare(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                eos_ids: Sequence[int] | None = None,
                budgets: Sequence[int] | None = None) -> tuple[tuple, dict]:
        """Check and pad the prompts: the program's arguments (params, prompts [B, bucket], lengths,
        budgets, keys), placed on the mesh, and its static settings. `generate` documents the arguments."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise CloverError("every prompt must have at least one token")
        if max_new_tokens < 1:
            raise CloverError(f"max_new_tokens={max_new_tokens} must be >= 1")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_len:
            raise CloverError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the cache of {self.max_len} "
                "positions; shorten the prompt, lower max_new_tokens= or raise max_len=",
                arguments=("max_new_tokens", "max_len"))
        if not 0 <= seed < 2 ** 32:  # a key holds 32 bits of it: 2**32 would draw what 0 draws, 2**64 overflow
            raise CloverError(f"seed {seed} must be in [0, 2**32), the seeds a JAX random key tells apart")
        vocab = self.cfg.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise CloverError(f"prompt token ids must be in [0, {vocab}); the tokenizer does not match the model")
        eos = tuple(int(e) for e in (self.cfg.eos_token_ids if eos_ids is None else eos_ids))
        bucket = bucket_for(longest, self.buckets)
        b = len(prompts)
        padded = np.zeros((b, bucket), np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        lens = np.array([len(p) for p in prompts], np.int32)
        budget = np.full((b,), max_new_tokens, np.int32) if budgets is None else np.minimum(
            np.asarray(budgets, np.int32), max_new_tokens)
        keys = jax.random.split(jax.random.key(seed), b)
        keys = jax.random.key_data(keys)
        static = dict(sampling=sampling, eos_ids=eos, max_new=max_new_tokens,
                      cache_len=bucket + max_new_tokens + self._slack(), mesh=self.mesh,
                      loop_chunk=self.loop_chunk, **self._static())
        place = jnp.asarray if self.mesh is None else (lambda x: put_batch(x, self.mesh))
        args = (self.params, *map(place, (padded, lens, budget, keys)))
        return args, static

    def _emit(self, tokens, num_new, wrote=True) -> None:
        """The programs' host callback (`stream_tokens`): passes the tokens on to `on_tokens` during a timed
        run (the set-up run streams to nobody), after every step that `wrote` (a chunked loop's masked
        steps did not). An error there is kept and raised after the run, as an exception cannot cross the
        device boundary intact."""
        if self._listener is None or self._listener_error is not None or not bool(wrote):
            return
        try:
            self._listener(np.asarray(tokens)[: self._rows], np.asarray(num_new)[: self._rows])
        except BaseException as e:  # noqa: BLE001 - re-raised by generate
            self._listener_error = e

    def compiled_hlo(self) -> str:
        """The optimized HLO text of every program compiled so far: what a profile's operations name."""
        return "\n".join(c.as_text() for c in self._compiled.values())

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                 eos_ids: Sequence[int] | None = None,
                 budgets: Sequence[int] | None = None,
                 on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 batch_size: int | None = None) -> GenerationOutput:
        """Generate up to `max_new_tokens` per prompt (token ids), all prompts in one batch.

        `budgets` caps each prompt's new tokens on its own; `eos_ids` defaults to the model config's
        (pass `()` to never stop early); `seed` seeds per-sequence keys when `sampling` samples.
        `on_tokens(tokens [B, M], counts [B])`, when given, is called on this host after every decoding
        step with each sequence's new tokens so far (`tokens[i, :counts[i]]`), to show text as it is
        written; it costs a device-to-host copy per step and a program of its own (one process only).
        Compiles on the first call with a new batch size, bucket or static setting.

        `batch_size` fills the batch up to that many rows, so that batches of fewer prompts (the last of a
        file, a single prompt) reuse one compiled program; on a mesh the batch is also filled to a
        multiple of the devices it is split over (`sharding.batch_split`). The filler rows copy the first
        prompt with a budget of 0, so they cost no step, and only the real rows come back: their tokens
        are those of an unfilled batch, sampled ones too (each row's key depends on its index alone)."""
        rows = len(prompts)
        if batch_size is not None and batch_size < rows:
            raise CloverError(f"batch_size={batch_size} is smaller than the {rows} prompts given")
        split = batch_split(self.mesh)
        size = -(-max(batch_size or rows, rows) // split) * split
        if rows and size > rows:
            budgets = list(budgets) if budgets is not None else [max_new_tokens] * rows
            prompts, budgets = list(prompts) + [prompts[0]] * (size - rows), budgets + [0] * (size - rows)
        args, static = self.prepare(prompts, max_new_tokens, sampling, seed, eos_ids, budgets)
        if on_tokens is not None:
            if jax.process_count() > 1:
                raise CloverError("streaming (on_tokens=) runs in one process; drop on_tokens= for a multi-process "
                                  "run", arguments=("on_tokens",))
            static["stream"] = self._emit
        b = len(prompts)
        key = (b, args[1].shape[1], tuple(sorted(static.items(), key=lambda kv: kv[0])))
        compile_s = 0.0
        if key not in self._compiled:
            t0 = time.perf_counter()
            fn = jax.jit(self._program(), static_argnums=0, static_argnames=tuple(static))
            compiled = fn.lower(self.graphdef, *args, **static).compile()
            # A program's first run sets it up (XLA:CPU prepares each YNNPACK matrix-product fusion then,
            # 0.25 s per speculative program on the reference model): run it once on a prefill and one
            # step, so that this counts as compile time and run_seconds measures generation alone.
            params, padded, lens, budget, keys = args
            two = jnp.full_like(budget, min(2, max_new_tokens))
            jax.block_until_ready(compiled(params, padded, lens, two, keys))
            self._compiled[key] = compiled
            compile_s = time.perf_counter() - t0
            self.compilations += 1
        t0 = time.perf_counter()
        self._listener, self._listener_error, self._rows = on_tokens, None, rows
        try:
            state = jax.block_until_ready(self._compiled[key](*args))
            if on_tokens is not None:
                jax.effects_barrier()  # every step's callback has run
        finally:
            self._listener = None
        run_s = time.perf_counter() - t0
        if self._listener_error is not None:
            raise self._listener_error
        plain, seq_steps, hist, hits = self.statistics(state)
        if not bool(np.all(to_host(plain.finite))):
            raise CloverError("the model produced non-finite logits (NaN/Inf); check the weights, or try "
                              "dtype=float32", arguments=("dtype",))
        num = to_host(plain.num_new)[:rows]
        toks = to_host(plain.tokens)
        tokens = [toks[i, : num[i]].tolist() for i in range(rows)]
        return GenerationOutput(tokens=tokens, steps=int(to_host(plain.step)) + 1, compile_seconds=compile_s,
                                run_seconds=run_s, sequence_steps=np.asarray(seq_steps)[:rows].tolist(),
                                accept_hist=None if hist is None else hist[:rows],
                                node_hits=None if hits is None else hits[:rows], state=state)
