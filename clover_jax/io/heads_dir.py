"""Draft heads on disk: `heads.safetensors` + `heads.json` (config and the base model's fingerprint).

Heads only make sense on the base model they were trained for, so the JSON carries a fingerprint of
that model (architecture plus a digest of a few of its weights), and loading onto any other base is
refused with one line.

An export is one set: every file is written under a temporary name first, then all are renamed into
place in one burst, heads.json last (`files.replace_together`); a kill inside the burst leaves a marker
that readers refuse in one line, so new weights are never loaded under an old config. heads.json records
the sha256 of the files it goes with; what is derived from the heads (a fitted tree.json, train.evaluate's
record in heads.json) goes with the export that replaces them, and a tree.json that names other heads'
hash is ignored with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from clover_jax.io.hf import save_safetensors
from clover_jax.drafters import registry
from clover_jax.drafters.base import SAVED, DraftIds, Drafter
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.vocab import DraftVocab, ranking, resolve_size
from clover_jax.errors import CloverError
from clover_jax.io import formats
from clover_jax.io.files import check_free_space, check_whole, replace_together, sha256, space_errors
from clover_jax.model.layers import from_stored, stored_parts, to_stored
from clover_jax.drafters.eagle3 import legacy_eagle3_layers
from clover_jax.model.llama import Llama
from clover_jax.trees.static import Tree

WEIGHTS = "heads.safetensors"
CONFIG = "heads.json"
TREE = "tree.json"  # a static tree fitted to the heads (train.evaluate --fit-tree --record): `--tree default`
COUNTS = "token_counts.safetensors"  # each token's count in the training targets and probability mass (draft_vocab)


def base_fingerprint(base: Llama) -> str:
    """Architecture + digest of the final norm and a few lm_head rows, rounded to bfloat16 so the same
    checkpoint loaded in float32 or bfloat16 has one fingerprint."""
    h = hashlib.sha256(base.cfg.fingerprint().encode())
    rows = base.lm_head_weight()
    for array in (base.norm.weight[...], rows[:8], rows[-8:]):
        h.update(np.asarray(jax.device_get(array)).astype(ml_dtypes.bfloat16).tobytes())
    return h.hexdigest()[:24]


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _stored_params(heads: Drafter, dtype=None) -> dict[str, np.ndarray]:
    """The heads' parameters as the file holds them: by dotted path, q/k/v apart (`layers.to_stored`),
    floating ones cast to `dtype` (None: as they are; token ids keep theirs). Contiguous: a q part of one
    kv head is a strided view, which safetensors would write as the buffer under it."""
    def cast(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a if dtype is None or np.issubdtype(a.dtype, np.integer) else a.astype(dtype))
    return {_name(part): cast(array) for path, var in nnx.to_flat_state(nnx.state(heads, SAVED))
            for part, array in to_stored(path, np.asarray(jax.device_get(var[...])))}


def export_bytes(heads: Drafter, vocab_size: int, dtype=None) -> int:
    """About how many bytes `save_heads` writes for `heads` stored in `dtype` (None: as they are), for a
    free-space check before hours of training: the weights, the [vocab_size] token counts and mass, and
    a margin."""
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(heads, SAVED)):
        array = var[...]
        floating = dtype is not None and not jnp.issubdtype(array.dtype, jnp.integer)
        total += array.size * (np.dtype(dtype).itemsize if floating else array.dtype.itemsize)
    return total + 12 * vocab_size + (1 << 20)


def save_heads(heads: Drafter, base: Llama, out_dir: str | Path, extra: dict | None = None,
               token_counts: np.ndarray | None = None, dtype=None, token_mass: np.ndarray | None = None) -> Path:
    """Write the heads and their config (plus `extra` metadata, e.g. training figures) to `out_dir`,
    and the counts of the tokens they were trained to predict (for a draft vocabulary) when given, with
    the base model's probability mass at the same positions (`draft_vocab.probability_mass`) if given.
    `dtype` (e.g. bfloat16, half the bytes of float32 training weights): what the weights are stored
    in; loading casts them to the base model's. The set replaces the one there as a whole (see the
    module docstring), with the files derived from the old heads; a full disk is one line, the old set
    left as it was."""
    out = Path(out_dir)
    params = _stored_params(heads, dtype)
    stats = None
    if token_counts is not None:
        stats = {"counts": np.asarray(token_counts, np.int64)}
        if token_mass is not None:
            stats["mass"] = np.asarray(token_mass, np.float32)
    need = sum(a.nbytes for a in params.values()) + sum(a.nbytes for a in (stats or {}).values()) + (1 << 16)
    check_free_space(out, need, note=" for the heads")
    # Derived from the heads being replaced, and (without new counts) the old heads' counts.
    stale = (TREE,) + ((COUNTS,) if stats is None else ())
    with space_errors(out, need, note=" for the heads"), replace_together(out, (WEIGHTS, COUNTS, CONFIG), stale) as tmp:
        save_safetensors(params, tmp[WEIGHTS])
        hashes = {WEIGHTS: sha256(tmp[WEIGHTS])}
        if stats is not None:
            save_safetensors(stats, tmp[COUNTS])
            hashes[COUNTS] = sha256(tmp[COUNTS])
        meta = {"heads": dataclasses.asdict(heads.hcfg), "base_fingerprint": base_fingerprint(base),
                "base_model_type": base.cfg.model_type, "base_hidden_size": base.cfg.hidden_size,
                "base_vocab_size": base.cfg.vocab_size, **(extra or {}), "sha256": hashes}
        tmp[CONFIG].write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


def heads_sha256(heads_dir: str | Path) -> str:
    """The sha256 of the heads' weights file: as heads.json records it, or (heads exported before it
    did) of the file itself. What ties a fitted tree to the heads it was fitted to."""
    recorded = (read_heads_config(heads_dir).get("sha256") or {}).get(WEIGHTS)
    return recorded if isinstance(recorded, str) else sha256(Path(heads_dir) / WEIGHTS)


def read_heads_config(heads_dir: str | Path) -> dict:
    """The parsed `heads.json` of a heads directory (method, head count, base model fingerprint), or a
    one-line error saying what is missing or malformed."""
    path = Path(heads_dir) / CONFIG
    check_whole(heads_dir, "heads")
    if not path.is_file():
        raise CloverError(f"{heads_dir}: no {CONFIG}; heads are a directory written by train.train")
    try:
        meta = json.loads(path.read_text())
        drafter_config(**meta["heads"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CloverError(f"{path}: not a valid heads config ({e})") from None
    return meta


def is_ours(heads_dir: str | Path) -> bool:
    """The directory holds our heads (heads.json, or at least heads.safetensors: ours with a damaged
    config, which reading says), not a drafter another project published (`formats`)."""
    return any((Path(heads_dir) / name).is_file() for name in (CONFIG, WEIGHTS))


def held_out_chain_tau(heads_dir: str | Path | None, sampling: bool = False) -> list[float] | None:
    """The held-out tokens a step that chains through the first 1, 2, ... heads reached, which `--tree auto`
    on a CPU picks its chain depth by: greedy, `val_chain_tau_by_depth` in heads.json; when `sampling`,
    `val_sampled_chain_tau_by_depth` at temperature 1 (each draft kept with the overlap of the two
    distributions), which stands for every temperature above 0: at lower ones drafts are kept more often,
    so it errs toward decoding plain. train.train's own figure, else one train.evaluate recorded; None
    for heads with neither, no directory (random heads), or a published drafter's (no heads.json: `formats`)."""
    if heads_dir is None or not is_ours(heads_dir):
        return None
    meta = read_heads_config(heads_dir)
    key = "val_sampled_chain_tau_by_depth" if sampling else "val_chain_tau_by_depth"
    found = [m[key] for m in (meta.get("held_out"), meta.get("evaluated")) if isinstance(m, dict) and key in m]
    if not found:
        return None
    taus = found[0]
    if sampling:
        taus = taus.get("1") if isinstance(taus, dict) else None
        if taus is None:
            raise CloverError(f"{Path(heads_dir) / CONFIG}: {key} should map temperature '1' to a list of "
                              "numbers (one per head); delete the entry or measure the heads again with python -m "
                              "train.evaluate")
    if not (isinstance(taus, list) and taus and all(isinstance(t, (int, float)) and t >= 1 for t in taus)):
        raise CloverError(f"{Path(heads_dir) / CONFIG}: {key} should be a list of numbers >= 1, one per head; "
                          "delete the entry or re-export the heads")
    return [float(t) for t in taus]


