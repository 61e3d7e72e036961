"""Run by tests/test_sharding.py in a fresh process with 8 virtual CPU devices (XLA_FLAGS must be set
before JAX starts): greedy plain and speculative generation and a single prompt filled to the data axis
on each mesh named; on one device and on the meshes named with `:all` also with a draft vocabulary,
streamed, with EAGLE-3's draft model on an eagle2 tree, and a prompt prefilled in query blocks; meshes over fewer devices or with a -1 axis.
Printed as JSON."""

import json
import sys

import jax
from flax import nnx

from clover_jax.model.config import ModelConfig
from clover_jax.engine.decode import Generator
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.llama import Llama
from clover_jax.model.sharding import describe_mesh, make_mesh
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.trees.spec import resolve_tree

CFG = ModelConfig.tiny(num_heads=8, num_kv_heads=8, head_dim=4, vocab_size=64, max_position_embeddings=2048)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14], [15], [16, 17], [18, 19, 20], [21, 22]]


def build(mesh_spec):
    base = Llama(CFG, rngs=nnx.Rngs(0))
    heads = make_heads(drafter_config("clover2", 3), base, seed=1)
    mesh = None if mesh_spec is None else make_mesh(mesh_spec)
    return base, heads, mesh


def run(mesh_spec, everything: bool):
    base, heads, mesh = build(mesh_spec)
    plain = Generator(base, mesh=mesh).generate(PROMPTS, 8, eos_ids=()).tokens
    spec_gen = SpeculativeGenerator(base, heads, resolve_tree("widths:2,2,1", "clover2", 3), mesh=mesh)
    out = spec_gen.generate(PROMPTS, 8, eos_ids=())
    result = {"plain": plain, "speculative": out.tokens}
    if mesh is not None:
        kernel = base.layers[0].mlp.gate_proj.kernel.get_value()
        result |= {"gate_proj": str(kernel.sharding.spec), "gate_proj_shards": len({str(s.index) for s in kernel.addressable_shards}),
                   "cache": str(out.state.plain.cache.k[0].sharding.spec), "aug_cache": str(out.state.draft.aug_cache.k[0].sharding.spec),
                   "mesh": describe_mesh(mesh),
                   # one prompt: filled to the batch split (data x fsdp), only its own row returned
                   "one_prompt": Generator(base, mesh=mesh).generate(PROMPTS[1:2], 8, eos_ids=()).tokens}
    if not everything:
        return result
    vocab = DraftVocab.most_frequent(base.lm_head_weight(), None, 32)
    vocab_gen = SpeculativeGenerator(base, heads, resolve_tree("chain:3", "clover2", 3), mesh=mesh, draft_vocab=vocab)
    eagle = make_heads(drafter_config("eagle3", 3), base, seed=1)
    eagle_out = SpeculativeGenerator(base, eagle, resolve_tree("eagle2:6,3,3", "eagle3", 3), mesh=mesh).generate(
        PROMPTS, 8, eos_ids=())
    shown = []  # streaming: the tokens the host was handed after each step
    spec_gen.generate(PROMPTS, 8, eos_ids=(), on_tokens=lambda t, n: shown.append([t[i, :k].tolist() for i, k in enumerate(n)]))
    # a prompt long enough that its prefill attends in query blocks (layers.query_blocks)
    long = Generator(base, mesh=mesh, buckets=(1030,)).generate([[3 + i % 60 for i in range(1030)], [5, 6]], 4,
                                                               eos_ids=()).tokens
    result |= {"streamed": shown[-1], "draft_vocab": vocab_gen.generate(PROMPTS, 8, eos_ids=()).tokens,
               "eagle3": eagle_out.tokens, "long_prompt": long}
    if mesh is not None:
        result |= {"draft_vocab_rows": str(vocab_gen.draft_vocab.rows.sharding.spec),
                   "eagle3_cache": str(eagle_out.state.draft.cache.k[0].sharding.spec),
                   "eagle3_lm_head": str(eagle.lm_head.kernel.get_value().sharding.spec)}
    return result


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    shapes = {spec: [describe_mesh(mesh), dict(mesh.shape)] for spec in ("data=-1,model=4", "model=-1", "fsdp=2,data=-1")
              for mesh in [make_mesh(spec)]}
    runs = {"None": run(None, True)}
    for arg in sys.argv[1:]:
        spec, _, extent = arg.partition(":")
        runs[spec] = run(spec, extent == "all")
    print(json.dumps({"shapes": shapes, **runs}))
