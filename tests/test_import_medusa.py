"""Medusa-1 heads in and out (`clover_jax.io.formats.medusa1`), and the pickle conversion step
(`infer.convert_pickle`).

Tiny random Medusa-1 checkpoints, written as Medusa writes them (the state dict of its `medusa_head`:
`tests/reference_medusa.py`) as safetensors and as a pickle converted once, give Medusa's own head logits
in clover-jax; our heads exported and read back draft the same; greedy speculative decoding with
imported heads writes plain decoding's text; bad checkpoints and pickles that are not weights only are
one line each and write nothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import pickle
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import reference_medusa
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.engine.decode import Generator
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.io import sources
from clover_jax.io.formats import medusa1
from clover_jax.io.formats.weights import converted_dir
from clover_jax.io.heads_dir import load_heads, save_heads
from clover_jax.model.llama import causal_self_mask
from clover_jax.plan import factory
from clover_jax.trees.spec import resolve_tree
from conftest import PROMPTS, assert_one_line
from infer import convert_pickle

K = 3  # heads in the checkpoints; their configs say 2, as the published ones misstate it


pytestmark = pytest.mark.usefixtures("cache")  # a cache of each test's own: converted pickles land there


@pytest.fixture
def base(loaded):
    return loaded("llama2")[3]


def write_checkpoint(folder, heads, layers: int, kind: str = "safetensors", **config):
    """`heads` (the reference's ModuleList) as a Medusa-1 folder: config.json and medusa_lm_head.<kind>."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"medusa_num_heads": 2, "medusa_num_layers": layers, "base_model_name_or_path": "tiny/llama2", **config}
    (folder / "config.json").write_text(json.dumps(fields))
    state = heads.state_dict()
    if kind == "pt":
        torch.save(state, folder / "medusa_lm_head.pt")
    else:  # each copy of a repeated block its own array: safetensors.torch refuses tensors that share memory
        save_file({k: v.numpy().copy() for k, v in state.items()}, str(folder / "medusa_lm_head.safetensors"))
    return folder


def hidden_normed(base, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return base(jnp.asarray(tokens), positions, causal_self_mask(b, t)).hidden_normed


def our_logits(drafter, base, normed, vocab=None):
    return np.stack([np.asarray(drafter.node_logits(base, k, normed, None, vocab)) for k in range(drafter.depth)])


def convert(folder, capsys, *extra):
    capsys.readouterr()
    code = convert_pickle.main([str(folder), *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
@pytest.mark.parametrize("layers", [1, 2])
def test_medusa1_heads_give_medusas_own_logits(kind, layers, base, tmp_path, capsys):
    cfg = base.cfg
    ref = reference_medusa.random_heads(cfg.hidden_size, cfg.vocab_size, K, layers, seed=layers)
    folder = write_checkpoint(tmp_path / "medusa", ref, layers, kind)
    if kind == "pt":
        code, out, _ = convert(folder, capsys)
        assert code == 0 and "medusa_lm_head.pt: converted (weights only)" in out
        assert convert(folder, capsys)[1].count("already converted") == 1
    assert medusa1.matches(folder)
    drafter = medusa1.load(folder, base)
    assert drafter.depth == K and drafter.hcfg.head_layers == layers and drafter.hcfg.own_lm_head
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 7), dtype=np.int32)
    normed = hidden_normed(base, tokens)
    want = reference_medusa.head_logits(ref, torch.from_numpy(np.array(normed))).numpy()
    np.testing.assert_allclose(our_logits(drafter, base, normed), want, atol=1e-4, rtol=1e-4)
    # Over a draft vocabulary: the same logits, the vocabulary's columns of each head's own projection.
    vocab = DraftVocab.most_frequent(base.lm_head_weight(), None, 20)
    np.testing.assert_allclose(our_logits(drafter, base, normed, vocab), want[..., :20], atol=1e-4, rtol=1e-4)
    # Training sees the same heads: train_forward's logits at every position are the drafting ones.
    _, trained = drafter.train_forward(base, jnp.asarray(tokens), None, normed)
    np.testing.assert_allclose(np.asarray(trained), want, atol=1e-4, rtol=1e-4)


def test_our_heads_exported_and_imported_draft_identically(base, tmp_path):
    ours = make_heads(drafter_config("medusa", 4), base, seed=1)
    for block in ours.blocks:  # trained-looking blocks, not the zero initialisation
        block.linear.kernel[...] = 0.2 * jnp.asarray(np.random.default_rng(0).normal(size=block.linear.kernel.shape))
        block.linear.bias[...] = jnp.full(block.linear.bias.shape, 0.1)
    out = medusa1.export(ours, base, tmp_path / "export", base_name="tiny/llama2")
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 4 and config["medusa_num_layers"] == 1
    assert config["base_model_name_or_path"] == "tiny/llama2"
    stored = load_file(str(out / "medusa_lm_head.safetensors"))
    np.testing.assert_array_equal(stored["2.1.weight"], np.asarray(base.lm_head_weight()))  # lm_head copied
    back = medusa1.load(out, base)
    normed = hidden_normed(base, np.asarray([[3, 9, 27, 40, 5]], np.int32))
    np.testing.assert_allclose(our_logits(back, base, normed), our_logits(ours, base, normed), atol=1e-6, rtol=1e-6)

    # Imported heads (two ResBlock applications, projections of their own) survive our heads format and
    # a second Medusa-1 export byte for byte.
    ref = reference_medusa.random_heads(base.cfg.hidden_size, base.cfg.vocab_size, K, 2)
    imported = medusa1.load(write_checkpoint(tmp_path / "medusa", ref, 2), base)
    again = load_heads(save_heads(imported, base, tmp_path / "ours"), base, "medusa")
    assert again.hcfg == imported.hcfg
    np.testing.assert_array_equal(our_logits(again, base, normed), our_logits(imported, base, normed))
    first = load_file(str(medusa1.export(imported, base, tmp_path / "one") / "medusa_lm_head.safetensors"))
    second = load_file(str(medusa1.export(again, base, tmp_path / "two") / "medusa_lm_head.safetensors"))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)


def test_greedy_speculative_decoding_with_imported_heads_is_plain_decoding(base, tmp_path):
    cfg = base.cfg
    ref = reference_medusa.random_heads(cfg.hidden_size, cfg.vocab_size, K, 2, seed=5)
    drafter = medusa1.load(write_checkpoint(tmp_path / "medusa", ref, 2), base)
    plain = Generator(base).generate(PROMPTS, 10, eos_ids=[]).tokens
    # Drafting from half the vocabulary: the heads' own projections, cut to its columns.
    vocab = DraftVocab.most_frequent(base.lm_head_weight(), None, 32)
    gen = SpeculativeGenerator(base, drafter, resolve_tree("widths:4,2,1", "medusa", drafter.depth), draft_vocab=vocab)
    assert gen.generate(PROMPTS, 10, eos_ids=[]).tokens == plain


def _tensors(cfg, layers=1, hidden=None, vocab=None, seed=0):
    ref = reference_medusa.random_heads(hidden or cfg.hidden_size, vocab or cfg.vocab_size, K, layers, seed)
    return {k: v.numpy().copy() for k, v in ref.state_dict().items()}


def _bad(case, cfg):
    """(tensors, config overrides, what the line says) of one bad checkpoint."""
    t = _tensors(cfg)
    if case == "other hidden size":
        return _tensors(cfg, hidden=cfg.hidden_size * 2), {}, "hidden size 64, but the base model's is 32"
    if case == "other vocabulary":
        return _tensors(cfg, vocab=cfg.vocab_size + 1), {}, "scores 65 tokens"
    if case == "config for another base":
        return t, {"hidden_size": 4096}, "hidden_size 4096, but the base model's is 32"
    if case == "missing tensor":
        del t["1.0.linear.bias"]
        return t, {}, "tensor 1.0.linear.bias is missing"
    if case == "misshaped tensor":
        t["2.0.linear.bias"] = t["2.0.linear.bias"][:-1]
        return t, {}, "tensor 2.0.linear.bias has shape [31], expected [32]"
    if case == "foreign name":
        t["lm_head.weight"] = t["0.1.weight"]
        return t, {}, "tensor 'lm_head.weight' is not one of Medusa's heads"
    if case == "a head missing":
        t = {k.replace("2.", "4.", 1) if k.startswith("2.") else k: v for k, v in t.items()}
        return t, {}, "has tensors of head 4 but none of head 2"
    if case == "heads of different depths":
        t = _tensors(cfg, layers=2)
        t = {k: v for k, v in t.items() if not k.startswith("1.")}
        t.update({k: v for k, v in _tensors(cfg).items() if k.startswith("1.")})
        return t, {"medusa_num_layers": None}, "head 1 has 1 ResBlocks but head 0 has 2"
    if case == "config says other layers":
        return t, {"medusa_num_layers": 2}, "medusa_num_layers is 2, but the heads file holds 1"
    if case == "blocks that differ":
        t = _tensors(cfg, layers=2)
        t["0.1.linear.weight"] = t["0.1.linear.weight"] + 1
        return t, {"medusa_num_layers": 2}, "head 0's ResBlocks differ"
    raise AssertionError(case)


BAD = ["other hidden size", "other vocabulary", "config for another base", "missing tensor", "misshaped tensor",
       "foreign name", "a head missing", "heads of different depths", "config says other layers", "blocks that differ"]


@pytest.mark.parametrize("case", BAD)
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(case, base, tmp_path, cache):
    tensors, config, says = _bad(case, base.cfg)
    folder = tmp_path / "medusa"
    folder.mkdir()
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    fields = {"medusa_num_heads": 2, "medusa_num_layers": 1, **config}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    before = sorted(os.listdir(folder))
    with pytest.raises(CloverError) as e:
        medusa1.load(folder, base)
    assert_one_line(e)
    assert says in str(e.value), str(e.value)
    assert sorted(os.listdir(folder)) == before and not cache.exists()


def test_a_pickle_not_converted_is_refused_in_one_line(base, tmp_path, cache):
    ref = reference_medusa.random_heads(base.cfg.hidden_size, base.cfg.vocab_size, K, 1)
    folder = write_checkpoint(tmp_path / "medusa", ref, 1, "pt")
    with pytest.raises(CloverError) as e:
        medusa1.load(folder, base)
    assert_one_line(e)
    assert f"python -m infer.convert_pickle {folder}" in str(e.value)
    assert not cache.exists()


class Payload:
    """What a malicious pickle runs when unpickled: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("content, says", [("an object", "it names argparse.Namespace"),
                                           ("code", "it names io.open"),
                                           ("protocol 4", "Unsupported operand")])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch says so before it refuses the file
def test_convert_refuses_a_pickle_that_is_not_weights_only(content, says, tmp_path, cache, capsys):
    folder = tmp_path / "medusa"
    folder.mkdir()
    marker = tmp_path / "ran"
    path = folder / "medusa_lm_head.pt"
    if content == "an object":  # a checkpoint saved with an object beside its tensors
        torch.save({"0.1.weight": torch.zeros(2, 2), "args": argparse.Namespace(lr=1)}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump({"0.0.linear.weight": Payload(marker)}, f, protocol=2 if content == "code" else 4)
    code, out, err = convert(folder, capsys)
    assert code == 2 and not out
    line = err.strip()
    assert "\n" not in line and "not a weights-only pickle" in line and says in line, err
    assert not marker.exists()  # nothing in the file ran
    assert not cache.exists() or not any(converted_dir().glob("*"))


def test_convert_needs_a_pickle_and_names_the_file_to_use(tmp_path, capsys):
    folder = tmp_path / "heads"
    folder.mkdir()
    (folder / "training_args.bin").write_bytes(b"")  # a trainer's pickle, not weights: left alone
    (folder / "config.json").write_text("{}")
    for extra, says in (((), "no pickle to convert"), (("--file", "config.json"), "not a pickle"),
                        (("--file", "model.pt"), "no such file")):
        code, out, err = convert(folder, capsys, *extra)
        assert code == 2 and not out and says in err and err.count("\n") == 1, err


def fake_hub(monkeypatch, root, repos: dict[str, dict]):
    """huggingface_hub's snapshot_download and file listing over `repos` {id: {file name: local file}}, no
    network: a download copies the files its allow_patterns match into the repository's snapshot folder
    (kept between calls, as the Hugging Face cache is). Returns the (repo id, patterns) of each download."""
    from huggingface_hub import HfApi

    calls = []

    def snapshot_download(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, list(allow_patterns)))
        snap = root / repo_id.replace("/", "--")
        snap.mkdir(parents=True, exist_ok=True)
        for name, src in repos[repo_id].items():
            if fnmatch_any(name, allow_patterns):
                shutil.copyfile(src, snap / name)
        return str(snap)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: list(repos[repo_id]))
    return calls


def test_heads_by_hub_id(base, tmp_path, monkeypatch, capsys):
    ref = reference_medusa.random_heads(base.cfg.hidden_size, base.cfg.vocab_size, K, 1)
    st, pt = write_checkpoint(tmp_path / "st", ref, 1), write_checkpoint(tmp_path / "pt", ref, 1, "pt")
    files = lambda folder: {p.name: p for p in folder.iterdir()}
    calls = fake_hub(monkeypatch, tmp_path / "hub", {"org/medusa-st": files(st), "org/medusa-pt": files(pt)})
    snap = sources.drafter_path("org/medusa-st")
    assert sorted(os.listdir(snap)) == ["config.json", "medusa_lm_head.safetensors"]
    assert medusa1.load(snap, base).depth == K
    assert sources.drafter_path(st) == st  # a local folder is never looked up
    # What --heads org/name and model.drafter(method, "org/name") load through.
    drafter = factory.load_drafter(base, "medusa", heads="org/medusa-st")
    assert drafter.heads_dir == snap and drafter.num_heads == K and drafter.chain_tau is None
    assert drafter.vocab(base) is None and drafter.fitted_tree() is None
    with pytest.raises(CloverError) as e:
        factory.load_drafter(base, "clover", heads="org/medusa-st")
    assert_one_line(e)
    assert "runs as method=medusa" in str(e.value)

    # A repository holding only a pickle: the snapshot takes no pickle, and the line says how to convert it.
    with pytest.raises(CloverError) as e:
        sources.drafter_path("org/medusa-pt")
    assert_one_line(e)
    assert "python -m infer.convert_pickle org/medusa-pt" in str(e.value)
    assert not any(fnmatch_any("medusa_lm_head.pt", patterns) for _, patterns in calls)
    # convert_pickle with the Hub id downloads config and pickle into that snapshot and converts it once;
    # the Hub id then loads.
    code, out, _ = convert("org/medusa-pt", capsys)
    assert code == 0 and "converted (weights only)" in out
    assert fnmatch_any("medusa_lm_head.pt", calls[-1][1])
    normed = hidden_normed(base, np.asarray([[4, 8, 15, 16]], np.int32))
    np.testing.assert_array_equal(our_logits(medusa1.load(sources.drafter_path("org/medusa-pt"), base), base, normed),
                                  our_logits(medusa1.load(st, base), base, normed))


def fnmatch_any(name, patterns):
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def test_a_hub_id_offline_and_not_cached_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CloverError) as e:
        sources.drafter_path("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert_one_line(e)
    assert "Hugging Face Hub cannot be reached" in str(e.value) and "drafter directory" in str(e.value)


def test_heads_config_keeps_medusa_fields_to_medusa(base):
    with pytest.raises(CloverError, match="Clover drafters have no option own_lm_head"):
        drafter_config("clover", 2, own_lm_head=True)
    assert not hasattr(drafter_config("clover", 2, own_lm_head=False), "own_lm_head")  # as older heads.json wrote it
    with pytest.raises(CloverError, match="must be an integer >= 1"):
        drafter_config("medusa", 2, head_layers=0)
    heads = make_heads(drafter_config("medusa", 2, head_layers=3, own_lm_head=True), base)
    np.testing.assert_array_equal(np.asarray(heads.lm_heads[1].kernel[...]), np.asarray(base.lm_head_weight()).T)


def test_convert_help_says_what_it_trusts(capsys):
    with pytest.raises(SystemExit):
        convert_pickle.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "torch.load(..., weights_only=True)" in text and "no code from the file runs" in text
    assert "PyTorch must be installed" in text and "--file NAME" in text
