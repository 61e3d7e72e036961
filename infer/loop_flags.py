"""The decoding loop's flags, shared by `infer.generate` and `infer.benchmark`: `--loop-chunk K` (decoding
steps per chunk of the loop, `clover_jax.engine.chunks`) and the benchmark's `--command-buffer` (XLA's
command-buffer, CUDA graph, support for loops and conditionals on a GPU), for the loop's A/B.

XLA reads XLA_FLAGS once, when JAX starts its backend, so `use_command_buffer` sets it before that and
refuses to run once the backend has started (the flag would be silently ignored then).
"""

from __future__ import annotations

import argparse
import os

from clover_jax.engine.chunks import DEFAULT_LOOP_CHUNK, check_chunk
from clover_jax.errors import CloverError

# XLA's default command-buffer kinds plus WHILE and CONDITIONAL: a while loop or a conditional (and what
# runs in it) is then one CUDA graph, whose conditional nodes decide on the device, not on the host.
COMMAND_BUFFER = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def add_loop_chunk(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loop-chunk", type=int, default=DEFAULT_LOOP_CHUNK, metavar="K",
                   help="decoding steps per chunk of the loop: the loop runs K steps with a fixed trip count, "
                        "steps past its end doing nothing, and tests whether to go on once per chunk, so that a "
                        "GPU need not copy the loop's condition to the host at every step; the text is the same "
                        "for every K; 1: step by step (default: %(default)s)")


def add_command_buffer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--command-buffer", action="store_true",
                   help="run the decoding loops as XLA command buffers (CUDA graphs) on a GPU, loops and "
                        f"conditionals included: adds {COMMAND_BUFFER} to XLA_FLAGS before JAX starts "
                        "(no effect on a CPU or TPU)")


def check_loop_chunk(args: argparse.Namespace) -> int:
    """--loop-chunk as a number of steps, or one error line."""
    try:
        return check_chunk(args.loop_chunk)
    except CloverError as e:
        raise CloverError(f"--loop-chunk: {e}") from None


def use_command_buffer(enabled: bool) -> None:
    """With `enabled`, add COMMAND_BUFFER to XLA_FLAGS (after any flags set there, so it wins), before
    JAX's backend starts."""
    if not enabled:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise CloverError("--command-buffer must be set before JAX starts its backend; it started already")
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), COMMAND_BUFFER) if f)
