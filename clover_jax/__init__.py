"""clover-jax: speculative decoding (Medusa, Clover, Clover-2, EAGLE-1, EAGLE-3) for Llama-family models
in JAX, one jitted tree-verification loop for every method.

The public API (`clover_jax.api`):

    import clover_jax

    model = clover_jax.load()                # the shipped reference model; or "smollm2", a checkpoint
                                             # directory, a .gguf file, a Hub id
    gen = model.generator("clover2")         # with the heads shipped beside the model
    out = gen.generate(["def fibonacci(n):"], max_new_tokens=64)
    out.texts, out.tokens, out.tau, out.tokens_per_second, out.finish_reasons

The names are imported on first use, so that importing a light submodule (`clover_jax.errors`, as the
tools' argument parsing does) does not import JAX.
"""

import importlib

_EXPORTS = {
    "load": "clover_jax.api",
    "Model": "clover_jax.api",
    "TextGenerator": "clover_jax.api",
    "Generation": "clover_jax.api",
    "DTYPES": "clover_jax.api",
    "LoadedDrafter": "clover_jax.plan.factory",
    "METHODS": "clover_jax.plan.factory",
    "SamplingConfig": "clover_jax.engine.sampling",
    "CloverError": "clover_jax.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'clover_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # found once; later look-ups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
