"""SpecForge 0.2.0's DSpark and Domino checkpoints (`DSparkDraftModel`, `DominoDraftModel`), read and
written by `formats.specforge_dspark` and `formats.specforge_domino`, against SpecForge's own code: what
their save_pretrained writes loads here and drafts their blocks (the first after the prompt and the one
after rejected slots, as their `_sample_draft_tokens` draws them); what we export, their
from_pretrained loads and drafts ours. Bad checkpoints are one line each."""

from __future__ import annotations

import dataclasses
import json

import pytest

from clover_jax.errors import CloverError
from clover_jax.io import formats
from clover_jax.io.heads_dir import load_heads
from conftest import assert_one_line
from test_dflash import MASK, qwen3  # noqa: F401
from test_dspark import RANK, perturbed, specforge_model, the_blocks_are_theirs
from test_dspark import their_chain as dspark_chain
from test_domino import SIZES
from test_domino import their_chain as domino_chain

torch = pytest.importorskip("torch")
dspark = pytest.importorskip("specforge.modeling.draft.dspark", reason="SpecForge 0.2.0: pip install specforge==0.2.0")
domino = pytest.importorskip("specforge.modeling.draft.domino", reason="SpecForge 0.2.0: pip install specforge==0.2.0")

# (method, their class, their drafting, our options = their dflash_config keys)
CASES = {
    "dspark-vanilla": ("dspark", dspark.DSparkDraftModel, dspark_chain, {"markov_rank": RANK}),
    "dspark-gated": ("dspark", dspark.DSparkDraftModel, dspark_chain,
                     {"markov_rank": RANK, "markov_head_type": "gated"}),
    "dspark-rnn": ("dspark", dspark.DSparkDraftModel, dspark_chain, {"markov_rank": RANK, "markov_head_type": "rnn"}),
    "domino": ("domino", domino.DominoDraftModel, domino_chain, SIZES),
    "domino-prefix": ("domino", domino.DominoDraftModel, domino_chain, {**SIZES, "pure_draft_prefix_len": 1}),
}


def saved(base, case: str, out, **extra):
    """Their tiny random model of `case`, written by their save_pretrained into `out`."""
    method, cls, _, options = CASES[case]
    model = specforge_model(base, cls, seed=len(case), **options, **extra)
    model.save_pretrained(str(out))
    return model


@pytest.mark.parametrize("case", CASES)
def test_their_checkpoint_drafts_their_blocks(qwen3, tmp_path, case):
    hf, base = qwen3
    method, _, chain, _ = CASES[case]
    model = saved(base, case, tmp_path)
    assert formats.recognise(tmp_path).NAME == method
    drafter = load_heads(tmp_path, base)
    assert drafter.hcfg.method == method
    the_blocks_are_theirs(model, hf, base, drafter, chain)


def test_their_confidence_head_and_older_names_are_read_as_theirs_are(qwen3, tmp_path):
    """A DSpark with a confidence head (which never changes a draft) and its heads under `logit_head.`,
    as SpecForge's earlier checkpoints kept them and their load_state_dict hook maps back (their
    from_pretrained, under transformers 5, does not call it)."""
    from safetensors.torch import load_file, save_file

    hf, base = qwen3
    model = saved(base, "dspark-rnn", tmp_path, confidence_head_alpha=0.5, confidence_head_with_markov=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("confidence_head.") for k in tensors)
    older = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
             for k, v in tensors.items()}
    save_file(older, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    again = dspark.DSparkDraftModel(model.config).to(torch.float32).eval()
    again.load_state_dict(older)
    the_blocks_are_theirs(again, hf, base, load_heads(tmp_path, base), dspark_chain)


@pytest.mark.parametrize("case", ["dspark-gated", "dspark-rnn", "domino-prefix"])
def test_our_export_loads_in_specforge_and_drafts_ours(qwen3, tmp_path, case):
    hf, base = qwen3
    method, cls, chain, options = CASES[case]
    drafter = perturbed(base, method, mask_token_id=MASK, **options)
    formats.exporter(method).export(drafter, base, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [cls.__name__] and config["block_size"] == drafter.block_size
    theirs = cls.from_pretrained(str(tmp_path), attn_implementation="eager").to(torch.float32).eval()
    assert theirs.block_size == drafter.block_size and theirs.mask_token_id == MASK
    the_blocks_are_theirs(theirs, hf, base, drafter, chain)
    again = load_heads(tmp_path, base).hcfg
    assert dataclasses.replace(again, draft_layer=None) == drafter.hcfg  # the draft layer's keys now stated


def test_only_its_own_method_exports_as_a_format(qwen3, tmp_path):
    drafter = perturbed(qwen3[1], "domino", **SIZES)
    with pytest.raises(CloverError) as e:
        formats.exporter("dspark").export(drafter, qwen3[1], tmp_path)
    assert "only DSpark drafters export as dspark" in str(e.value)
    assert_one_line(e)


@pytest.mark.parametrize("case, edit, message", [
    ("dspark-rnn", {"projector_type": "domino"}, "projector_type 'domino' is not run here"),
    ("dspark-rnn", {"pure_draft_prefix_len": 2}, "pure_draft_prefix_len 2 is not run here"),
    ("dspark-rnn", {"markov_rank": 0}, "markov_rank=0 must be an integer >= 1"),
    ("dspark-rnn", {"markov_head_type": "lstm"}, "markov_head_type='lstm' must be one of"),
    ("dspark-rnn", {"emb_dim": 8}, "emb_dim is a Domino key, in a DSpark config"),
    ("domino", {"shift_label": True}, "shift_label=True: only False is drafted here"),
    ("domino", {"gru_hidden_dim": None}, "dflash_config has no gru_hidden_dim"),
    ("domino", {"markov_rank": 4}, "markov_rank is a DSpark key, in a Domino config"),
    ("domino", {"gru_layers": 2}, "dflash_config has unknown key 'gru_layers'"),
])
def test_bad_checkpoints_are_one_line_each(qwen3, tmp_path, case, edit, message):
    base = qwen3[1]
    saved(base, case, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in edit.items():
        if value is None:
            config["dflash_config"].pop(key)
        else:
            config["dflash_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CloverError) as e:
        load_heads(tmp_path, base)
    assert message in str(e.value), str(e.value)
    assert_one_line(e)


def test_a_dflash_config_naming_a_correction_key_is_refused(qwen3, tmp_path):
    """SpecForge's plain DFlash (DFlashDraftModel) with their trainer's switches off loads as DFlash;
    a correction's key in it is refused by name."""
    from specforge.modeling.draft.dflash import DFlashDraftModel

    base = qwen3[1]
    specforge_model(base, DFlashDraftModel, pure_draft_prefix_len=0, shift_label=False).save_pretrained(str(tmp_path))
    assert load_heads(tmp_path, base).hcfg.method == "dflash"
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["markov_rank"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CloverError) as e:
        load_heads(tmp_path, base)
    assert "markov_rank is a DSpark key, in a DFlash config" in str(e.value)
    assert_one_line(e)
    assert formats.recognise(tmp_path).NAME == "dflash"