def load_fitted_tree(heads_dir: str | Path | None, num_heads: int) -> Tree | None:
    """The static tree fitted to the heads in `heads_dir` (its tree.json, written by `train.evaluate
    --fit-tree N --record`), which `--tree default` drafts in place of the method's paper tree; None for
    heads without one, or no directory (random heads), and, with a one-line warning, for a tree.json
    fitted to other heads than these (it names their hash)."""
    if heads_dir is None:
        return None
    check_whole(heads_dir, "heads")
    path = Path(heads_dir) / TREE
    if not path.is_file():
        return None
    tree = Tree.from_file(str(path), num_heads)
    fitted_to = json.loads(path.read_text(encoding="utf-8"))
    fitted_to = fitted_to.get("heads_sha256") if isinstance(fitted_to, dict) else None
    if fitted_to is not None and fitted_to != heads_sha256(heads_dir):
        print(f"warning: {path} was fitted to other heads than the ones now in {heads_dir}; ignoring it (fit "
              "again with train.evaluate --fit-tree N --record)", file=sys.stderr)
        return None
    return tree


def save_fitted_tree(heads_dir: str | Path, tree: Tree, **about) -> Path:
    """Write `tree` as the heads' tree.json, with the hash of the heads it was fitted to."""
    path = Path(heads_dir) / TREE
    tree.to_file(path, **about, heads_sha256=heads_sha256(heads_dir))
    return path


