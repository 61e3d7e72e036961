"""The training interface: what training a drafter on a frozen base model needs beyond `clover_jax`'s own
names (the base model, `Llama`, `load_pretrained`, `ModelConfig`, `DTYPES`, `Tree`, ... stay there).
`train/` imports the library through these two, `clover_jax.errors`, the tools' `clover_jax._cli` and the
public modules (`io.sources`, `io.tokenization`); tests/test_front_door.py lists its few deeper reaches.

    from clover_jax import Llama, load_pretrained
    from clover_jax.training import registry, drafter_config, save_heads

    base = load_pretrained("models/reference")[1]   # (config, model)
    drafter = registry.make_drafter(drafter_config("clover2"), base)
    ...                                             # train drafter's parameters, base's stop_gradient-ed
    save_heads(drafter, base, "runs/clover2/heads")

- drafters: `registry` (the method table: `get(name)` a `Method` with its drafter, config, depth, tree and
  loss; `names()`, `title(name)`, `make_drafter(config, base)`, `register` for a new method),
  `drafter_config` (a method's config, its options checked by name), `Drafter` (the base class every
  drafter subclasses), `HEADS` (the methods whose drafters are draft heads);
- the loss helpers a training step and its metrics share: `shift_left`, `shifted`, `targets_and_masks`,
  `masked_mean` (a method's own loss is its `Method.loss`);
- the draft vocabulary: `DraftVocab` and what it is chosen from, `token_counts` (greedy targets' counts)
  and `probability_mass` (the base model's, for sampling);
- the heads directory, a trained drafter on disk: `save_heads`, `load_heads`, `read_heads_config`,
  `is_ours`, `export_bytes` (its size, for a free-space check before training), `base_fingerprint` (what
  heads and datasets are tied to), `load_token_counts`, `save_fitted_tree`, `load_fitted_tree`, and its
  file names `WEIGHTS`, `CONFIG`, `TREE`;
- the base model, trained or read: `save_pretrained` (a Hugging Face checkpoint) and `causal_self_mask`
  (the [B, T, T] mask of a cache-free forward over a whole sequence);
- many devices and processes: `shard_module`, `onto_mesh`, `put_batch` (from `clover_jax.model.sharding`,
  the mesh and its rule table), and `to_host` (a device array as NumPy, gathered across processes).

The names are imported on first use, as `clover_jax`'s are, so importing this module imports no JAX.
"""

from clover_jax import _lazy

_EXPORTS = {
    "registry": "clover_jax.drafters",
    "drafter_config": "clover_jax.drafters.registry",
    "Drafter": "clover_jax.drafters.base",
    "HEADS": "clover_jax.drafters",
    "shift_left": "clover_jax.drafters.losses",
    "shifted": "clover_jax.drafters.losses",
    "targets_and_masks": "clover_jax.drafters.losses",
    "masked_mean": "clover_jax.drafters.losses",
    "DraftVocab": "clover_jax.drafters.vocab",
    "token_counts": "clover_jax.drafters.vocab",
    "probability_mass": "clover_jax.drafters.vocab",
    "save_heads": "clover_jax.io.heads_dir",
    "load_heads": "clover_jax.io.heads_dir",
    "read_heads_config": "clover_jax.io.heads_dir",
    "is_ours": "clover_jax.io.heads_dir",
    "export_bytes": "clover_jax.io.heads_dir",
    "base_fingerprint": "clover_jax.io.heads_dir",
    "load_token_counts": "clover_jax.io.heads_dir",
    "save_fitted_tree": "clover_jax.io.heads_dir",
    "load_fitted_tree": "clover_jax.io.heads_dir",
    "WEIGHTS": "clover_jax.io.heads_dir",
    "CONFIG": "clover_jax.io.heads_dir",
    "TREE": "clover_jax.io.heads_dir",
    "save_pretrained": "clover_jax.io.hf",
    "causal_self_mask": "clover_jax.model.llama",
    "shard_module": "clover_jax.model.sharding",
    "onto_mesh": "clover_jax.model.sharding",
    "put_batch": "clover_jax.model.sharding",
    "to_host": "clover_jax.engine.decode",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = _lazy(__name__, _EXPORTS, globals())
