"""One process of tests/test_sharding.py's two-process run: jax.distributed over localhost (gloo
collectives on CPU), 2 CPU devices per process, greedy generation on a data=2,model=2 mesh spanning
both processes. Prints the tokens as JSON. Args: process_id port."""

import json
import sys

import jax

pid, port = int(sys.argv[1]), int(sys.argv[2])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120)

from sharded_run import PROMPTS, build  # noqa: E402  (after jax.distributed, as JAX requires)

from clover_jax.engine.decode import Generator  # noqa: E402
from clover_jax.engine.speculative import SpeculativeGenerator  # noqa: E402
from clover_jax.trees.spec import resolve_tree  # noqa: E402

assert jax.device_count() == 4 and jax.local_device_count() == 2
base, heads, mesh = build("data=2,model=2")
plain = Generator(base, mesh=mesh).generate(PROMPTS, 8, eos_ids=()).tokens
spec = SpeculativeGenerator(base, heads, resolve_tree("widths:2,2,1", "clover2", 3), mesh=mesh)
print(json.dumps({"process": pid, "plain": plain, "speculative": spec.generate(PROMPTS, 8, eos_ids=()).tokens}))
