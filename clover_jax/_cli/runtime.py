"""How a tool's process is set up: JAX's persistent compilation cache (--compile-cache) and a
multi-process run through `jax.distributed` (--coordinator, --num-processes, --process-id), then the
mesh --mesh asks for.
"""

from __future__ import annotations

import os
from pathlib import Path

from clover_jax.errors import CloverError
from clover_jax.io.sources import cache_root

COMPILE_CACHE_ENV = "CLOVER_JAX_COMPILE_CACHE"


def default_compile_cache() -> str:
    """$CLOVER_JAX_COMPILE_CACHE, else xla in the project's cache folder (`sources.cache_root`:
    $CLOVER_JAX_CACHE, else clover-jax under $XDG_CACHE_HOME or ~/.cache)."""
    return os.environ.get(COMPILE_CACHE_ENV) or str(cache_root() / "xla")


def add_compile_cache_flag(p) -> None:
    """--compile-cache: where compiled programs are kept between runs (`use_compile_cache`)."""
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="folder where XLA keeps the compiled programs between runs, so that a later run of the same "
                        "shapes loads them instead of compiling again (the reference model's Clover-2 on the CPU: "
                        "4.5 s of compiling down to 1.6 s); off turns it off (default: $" + COMPILE_CACHE_ENV +
                        ", else xla in the cache folder: $CLOVER_JAX_CACHE, else ~/.cache/clover-jax)")


def use_compile_cache(flag: str | None) -> None:
    """Point JAX's persistent compilation cache at --compile-cache's folder (before anything compiles:
    JAX looks once, at a process's first compilation). A folder given that cannot be written to is one
    error line; the default one is skipped quietly (a read-only home), as the cache only saves time."""
    folder = flag or default_compile_cache()
    if folder == "off":
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        if flag:
            raise CloverError(f"--compile-cache {folder}: cannot write there; give a writable folder, or off")
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))


def add_mesh_flags(p, shards: str, note: str = "") -> None:
    """--mesh (what it `shards`, over a device mesh; `note`: what the tool adds about it) and the flags of
    a multi-process run (one process per host, or several on one machine)."""
    p.add_argument("--mesh", metavar="SPEC",
                   help=f"shard {shards} over devices: axis=size pairs over data, fsdp and model, e.g. "
                        "data=2,model=4; one axis may be -1, the devices the others leave (data=-1,model=4)"
                        f"{note} (default: one device)")
    g = p.add_argument_group("multi-process (jax.distributed; also read from JAX's environment variables)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator service")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes taking part")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")


def init_distributed(args) -> None:
    """Start jax.distributed when the flags or JAX's environment (JAX_COORDINATOR_ADDRESS with
    JAX_NUM_PROCESSES and JAX_PROCESS_ID, or a cluster JAX detects itself) ask for it. On CPU the
    collectives go over gloo."""
    given = [f is not None for f in (args.coordinator, args.num_processes, args.process_id)]
    if not any(given) and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    if any(given) and not all(given):
        raise CloverError("--coordinator, --num-processes and --process-id go together")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not any(given):
        jax.distributed.initialize()  # everything from the environment
    else:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def mesh_of(args):
    """The device mesh a command's --mesh asks for (None: one device), after joining the other
    processes when the flags or the environment name them."""
    init_distributed(args)
    if not args.mesh:
        return None
    from clover_jax.model.sharding import make_mesh

    return make_mesh(args.mesh)
