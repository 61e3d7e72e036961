"""DFlash drafters as their authors' `dflash` package writes and loads them (`DFlashDraftModel`).

config.json: a Qwen3 config of the draft layers (num_hidden_layers draft layers of the target's width,
q/k norms, SwiGLU) with architectures ["DFlashDraftModel"], `num_target_layers` and `dflash_config`
{block_size (16 when absent), target_layer_ids (outputs of decoder layers, 0-based; absent: the
authors' `build_target_layer_ids`), mask_token_id, and optionally input_embedding_scale,
output_multiplier, final_logit_softcapping}; as the package reads them, a key in dflash_config wins
over the same key at the top level. model.safetensors: fc.weight [D, F*D], hidden_norm.weight,
layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
mlp.{gate,up,down}_proj}.weight, norm.weight; no embeddings or lm_head (the target's). DFlash 2
(`DFlash2DraftModel`, read by `formats.dflash2` through `load_as`) adds dflash_config's conv_kernel_size,
conv_group_size, selector_rank and selector_top_k, and the tensors layers.N.{attention_conv,
mlp_conv}.{base_kernel, kernel_projection.weight} and candidate_selector.{predecessor_codebook,
successor_codebook, hidden_projection.weight} (the codebooks without `.weight` as published, or with it
as the package's save_pretrained writes them); in a DFlash config those keys are refused by name.
"""

from __future__ import annotations

from pathlib import Path

from clover_jax.drafters import registry
from clover_jax.drafters.draft_model import layer_keys
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io.formats.eagle3_layout import read_params, stored_dtype, unexpected, write_export, write_params
from clover_jax.io.formats.weights import read_config, read_tensors
from clover_jax.model.config import ModelConfig
from clover_jax.model.llama import Llama

NAME = "dflash"
METHOD = "dflash"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
ARCHITECTURE = "DFlashDraftModel"
# dflash_config's keys (read there first, then at the top level), with the package's defaults.
OPTIONS = {"block_size": 16, "target_layer_ids": None, "mask_token_id": None, "input_embedding_scale": 1.0,
           "output_multiplier": 1.0, "final_logit_softcapping": None}
DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # DFlash 2's, not run here
OWN_KEYS = ("architectures", "auto_map", "dflash_config", "num_target_layers", "is_causal", *OPTIONS, *DFLASH2)


ARCHITECTURE2 = "DFlash2DraftModel"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_dflash2(config: dict) -> bool:
    return config.get("architectures") == [ARCHITECTURE2]


def matches(folder: Path) -> bool:
    """A config.json with a dflash_config or a DFlash architecture, not DFlash 2's (`formats.dflash2`)."""
    config = read_config(folder, strict=False)
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return ("dflash_config" in config or any("DFlash" in str(a) for a in archs)) and not is_dflash2(config)


def _options(config: dict, where: Path, two: bool) -> dict:
    """dflash_config's values (dflash_config first, then the top level), checked; one line for a key the
    package does not have, or of DFlash 2 in a DFlash config (`two` False); DFlash 2's are required."""
    own = config.get("dflash_config") or {}
    if not isinstance(own, dict):
        raise CloverError(f"{where}: dflash_config {own!r} is not an object")
    for key in () if two else DFLASH2:
        if key in own or key in config:
            raise CloverError(f"{where}: {key} is a DFlash 2 key, in a {ARCHITECTURE} config; a DFlash 2 drafter "
                              f"says architectures [{ARCHITECTURE2!r}]")
    known = {**OPTIONS, **(dict.fromkeys(DFLASH2) if two else {})}
    odd = sorted(set(own) - set(known))
    if odd:
        raise CloverError(f"{where}: dflash_config has unknown key {odd[0]!r}; it holds {', '.join(known)}")
    values = {k: own.get(k, config.get(k, default)) for k, default in known.items()}
    missing = [k for k in DFLASH2 if two and values[k] is None]
    if missing:
        raise CloverError(f"{where}: dflash_config has no {missing[0]}, which a DFlash 2 drafter needs")
    b = values["block_size"]
    if isinstance(b, bool) or not isinstance(b, int) or b < 2:
        raise CloverError(f"{where}: block_size {b!r} must be an integer >= 2 (the root and at least one mask position)")
    if values["mask_token_id"] is None:
        raise CloverError(f"{where}: dflash_config has no mask_token_id, which every block's mask positions hold")
    return values


