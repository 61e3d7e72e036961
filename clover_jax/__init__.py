"""clover-jax: speculative decoding (Medusa, Clover, Clover-2, EAGLE-1, EAGLE-3, DFlash) for Llama-family
models in JAX, one jitted tree-verification loop for every method.

The front door (`clover_jax.api`):

    import clover_jax

    model = clover_jax.load()                # the shipped reference model; or "smollm2", a checkpoint
                                             # directory, a .gguf file, a Hub id
    gen = model.generator("clover2")         # with the heads shipped beside the model
    out = gen.generate(["def fibonacci(n):"], max_new_tokens=64)
    out.texts, out.tokens, out.tau, out.tokens_per_second, out.finish_reasons

Every name below is public: the command-line tools (`infer/`, `train/`) and the notebooks build their
models, drafters and generators from these and nothing deeper (tests/test_front_door.py holds them to it);
what training a drafter needs besides (the method table, the losses' helpers, heads on disk) is
`clover_jax.training`'s, a namespace like this one.

- the front door: `load`, `Model`, `TextGenerator`, `Generation`, `DTYPES`, `SamplingConfig`,
  `finish_reason`, `CloverError`;
- drafters: `METHODS` (the draft methods), `load_drafter` and the `LoadedDrafter` it returns (no drafter,
  None, is plain decoding);
- generators, for a tool that drives the engine itself: `make_generator`, `plan_drafting` and the
  `DraftPlan` it decides (the one place `--tree auto` is resolved), `Generator` (plain decoding),
  `SpeculativeGenerator`, `GenerationOutput`, `BUCKETS`, `DEFAULT_LOOP_CHUNK`, `Tree`, `DynamicTree`,
  `resolve_tree`;
- models: `load_pretrained` (a checkpoint's config and weights, no tokenizer), `ModelConfig`, `Llama`;
- prompts and text, as the command line reads and shows them: `read_prompts`, `read_records`,
  `first_prompt`, `load_tokenizer`, `read_chat_template`, `StreamPrinter`.

Three submodules are public as they stand: `clover_jax.io.sources` (where a model or drafter argument's
files are), `clover_jax.io.tokenization` (tokenizer, chat template, EOS ids) and `clover_jax.model.sharding`
(the mesh and the rule table placing every array on it).

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
    "finish_reason": "clover_jax.api",
    "SamplingConfig": "clover_jax.engine.sampling",
    "CloverError": "clover_jax.errors",
    "METHODS": "clover_jax.plan.factory",
    "LoadedDrafter": "clover_jax.plan.factory",
    "load_drafter": "clover_jax.plan.factory",
    "make_generator": "clover_jax.plan.factory",
    "plan_drafting": "clover_jax.plan.factory",
    "DraftPlan": "clover_jax.plan.factory",
    "Generator": "clover_jax.engine.decode",
    "GenerationOutput": "clover_jax.engine.decode",
    "BUCKETS": "clover_jax.engine.decode",
    "SpeculativeGenerator": "clover_jax.engine.speculative",
    "DEFAULT_LOOP_CHUNK": "clover_jax.engine.chunks",
    "Tree": "clover_jax.trees.static",
    "DynamicTree": "clover_jax.trees.dynamic",
    "resolve_tree": "clover_jax.trees.spec",
    "load_pretrained": "clover_jax.io.hf",
    "ModelConfig": "clover_jax.model.config",
    "Llama": "clover_jax.model.llama",
    # The command line's own readers and printer (`clover_jax._cli`), handed to notebook and script users.
    "read_prompts": "clover_jax._cli.prompts",
    "read_records": "clover_jax._cli.prompts",
    "first_prompt": "clover_jax._cli.prompts",
    "load_tokenizer": "clover_jax._cli.chat",
    "read_chat_template": "clover_jax._cli.chat",
    "StreamPrinter": "clover_jax._cli.stream",
}

__all__ = list(_EXPORTS)


def _lazy(module: str, exports: dict[str, str], namespace: dict):
    """A public namespace's module `__getattr__` and `__dir__`: each name of `exports` imported from its
    module on first use and kept in `namespace` (the namespace module's globals), so later look-ups do
    not come here."""
    def getattr_(name: str):
        if name not in exports:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_


__getattr__, __dir__ = _lazy(__name__, _EXPORTS, globals())
