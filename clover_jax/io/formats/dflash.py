"""DFlash-family drafters as their authors' `dflash` package and SpecForge write and load them.

config.json: a Qwen3 config of the draft layers (num_hidden_layers draft layers of the target's width,
q/k norms, SwiGLU) with `architectures` naming the class, `num_target_layers` and `dflash_config`
{block_size (16 when absent), target_layer_ids (outputs of decoder layers, 0-based; absent: the
authors' `build_target_layer_ids`), mask_token_id, and optionally input_embedding_scale,
output_multiplier, final_logit_softcapping}; as the package reads them, a key in dflash_config wins
over the same key at the top level (SpecForge reads block_size at the top level only; exports write it
in both places). model.safetensors: fc.weight [D, F*D], hidden_norm.weight,
layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
mlp.{gate,up,down}_proj}.weight, norm.weight; no embeddings or lm_head (the target's).

Each class is a `Variant` (`VARIANTS`), read here and named by a thin format module:
- `DFlashDraftModel` (this module; the `dflash` package's and SpecForge 0.2.0's, whose dflash_config may
  also say projector_type null, pure_draft_prefix_len 0 and shift_label false);
- `DFlash2DraftModel` (`formats.dflash2`): dflash_config's conv_kernel_size, conv_group_size,
  selector_rank and selector_top_k, and the tensors layers.N.{attention_conv, mlp_conv}.{base_kernel,
  kernel_projection.weight} and candidate_selector.{predecessor_codebook, successor_codebook,
  hidden_projection.weight} (the codebooks without `.weight` as published, or with it as the package's
  save_pretrained writes them);
- SpecForge's `DSparkDraftModel` (`formats.specforge_dspark`): projector_type "dspark", markov_rank,
  markov_head_type, attention_mode (gqa or mha, a check of the head counts) and the confidence head's
  keys, and the tensors markov_head.{markov_w1.weight, markov_w2.weight, gate_proj.*, joint_proj.*};
  the confidence head (`confidence_head.proj.*`) only predicts acceptance for their early stopping and
  never changes a draft, so it is read past, and exports have none;
- SpecForge's `DominoDraftModel` (`formats.specforge_domino`): projector_type "domino", emb_dim,
  gru_hidden_dim, pure_draft_prefix_len, shift_label (false only), and the tensors
  prefix_gru.{weight_ih_l0, weight_hh_l0} and embed_proj.{0, 2}.weight.
SpecForge's older checkpoints kept those heads under `logit_head.`; that prefix is read as theirs does.
A key of one variant in another's config, or any key none has, is refused by name.
"""

from __future__ import annotations

import dataclasses
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
# dflash_config's keys every variant has (read there first, then at the top level), with the package's defaults.
OPTIONS = {"block_size": 16, "target_layer_ids": None, "mask_token_id": None, "input_embedding_scale": 1.0,
           "output_multiplier": 1.0, "final_logit_softcapping": None}
REQUIRED = object()  # a variant's key without a default
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
CONFIDENCE = ("attention_mode", "confidence_head_alpha", "enable_confidence_head", "confidence_head_with_markov")
OLD_PREFIX = "logit_head."  # SpecForge's earlier checkpoints' container of the correction heads


@dataclasses.dataclass(frozen=True)
class Variant:
    """One DFlash-family class as checkpoints name it: `keys` (its dflash_config keys beyond OPTIONS, as
    our config's options, with defaults or REQUIRED), `fixed` (keys read only at these values: what it
    does not run otherwise), `passed` (keys read past: they change no draft), `renames` (their tensor
    name -> ours, both ways), `aliases` (other names of ours read on load) and `skipped` (prefixes of
    tensors read past)."""

    architecture: str
    method: str
    keys: dict = dataclasses.field(default_factory=dict)
    fixed: dict = dataclasses.field(default_factory=dict)
    passed: tuple = ()
    renames: dict = dataclasses.field(default_factory=dict)
    aliases: dict = dataclasses.field(default_factory=dict)
    skipped: tuple = ()