def _layers(config: dict, where: Path, base: Llama) -> ModelConfig:
    """The draft layers' config from the Qwen3 keys, checked against the base model."""
    if config.get("model_type") != "qwen3":
        raise CloverError(f"{where}: model_type {config.get('model_type')!r}; DFlash draft layers are Qwen3's")
    if config.get("is_causal"):
        raise CloverError(f"{where}: is_causal {config['is_causal']!r} (a causal block) is not implemented")
    hf = {k: v for k, v in config.items() if k not in OWN_KEYS}
    try:
        cfg = ModelConfig.from_hf_dict(hf)
    except CloverError as e:
        raise CloverError(f"{where}: the draft layers' {e}") from None
    if cfg.layer_types:
        raise CloverError(f"{where}: sliding_attention draft layers are not implemented (layer_types {list(cfg.layer_types)})")
    d, v = base.cfg.hidden_size, base.cfg.vocab_size
    if cfg.hidden_size != d or cfg.vocab_size != v:
        raise CloverError(f"{where}: hidden_size {cfg.hidden_size} and vocab_size {cfg.vocab_size}, but the base model "
                          f"has {d} and {v}; this drafter belongs to another model")
    return cfg


def load(folder: Path, base: Llama):
    """The DFlash drafter in `folder`, as our DFlash drafter for `base`."""
    return load_as(folder, base, False)


def load_as(folder: Path, base: Llama, two: bool):
    """The DFlash (or, `two`, DFlash 2) drafter in `folder`, as ours for `base`."""
    folder = Path(folder)
    where = folder / "config.json"
    config = read_config(folder)
    if not config:
        raise CloverError(f"{folder}: no config.json; a DFlash drafter's directory has one beside its weights")
    arch = ARCHITECTURE2 if two else ARCHITECTURE
    if config.get("architectures") != [arch]:
        raise CloverError(f"{where}: architectures {config.get('architectures')!r} is no DFlash drafter we read "
                          f"([{ARCHITECTURE!r}] or [{ARCHITECTURE2!r}])")
    options = _options(config, where, two)
    cfg = _layers(config, where, base)
    targets = config.get("num_target_layers", base.cfg.num_layers)
    if targets != base.cfg.num_layers:
        raise CloverError(f"{where}: num_target_layers {targets!r}, but the base model has {base.cfg.num_layers} "
                          "layers; this drafter belongs to another model")
    mask, v = options["mask_token_id"], base.cfg.vocab_size
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < v:
        raise CloverError(f"{where}: mask_token_id {mask!r} is outside the base model's vocabulary (0..{v - 1}); "
                          "this drafter belongs to another model")
    ids = options["target_layer_ids"]
    extra = {k: options[k] for k in DFLASH2} if two else {}
    try:
        hcfg = drafter_config("dflash2" if two else METHOD, options["block_size"] - 1, draft_layers=cfg.num_layers,
                              draft_layer=layer_keys(cfg), target_layer_ids=None if ids is None else list(ids),
                              mask_token_id=mask, input_embedding_scale=options["input_embedding_scale"],
                              output_multiplier=options["output_multiplier"],
                              final_logit_softcapping=options["final_logit_softcapping"], **extra)
        drafter = registry.make_drafter(hcfg, base)
    except CloverError as e:
        raise CloverError(f"{where}: {e}") from None
    tensors = read_tensors(folder, WEIGHTS)
    wfile = folder / WEIGHTS[0]
    for name in CODEBOOKS if two else ():
        if name in tensors and f"{name}.weight" in tensors:
            raise CloverError(f"{wfile}: holds both {name} and {name}.weight; one codebook is expected")
        if f"{name}.weight" in tensors:  # the package's save_pretrained keeps the module's name
            tensors[name] = tensors.pop(f"{name}.weight")
    unexpected(tensors, read_params(drafter, tensors, wfile, ""), wfile)
    return drafter


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our DFlash drafter as the authors' package saves one (config.json and model.safetensors, its
    tensors in its own dtype), which `DFlashDraftModel.from_pretrained` loads."""
    if drafter.hcfg.method != METHOD:
        raise CloverError(f"only DFlash drafters export as {NAME}; these are {registry.title(drafter.hcfg.method)}'s")
    return export_as(drafter, base, out, False)


def export_as(drafter, base: Llama, out: Path, two: bool) -> Path:
    """`export` for DFlash or (`two`) DFlash 2, whose codebooks are written without `.weight` as published
    (what `DFlash2DraftModel.from_pretrained` maps back)."""
    hcfg = drafter.hcfg
    own = {"block_size": drafter.block_size, "target_layer_ids": list(drafter.feature_layers),
           "mask_token_id": hcfg.mask_token_id, **({k: getattr(hcfg, k) for k in DFLASH2} if two else {})}
    for key in ("input_embedding_scale", "output_multiplier"):
        if getattr(hcfg, key) != 1.0:
            own[key] = getattr(hcfg, key)
    if hcfg.final_logit_softcapping:
        own["final_logit_softcapping"] = hcfg.final_logit_softcapping
    layer = drafter.layer_cfg.to_hf_dict()
    for key in ("bos_token_id", "eos_token_id"):
        layer.pop(key, None)
    config = {**layer, "architectures": [ARCHITECTURE2 if two else ARCHITECTURE], "vocab_size": base.cfg.vocab_size,
              "num_target_layers": base.cfg.num_layers, "dflash_config": own, "torch_dtype": stored_dtype(drafter)}
    return write_export(out, write_params(drafter, ""), config, stale=("model.safetensors.index.json",))
