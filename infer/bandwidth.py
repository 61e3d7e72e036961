"""Plain decoding against the physical limit of batch-1 decoding: the bytes a step must read (every
weight, and the K/V so far) over its time, against the device's streaming-read bandwidth measured on
the spot, between the prompts of the same passes, since a shared host's bandwidth drifts."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax import Generator, Llama
from clover_jax.engine.decode import continue_plain, start_plain, to_host

SAMPLE_PROMPTS = 8
"""The bandwidth line times the first this many prompts, not all: its passes run to the token budget
(no EOS), and over all of MT-Bench timing every prompt cost a sixth of the run for one ratio."""


class BandwidthProbe:
    """The device's streaming-read bandwidth: a jitted sum over an array far larger than any cache. 256 MB
    on a CPU; 4 GB on an accelerator, whose TB/s would otherwise read 256 MB in less time than a dispatch
    takes. The array lives as long as the probe: keep one only while reading (an accelerator's memory
    is needed for the models)."""

    def __init__(self, megabytes: int | None = None):
        if megabytes is None:
            megabytes = 256 if jax.devices()[0].platform == "cpu" else 4096
        self.x = jnp.ones((megabytes << 18,), jnp.float32)
        self.total = jax.jit(jnp.sum)
        jax.block_until_ready(self.total(self.x))

    def read(self) -> float:
        """One timed read, in bytes/s."""
        t0 = time.perf_counter()
        jax.block_until_ready(self.total(self.x))
        return self.x.nbytes / (time.perf_counter() - t0)

    def median(self, repeats: int = 7) -> float:
        """The median of `repeats` reads, in bytes/s."""
        return statistics.median(self.read() for _ in range(repeats))


def plain_phases(generator: Generator, prompts: list[list[int]], max_new: int, repeats: int) -> dict:
    """Batch-1 plain generation of each prompt run as two jitted programs, the prefill (`start_plain`)
    and the decoding loop (`continue_plain`), each timed on its own, with one streaming read
    (`BandwidthProbe`) before each prefill: per timed pass (after a warm-up pass), the seconds of each
    phase over the prompts and the median bandwidth read in between, and the decoding steps taken. A
    shared host's load drifts over a run; the reads taken during a pass measure the bandwidth it had."""
    static_names = ("sampling", "eos_ids", "max_new", "cache_len")
    start = jax.jit(lambda g, params, *a, **s: start_plain(nnx.merge(g, params), *a, **s),
                    static_argnums=0, static_argnames=(*static_names, "mesh"))
    loop = jax.jit(lambda g, params, state, budgets, **s: continue_plain(nnx.merge(g, params), state, budgets, **s),
                   static_argnums=0, static_argnames=(*static_names, "loop_chunk"), donate_argnums=2)
    probe = BandwidthProbe()
    passes = []
    for _ in range(max(repeats, 1) + 1):  # its jitted programs compile in the first pass: never timed
        prefill_s = decode_s = steps = 0
        reads = []
        for p in prompts:
            args, static = generator.prepare([p], max_new, eos_ids=())
            chunk = static.pop("loop_chunk")  # the loop's alone: the prefill has none
            reads.append(probe.read())
            t0 = time.perf_counter()
            state = jax.block_until_ready(start(generator.graphdef, *args, **static))
            t1 = time.perf_counter()
            static.pop("mesh")
            state = jax.block_until_ready(loop(generator.graphdef, args[0], state, args[3], loop_chunk=chunk, **static))
            decode_s += time.perf_counter() - t1
            prefill_s += t1 - t0
            steps += int(to_host(state.step))
        passes.append(dict(prefill_s=prefill_s, decode_s=decode_s, bandwidth=statistics.median(reads)))
    return dict(passes=passes[1:], decode_steps=steps)


def weight_bytes(model: Llama) -> int:
    """Bytes of the model's parameters: what every decoding step reads once."""
    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def plain_efficiency(model: Llama, prompts: list[list[int]], max_new: int, phases: dict) -> dict:
    """Batch-1 plain decoding against the bandwidth limit: each decoding step reads every weight once
    and the K/V of the tokens so far (the mean over the run's steps). The step time is the decoding
    loop's alone (`plain_phases`); a prefill reads the weights once for a whole prompt. The fraction is
    the median over the timed passes of each pass's achieved bytes/s over the bandwidth read during it."""
    cfg = model.cfg
    weights = weight_bytes(model)
    per_token_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
    mean_context = float(np.mean([len(p) + (max_new - 1) / 2 for p in prompts]))
    step_bytes = weights + per_token_kv * mean_context
    steps = max(phases["decode_steps"], 1)
    passes = phases["passes"]
    decode_s = statistics.median(p["decode_s"] for p in passes) / steps
    bandwidth = statistics.median(p["bandwidth"] for p in passes)
    fraction = statistics.median(step_bytes * steps / p["decode_s"] / p["bandwidth"] for p in passes)
    return dict(prompts=len(prompts), weight_bytes=weights, kv_bytes_per_step=float(per_token_kv * mean_context),
                bytes_per_step=float(step_bytes), decode_steps=phases["decode_steps"], decode_step_ms=1e3 * decode_s,
                prefill_ms_per_prompt=1e3 * statistics.median(p["prefill_s"] for p in passes) / len(prompts),
                achieved_bytes_per_s=step_bytes / decode_s, bandwidth_bytes_per_s=bandwidth,
                fraction_of_bandwidth=fraction, limit_step_ms=1e3 * step_bytes / bandwidth,
                passes=[dict(decode_step_ms=1e3 * p["decode_s"] / steps, bandwidth_bytes_per_s=p["bandwidth"],
                             fraction_of_bandwidth=step_bytes * steps / p["decode_s"] / p["bandwidth"])
                        for p in passes])
