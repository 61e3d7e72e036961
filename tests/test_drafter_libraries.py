"""EAGLE-3 drafter formats against the libraries that write and serve them, both ways: vLLM's
speculators 0.9.0 and SpecForge 0.2.0's `LlamaForCausalLMEagle3` (SGLang's), installed from the package
index without their pinned dependencies (README, running the tests).

What each library writes for a tiny random Llama (speculators: `Eagle3DraftModel.from_training_args`
then `save_pretrained`; SpecForge: the model saved as its SGLang export saves it) loads here unedited
and decodes greedily as plain decoding does; what we export loads there with every tensor equal and its
feature layers resolved against the verifier we name. Settings speculators writes that would change the
drafter's math are refused, one line each. A test skips, saying why, only where a library's pinned
version is not installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import LlamaConfig

import clover_jax
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io import formats
from clover_jax.io.heads_dir import save_heads
from conftest import assert_one_line, tiny_llama_checkpoint
from infer import generate
from train import export

SPECULATORS, SPECFORGE = "speculators==0.9.0", "specforge==0.2.0"
LAYERS, N = 8, 100  # base depth (speculators' default feature layers [2, 4, 5] are distinct); draft vocabulary
PROMPTS = [[1, 5, 9, 14, 3], [1, 44, 2, 7]]
SWITCHES = ("norm_before_residual", "fc_norm", "norm_output")


def library(requirement: str, module: str):
    """`module` of the installed package `requirement` pins, or the test skipped, saying how to install it.
    An import that fails with the package installed is a failure, not a skip."""
    name, version = requirement.split("==")
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != version:
        pytest.skip(f"{requirement} is not installed (found {found}): pip install --no-deps {requirement}, as "
                    "the README's test set-up says")
    return importlib.import_module(module)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Llama (hidden 64, 8 layers) with the repository's tiny tokenizer, as transformers saves it."""
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("base"), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=LAYERS, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model(base_dir):
    return clover_jax.load(base_dir)


@pytest.fixture(scope="module")
def plain(model):
    return model.generator("plain").generate(PROMPTS, 12, stop_at_eos=False).tokens