def load_token_stats(heads_dir: str | Path, vocab_size: int) -> dict[str, np.ndarray]:
    """The [V] arrays saved beside the heads: "counts" (greedy token counts) and, for heads exported
    since, "mass" (the base model's probability mass); empty when the heads carry none."""
    path = Path(heads_dir) / COUNTS
    check_whole(heads_dir, "heads")
    if not path.is_file():
        return {}
    try:
        stats = load_file(str(path))
        if "counts" not in stats:
            raise KeyError("no counts tensor")
    except Exception as e:  # safetensors' own error types, or no "counts" tensor
        raise CloverError(f"{path}: cannot read the token counts ({e}); delete the file or re-export the heads") from None
    for name, values in stats.items():
        if values.shape != (vocab_size,):
            raise CloverError(f"{path}: {name} for {values.size} tokens, but the model has {vocab_size}; "
                              "these heads belong to another model")
    return stats


def load_token_counts(heads_dir: str | Path, vocab_size: int, name: str = "counts") -> np.ndarray | None:
    """[V] token counts saved beside the heads (`name` "mass": the probability mass), or None when the
    heads carry none."""
    return load_token_stats(heads_dir, vocab_size).get(name)


def load_draft_vocab(heads_dir: str | Path | None, base: Llama, spec: str | int | None = "auto",
                     greedy: bool = True) -> DraftVocab | None:
    """The draft vocabulary a `--draft-vocab` value (`spec`) asks for, picked with the token counts (or,
    when sampling, the probability mass) saved beside the heads in `heads_dir` (None: heads without
    them, such as random ones); None when that is the whole vocabulary. `greedy` says which `auto`
    means (see `draft_vocab.resolve_size`)."""
    v = base.cfg.vocab_size
    stats = {} if heads_dir is None else load_token_stats(heads_dir, v)
    counts, mass = stats.get("counts"), None if greedy else stats.get("mass")
    size = resolve_size(spec, counts, v, greedy, mass)
    return DraftVocab.most_frequent(base.lm_head_weight(), ranking(counts, mass, greedy), size) if size else None


def load_heads(heads_dir: str | Path, base: Llama, method: str | None = None) -> Drafter:
    """Load heads for `base`: ours (heads.json), or a drafter another project published, in a directory
    without heads.json (`formats.load_drafter`: EAGLE-3 of SpecForge, speculators or the EAGLE authors,
    Medusa-1, EAGLE-1). Refuses heads of another method or trained for another base model."""
    check_whole(heads_dir, "heads")
    if not is_ours(heads_dir) and Path(heads_dir).is_dir():
        return formats.load_drafter(heads_dir, base, method)
    meta = read_heads_config(heads_dir)
    fields = dict(meta["heads"])
    if fields["method"] == "eagle3" and "aux_layer_ids" not in fields:
        # EAGLE-3 heads exported before heads.json named their feature layers drafted from these
        fields["aux_layer_ids"] = list(legacy_eagle3_layers(base.cfg.num_layers))
    hcfg = drafter_config(**fields)
    if method is not None and hcfg.method != method:
        raise CloverError(f"{heads_dir}: holds {hcfg.method} heads, not {method}; pass method={hcfg.method}, "
                          f"or heads= that hold {method} heads", arguments=("method", "heads"))
    if meta.get("base_fingerprint") != base_fingerprint(base):
        raise CloverError(f"{heads_dir}: these heads were trained for another base model "
                          f"(fingerprint {meta.get('base_fingerprint')}); train heads for this model")
    try:
        stored = load_file(str(Path(heads_dir) / WEIGHTS))
    except Exception as e:  # safetensors' own error types for missing or corrupt files
        raise CloverError(f"{heads_dir}: cannot read {WEIGHTS} ({e})") from None
    heads = registry.make_drafter(hcfg, base)
    flat = nnx.to_flat_state(nnx.state(heads, SAVED))
    expected = {_name(part): shape for path, var in flat for part, shape in stored_parts(path, var[...].shape)}
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    if missing or extra:
        name = (missing or extra)[0]
        raise CloverError(f"{heads_dir}: heads file {'lacks' if missing else 'has unexpected'} tensor {name}")
    for name, shape in expected.items():
        if stored[name].shape != shape:
            raise CloverError(f"{heads_dir}: tensor {name} has shape {list(stored[name].shape)}, expected {list(shape)}")
    leaves = []
    for path, var in flat:
        value = from_stored([stored[_name(part)] for part, _ in stored_parts(path, var[...].shape)], var[...].shape)
        if isinstance(var, DraftIds) and not (np.all(np.diff(value) > 0) and 0 <= value.min()
                                              and value.max() < base.cfg.vocab_size):
            raise CloverError(f"{heads_dir}: tensor {_name(path)} holds draft token ids that are not distinct ids of "
                              f"the vocabulary (0..{base.cfg.vocab_size - 1}, ascending)")
        leaves.append((path, var.replace(jnp.asarray(value, dtype=var[...].dtype))))
    nnx.update(heads, nnx.from_flat_state(leaves))
    return heads
