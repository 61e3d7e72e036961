"""`--shape`: step latency of a real architecture (Llama-2-7B, Llama-3-8B) with random bfloat16 weights
on an accelerator, combined with the reference model's tau into a projected speedup. Weights do not
change a step's time, so the 7B/8B figures need no download."""

from __future__ import annotations

import itertools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax import Generator, Llama, ModelConfig, SpeculativeGenerator, load_drafter, resolve_tree
from clover_jax.drafters.vocab import DraftVocab, resolve_size
from clover_jax.model.sharding import param_sharding
from infer.bandwidth import weight_bytes
from infer.report import PLAIN, label

# Real architectures with random weights: step latency does not depend on the weights' values.
SHAPES = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # The same code path at a size a CPU smoke test can afford.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rope_theta=10000.0),
}


def random_model(shape: str, layers: int | None = None, seed: int = 0, mesh=None) -> Llama:
    """A `SHAPES` architecture with random bfloat16 weights (0.02 x normal), drawn on (and, with a mesh,
    straight into the shards of) the devices: a 16 GB model never passes through the host."""
    fields = dict(SHAPES[shape], model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False)
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = ModelConfig.from_hf_dict(fields)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))))
    counter = itertools.count()
    draws = {}  # one compiled draw per (shape, dtype, sharding): 32 identical layers compile once

    def init(path, var):
        a, key = var.get_value(), jax.random.fold_in(jax.random.key(seed), next(counter))
        sharding = param_sharding(path, var, mesh) if mesh else None
        spec = (a.shape, a.dtype, sharding)
        if spec not in draws:
            draws[spec] = jax.jit(lambda k: (0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype),
                                  out_shardings=sharding)
        return var.replace(draws[spec](key))

    return nnx.merge(graphdef, nnx.map_state(init, abstract))


def shape_step_times(shape: str, layers: int | None, configs: list[tuple[str, str | None, str | None]], batch_size: int,
                     max_new: int, seed: int, progress, mesh=None) -> dict[str, dict]:
    """Plain and speculative step latency (the decoding loop's, the prefill apart) of a real architecture
    with random bfloat16 weights and random heads (acceptance is irrelevant here: a step costs the same
    whatever it accepts). A numeric draft vocabulary takes that many tokens (which ones does not change
    the time); auto, the whole vocabulary."""
    model = random_model(shape, layers, seed, mesh)
    cfg = model.cfg
    prompt_len = 128
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch_size)]
    out = {}
    no_counts = np.zeros(cfg.vocab_size, np.int64)  # random heads: no token more frequent than another
    for method, tree, dv in configs:
        size = 0
        if method == PLAIN:
            gen = Generator(model, max_len=prompt_len + max_new, mesh=mesh)
        else:
            heads = load_drafter(model, method, heads="random", seed=seed).drafter
            size = resolve_size(dv, no_counts, cfg.vocab_size)  # auto: the whole vocabulary, as no counts give
            vocab = DraftVocab.most_frequent(model.lm_head_weight(), no_counts, size) if size else None
            gen = SpeculativeGenerator(model, heads, resolve_tree(tree, method, heads.num_heads),
                                       max_len=prompt_len + max_new, mesh=mesh, draft_vocab=vocab)
        compile_s = gen.generate(prompts, max_new, eos_ids=()).compile_seconds
        # The same program with a budget of one token runs the prefill alone; the loop's steps are the
        # difference, so a prefill (a step of its own kind) does not dilute the step time.
        whole, alone = [], []
        for _ in range(3):
            o = gen.generate(prompts, max_new, eos_ids=())
            p = gen.generate(prompts, max_new, eos_ids=(), budgets=[1] * batch_size)
            whole.append(o.run_seconds)
            alone.append(p.run_seconds)
        loop_steps = o.steps - p.steps
        progress.update(1)
        out[label(method, tree, draft_vocab=dv)] = dict(
            step_ms=1e3 * (statistics.median(whole) - statistics.median(alone)) / loop_steps,
            prefill_ms=1e3 * statistics.median(alone), loop_steps=loop_steps, compile_s=compile_s,
            tree_nodes=gen.tree.num_nodes if gen.tree else 1, draft_vocab_size=size)
        del gen
    return dict(shape=shape, layers=cfg.num_layers, batch_size=batch_size, weight_bytes=weight_bytes(model),
                methods=out)


def project(shape: dict, tau: dict[str, float], bandwidth: float) -> None:
    """Add to `shape_step_times`' result, per row, the reference model's tau (`tau`, by row name) and
    the projected speedup tau x plain step / step, and the bandwidth limit's step time (at `bandwidth`
    bytes/s, the device's streaming read) for its weights."""
    plain_ms = shape["methods"][PLAIN]["step_ms"]
    for name, s in shape["methods"].items():
        s["tau_reference"] = tau[name]
        s["projected_speedup"] = tau[name] * plain_ms / s["step_ms"]
    shape["limit_step_ms"] = 1e3 * shape["weight_bytes"] / bandwidth