def vocab_mapping(v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of N of the v tokens, from a random token count, as speculators' trainer builds them."""
    vocab_mapping = library(SPECULATORS, "speculators.train.vocab_mapping")
    counts = np.random.default_rng(0).integers(1, 1000, v)
    return vocab_mapping.build_vocab_mappings_from_distribution(dict(enumerate(counts.tolist())), N, v)


def speculators_drafter(base_dir, out, full_attention=(0,), window: int = 2048, **switches):
    """A speculators EAGLE-3 drafter for the base, written by speculators itself into `out`: its draft
    layer's config built as its trainer builds it (`create_transformer_layer_config`; `full_attention`
    and `window`: its --full-attention-indices and --sliding-window), then `from_training_args` and
    `save_pretrained`."""
    core = library(SPECULATORS, "speculators.models.eagle3")
    cli = library(SPECULATORS, "speculators.train.cli")
    layer = cli.create_transformer_layer_config(str(base_dir), num_layers=1, draft_arch="llama", hidden_act="silu",
                                                sliding_window=window, full_attention_indices=list(full_attention))
    d2t, t2d = vocab_mapping(layer.vocab_size)
    settings = dict(norm_before_residual=True, norm_output=True) | switches
    drafter = core.Eagle3DraftModel.from_training_args(layer, t2d=t2d, d2t=d2t, draft_vocab_size=N, ttt_steps=3,
                                                       verifier_name_or_path=str(base_dir), **settings)
    drafter.save_pretrained(out)
    return drafter


def run_generate(capsys, *argv) -> list[list[int]]:
    """infer.generate's --json token ids for argv."""
    capsys.readouterr()
    assert generate.main([str(a) for a in argv]) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_a_drafter_speculators_writes_decodes_here_as_plain(base_dir, model, tmp_path, capsys):
    """speculators 0.9.0's own files (architectures ['Eagle3DraftModel'], transformers' and speculators'
    bookkeeping fields, its switches on) run unedited through `--heads DIR`: the greedy text is plain
    decoding's, the tensors are speculators', the feature layers its hidden_states indices less one."""
    folder = tmp_path / "speculators"
    theirs = speculators_drafter(base_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DraftModel"] and config["tie_word_embeddings"] is False
    assert formats.recognise(folder).NAME == "speculators"
    drafter = model.drafter("eagle3", heads=folder).drafter
    assert drafter.feature_layers == tuple(i - 1 for i in theirs.config.eagle_aux_hidden_state_layer_ids)
    assert set(drafter.hcfg.switches) == {"norm_before_residual", "norm_output"}
    ids = np.asarray(drafter.ids[...])
    np.testing.assert_array_equal(ids, np.flatnonzero(theirs.t2d.numpy()))
    np.testing.assert_array_equal(np.asarray(drafter.lm_head.kernel[...]).T, theirs.lm_head.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(drafter.fc.kernel[...]).T, theirs.fc.weight.detach().numpy())
    argv = ["--model", base_dir, "--prompt", "def add(a, b):", "--max-new-tokens", 12, "--json"]
    want = run_generate(capsys, *argv)
    got = run_generate(capsys, *argv, "--method", "eagle3", "--heads", folder, "--tree", "widths:3,2,2")
    assert got == want


@pytest.mark.parametrize("switches", [(), SWITCHES])
def test_our_speculators_export_loads_in_speculators(switches, base_dir, model, tmp_path):
    """speculators' `Eagle3DraftModel.from_pretrained` reads our export unedited: every tensor equal,
    our switches, and the feature layers resolved against the verifier our export names (the base
    model's directory here), as vLLM reads them."""
    core = library(SPECULATORS, "speculators.models.eagle3")
    base = model.module
    ours = make_heads(drafter_config("eagle3", draft_vocab=N, switches=switches), base, seed=3)
    ours.set_vocab(base, jnp.asarray(np.sort(np.random.default_rng(1).permutation(base.cfg.vocab_size)[:N])))
    out = export.export(ours, base, tmp_path / "export", "speculators", str(base_dir))
    theirs = core.Eagle3DraftModel.from_pretrained(str(out))
    assert theirs.config.speculators_config.verifier.name_or_path == str(base_dir.resolve())
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in ours.feature_layers]
    assert {s for s in SWITCHES if getattr(theirs.config, s)} == set(switches)
    stored, state = load_file(str(out / "model.safetensors")), theirs.state_dict()
    assert set(stored) <= set(state)
    for name, tensor in stored.items():
        np.testing.assert_array_equal(state[name].numpy(), tensor, err_msg=name)
    np.testing.assert_array_equal((theirs.d2t + torch.arange(N)).numpy(), np.asarray(ours.ids[...]))
    np.testing.assert_array_equal(state["embed_tokens.weight"].numpy(), np.asarray(base.embed_tokens.embedding[...]))


@pytest.mark.parametrize("change, edit, says", [
    ({"norm_before_fc": True}, {}, "norm_before_fc"),
    ({"full_attention": (), "window": 64}, {}, "sliding_attention"),
    ({}, {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({}, {"attention_sinks": 4}, "attention_sinks"),
])
def test_what_speculators_writes_that_we_do_not_run_is_one_line(change, edit, says, base_dir, model, tmp_path):
    """What speculators' trainer writes by default that would change the drafter's math here (one RMSNorm
    over the fused features; a draft layer attending within a window shorter than the base model's
    context), a tied lm_head or a field naming a part we lack (`edit`, written into its config) is
    refused by name, in one line."""
    folder = tmp_path / "speculators"
    speculators_drafter(base_dir, folder, **change)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | edit))
    with pytest.raises(CloverError) as excinfo:
        model.drafter("eagle3", heads=folder)
    assert_one_line(excinfo)
    assert says in str(excinfo.value)


def specforge_drafter(base_dir, out, fc_norm: bool = False):
    """A SpecForge EAGLE-3 drafter for the base (`LlamaForCausalLMEagle3`, its config the target's Llama
    keys with one layer, as SpecForge generates a draft config), written into `out` as SpecForge's SGLang
    export writes one: no embeddings, the state checked by its exporter, legacy RoPE keys added."""
    eagle = library(SPECFORGE, "specforge.modeling.draft.llama3_eagle")
    to_sglang = library(SPECFORGE, "specforge.export.to_sglang")
    checkpoint_io = library(SPECFORGE, "specforge.export.checkpoint_io")
    config = LlamaConfig.from_pretrained(base_dir).to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, tie_word_embeddings=False,
                  draft_vocab_size=N, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
                  **({"fc_norm": True} if fc_norm else {}))
    torch.manual_seed(2)
    drafter = eagle.LlamaForCausalLMEagle3(LlamaConfig.from_dict(config))
    drafter.load_embedding(str(base_dir))
    d2t, t2d = vocab_mapping(config["vocab_size"])
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    state = {k: v for k, v in drafter.state_dict().items() if "embed" not in k.lower()}
    drafter.save_pretrained(out, state_dict=to_sglang._serving_state(state, {}))
    checkpoint_io.apply_legacy_rope_scaling(str(out))
    return drafter