SPECFORGE = {"pure_draft_prefix_len": 0, "shift_label": False}  # their DFlash trainer's switches, off
VARIANTS = {
    "dflash": Variant("DFlashDraftModel", "dflash", fixed={"projector_type": None, **SPECFORGE}),
    "dflash2": Variant("DFlash2DraftModel", "dflash2",
                       keys=dict.fromkeys(("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
                                          REQUIRED),
                       aliases={f"{c}.weight": c for c in CODEBOOKS}),  # the package's save_pretrained keeps .weight
    "dspark": Variant("DSparkDraftModel", "dspark", keys={"markov_rank": REQUIRED, "markov_head_type": "vanilla"},
                      fixed={"projector_type": "dspark", **SPECFORGE}, passed=CONFIDENCE,
                      renames={"markov_head.markov_w1.weight": "markov_head.markov_w1"}, skipped=("confidence_head.",)),
    "domino": Variant("DominoDraftModel", "domino",
                      keys={"emb_dim": REQUIRED, "gru_hidden_dim": REQUIRED, **SPECFORGE},
                      fixed={"projector_type": "domino"},
                      renames={"embed_proj.0.weight": "embed_proj.up.weight", "embed_proj.2.weight": "embed_proj.out.weight"}),
}
ARCHITECTURES = {v.architecture: v for v in VARIANTS.values()}
ALL_KEYS = {k for v in VARIANTS.values() for k in (*v.keys, *v.fixed, *v.passed)}
OWN_KEYS = ("architectures", "auto_map", "dflash_config", "num_target_layers", "is_causal", *OPTIONS, *ALL_KEYS)


def variant_of(config: dict) -> Variant | None:
    """The variant a config.json names; DFlash's for one with a dflash_config or a DFlash-like
    architecture we do not know (so its load names what it says); None for no DFlash-family config."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    if len(archs) == 1 and archs[0] in ARCHITECTURES:
        return ARCHITECTURES[archs[0]]
    if "dflash_config" in config or any("DFlash" in str(a) for a in archs):
        return VARIANTS["dflash"]
    return None


def matches_variant(folder: Path, method: str) -> bool:
    """`folder`'s config.json is of the variant `method` names."""
    variant = variant_of(read_config(folder, strict=False))
    return variant is not None and variant.method == method


def matches(folder: Path) -> bool:
    """A config.json with a dflash_config or a DFlash architecture, not one of the other variants'."""
    return matches_variant(folder, METHOD)


def _options(config: dict, where: Path, variant: Variant) -> dict:
    """dflash_config's values (dflash_config first, then the top level) for `variant`, checked: one line
    for a key no variant has, another variant's key, a fixed key at another value, or a REQUIRED one
    missing."""
    own = config.get("dflash_config") or {}
    if not isinstance(own, dict):
        raise CloverError(f"{where}: dflash_config {own!r} is not an object")
    mine = {*variant.keys, *variant.fixed, *variant.passed}
    for key in sorted(ALL_KEYS - mine):
        if key in own or key in config:
            owner = next(v for v in VARIANTS.values() if key in (*v.keys, *v.fixed, *v.passed))
            raise CloverError(f"{where}: {key} is a {registry.title(owner.method)} key, in a "
                              f"{registry.title(variant.method)} config; a {registry.title(owner.method)} drafter "
                              f"says architectures [{owner.architecture!r}]")
    known = {**OPTIONS, **variant.keys}
    odd = sorted(set(own) - set(known) - mine)
    if odd:
        raise CloverError(f"{where}: dflash_config has unknown key {odd[0]!r}; it holds {', '.join([*known, *variant.fixed])}")
    values = {k: own.get(k, config.get(k, default)) for k, default in known.items()}
    for key, value in variant.fixed.items():
        given = own.get(key, config.get(key, value))
        if given != value:
            raise CloverError(f"{where}: {key} {given!r} is not run here; a {variant.architecture} drafter is read "
                              f"with {key} {value!r}")
    missing = [k for k, v in values.items() if v is REQUIRED]
    if missing:
        raise CloverError(f"{where}: dflash_config has no {missing[0]}, which a {variant.architecture} drafter needs")
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
    return load_as(folder, base, METHOD)


def load_as(folder: Path, base: Llama, method: str):
    """The drafter of the variant `method` names (a VARIANTS key) in `folder`, as ours for `base`."""
    variant = VARIANTS[method]
    folder = Path(folder)
    where = folder / "config.json"
    config = read_config(folder)
    if not config:
        raise CloverError(f"{folder}: no config.json; a DFlash drafter's directory has one beside its weights")
    if config.get("architectures") != [variant.architecture]:
        raise CloverError(f"{where}: architectures {config.get('architectures')!r} is no DFlash-family drafter we "
                          f"read ({', '.join(f'[{a!r}]' for a in ARCHITECTURES)})")
    options = _options(config, where, variant)
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
    try:
        hcfg = drafter_config(method, options["block_size"] - 1, draft_layers=cfg.num_layers,
                              draft_layer=layer_keys(cfg), target_layer_ids=None if ids is None else list(ids),
                              mask_token_id=mask, input_embedding_scale=options["input_embedding_scale"],
                              output_multiplier=options["output_multiplier"],
                              final_logit_softcapping=options["final_logit_softcapping"],
                              **{k: options[k] for k in variant.keys})
        drafter = registry.make_drafter(hcfg, base)
    except CloverError as e:
        raise CloverError(f"{where}: {e}") from None
    wfile = folder / WEIGHTS[0]
    tensors = {}
    for name, array in read_tensors(folder, WEIGHTS).items():
        name = name.removeprefix(OLD_PREFIX)
        name = variant.renames.get(name, variant.aliases.get(name, name))
        if name in tensors:
            raise CloverError(f"{wfile}: holds {name} twice (under two of its names); one is expected")
        tensors[name] = array
    skipped = tuple(n for n in tensors if n.startswith(variant.skipped)) if variant.skipped else ()
    unexpected(tensors, read_params(drafter, tensors, wfile, ""), wfile, allowed=skipped)
    return drafter


def export(drafter, base: Llama, out: Path) -> Path:
    """Write our DFlash drafter as the authors' package saves one (config.json and model.safetensors, its
    tensors in its own dtype), which `DFlashDraftModel.from_pretrained` loads."""
    return export_as(drafter, base, out, METHOD, NAME)


def export_as(drafter, base: Llama, out: Path, method: str, name: str) -> Path:
    """`export` for the variant `method` names (format `name`, for messages): DFlash 2's codebooks are
    written without `.weight` as published (what `DFlash2DraftModel.from_pretrained` maps back)."""
    if drafter.hcfg.method != method:
        raise CloverError(f"only {registry.title(method)} drafters export as {name}; these are "
                          f"{registry.title(drafter.hcfg.method)}'s")
    variant, hcfg = VARIANTS[method], drafter.hcfg
    own = {"block_size": drafter.block_size, "target_layer_ids": list(drafter.feature_layers),
           "mask_token_id": hcfg.mask_token_id, **{k: getattr(hcfg, k) for k in variant.keys},
           **({"projector_type": variant.fixed["projector_type"]} if variant.fixed.get("projector_type") else {})}
    for key in ("input_embedding_scale", "output_multiplier"):
        if getattr(hcfg, key) != 1.0:
            own[key] = getattr(hcfg, key)
    if hcfg.final_logit_softcapping:
        own["final_logit_softcapping"] = hcfg.final_logit_softcapping
    layer_cfg = drafter.layer_cfg
    if "attention_mode" in variant.passed:  # DSpark checks it against the head counts
        own["attention_mode"] = "gqa" if layer_cfg.num_kv_heads < layer_cfg.num_heads else "mha"
    layer = layer_cfg.to_hf_dict()
    for key in ("bos_token_id", "eos_token_id"):
        layer.pop(key, None)
    config = {**layer, "architectures": [variant.architecture], "vocab_size": base.cfg.vocab_size,
              "block_size": drafter.block_size, "num_target_layers": base.cfg.num_layers, "dflash_config": own,
              "torch_dtype": stored_dtype(drafter)}
    theirs = {ours: their for their, ours in variant.renames.items()}
    tensors = {theirs.get(k, k): v for k, v in write_params(drafter, "").items()}
    return write_export(out, tensors, config, stale=("model.safetensors.index.json",))