def test_a_drafter_specforge_saves_decodes_here_as_plain(base_dir, model, plain, tmp_path):
    """SpecForge 0.2.0's SGLang export of its `LlamaForCausalLMEagle3` runs here unedited: its tensors, its
    feature layers, and greedy output equal to plain decoding's."""
    folder = tmp_path / "specforge"
    theirs = specforge_drafter(base_dir, folder)
    assert formats.recognise(folder).NAME == "sglang"
    loaded = model.drafter("eagle3", heads=folder)
    drafter = loaded.drafter
    assert drafter.feature_layers == (1, 3, 5) and drafter.hcfg.switches == ()
    np.testing.assert_array_equal(np.asarray(drafter.ids[...]), np.flatnonzero(theirs.t2d.numpy()))
    np.testing.assert_array_equal(np.asarray(drafter.lm_head.kernel[...]).T, theirs.lm_head.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(drafter.fc.kernel[...]).T, theirs.fc.weight.detach().numpy())
    spec = model.generator(heads=loaded, tree="widths:3,2,2").generate(PROMPTS, 12, stop_at_eos=False)
    assert spec.tokens == plain


@pytest.mark.parametrize("switches", [(), ("fc_norm",)])
def test_our_sglang_export_loads_in_specforge(switches, base_dir, model, tmp_path):
    """SpecForge's `LlamaForCausalLMEagle3.from_pretrained` reads our SGLang export unedited: every tensor
    equal (the embeddings, which the format leaves to the target, from SpecForge's `load_embedding`),
    its fc_norm switch, the feature layers in its eagle_config."""
    eagle = library(SPECFORGE, "specforge.modeling.draft.llama3_eagle")
    base = model.module
    ours = make_heads(drafter_config("eagle3", draft_vocab=N, switches=switches), base, seed=4)
    ours.set_vocab(base, jnp.asarray(np.sort(np.random.default_rng(2).permutation(base.cfg.vocab_size)[:N])))
    out = export.export(ours, base, tmp_path / "export", "sglang", str(base_dir))
    theirs = eagle.LlamaForCausalLMEagle3.from_pretrained(str(out))
    theirs.load_embedding(str(base_dir))
    assert theirs.config.eagle_config["eagle_aux_hidden_state_layer_ids"] == list(ours.feature_layers)
    assert (theirs.fc_norm is not None) == ("fc_norm" in switches)
    stored, state = load_file(str(out / "model.safetensors")), theirs.state_dict()
    assert set(state) - set(stored) == {"embed_tokens.weight"}
    for name, tensor in stored.items():
        np.testing.assert_array_equal(state[name].numpy(), tensor, err_msg=name)
    np.testing.assert_array_equal((theirs.d2t + torch.arange(N)).numpy(), np.asarray(ours.ids[...]))
    np.testing.assert_array_equal(state["embed_tokens.weight"].numpy(), np.asarray(base.embed_tokens.embedding[...]))


def test_exports_name_a_verifier_the_other_side_resolves(base_dir, model, tmp_path, monkeypatch):
    """The verifier an export names: a named model's Hub id, the directory the heads were trained on made
    absolute, a Hub id as it is; train.export's --verifier over all of them."""
    assert export.verifier_name("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert export.verifier_name("gemma3") == "google/gemma-3-270m"
    assert export.verifier_name("org/model") == "org/model"
    monkeypatch.chdir(base_dir.parent)
    assert export.verifier_name(base_dir.name) == str(base_dir.resolve())
    base = model.module
    heads = save_heads(make_heads(drafter_config("eagle3"), base), base, tmp_path / "heads",
                       extra={"training": {"base": base_dir.name}})
    for extra, want in (((), str(base_dir.resolve())), (("--verifier", "org/served-model"), "org/served-model")):
        out = tmp_path / f"out{len(extra)}"
        assert export.main(["--heads", str(heads), "--format", "speculators", "--out", str(out), *extra]) == 0
        config = json.loads((out / "config.json").read_text())
        assert config["speculators_config"]["verifier"]["name_or_path"] == want
