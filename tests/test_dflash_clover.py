"""DFlash + Clover cell (`dflash_clover`): DFlash with a recurrent cell stepping along the tree's paths.

Its default width spends what DFlash 2's selector spends; a fresh cell drafts exactly as DFlash; greedy
speculative output is plain decoding's on a chain, a static and a dynamic tree at batch 1 and 4;
sampling keeps the base distribution; training scores what decoding scores along the data's tokens;
`train.train --backbone` trains the cell alone on a trained DFlash drafter, refuses a resume on another
backbone and a wrong backbone in one line each; a bad option is one line.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file

from clover_jax.drafters.base import Committed, Frontier
from clover_jax.drafters.dflash_clover import cell_params, matched_width, selector_params
from clover_jax.drafters.registry import drafter_config, make_drafter
from clover_jax.engine.decode import Generator, prefill
from clover_jax.engine.drafting import draft_tree
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.io.heads_dir import load_heads
from clover_jax.model.config import ModelConfig
from clover_jax.model.llama import Llama
from clover_jax.trees.spec import resolve_tree
from conftest import assert_one_line

BLOCK = 4
PROMPT = [1, 5, 9, 3, 17, 22, 8]
PROMPTS = [[1, 7, 8, 9], PROMPT, [1, 2], [9] * 11]
OPTIONS = dict(draft_layers=2, target_layer_ids=[0, 1])


def count(module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def perturbed(module, seed: int, keep=lambda path: False, scale: float = 0.3):
    """Add N(0, scale^2) to every parameter but those `keep` names (a path tuple)."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    for (path, var), k in zip(flat, keys):
        if not keep(path):
            var[...] = var[...] + scale * jax.random.normal(k, var[...].shape, var[...].dtype)
    nnx.update(module, nnx.from_flat_state(flat))
    return module


@pytest.fixture(scope="module")
def base():
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(1))


def drafter(base, seed=3, output=True, **options):
    """A dflash_clover drafter of block 4, perturbed (its cell's output too, unless not `output`)."""
    d = make_drafter(drafter_config("dflash_clover", BLOCK - 1, **OPTIONS, **options), base, seed=seed)
    return perturbed(d, seed + 1, keep=lambda path: not output and path[:2] == ("clover_cell", "output"))


def committed(base, drafter, seq, following):
    """The drafter's state after committing every position of `seq` (each followed by `following`'s)."""
    tokens = jnp.asarray([seq], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq) + 8, feature_layers=drafter.feature_layers)
    new = Committed(out.hidden, out.hidden_normed, jnp.asarray([following], jnp.int32), out.features)
    return drafter.commit(base, drafter.init(base, 1, len(seq) + 64), new, jnp.asarray([len(seq)]), jnp.ones((1,), bool))


def test_the_default_width_spends_what_dflash2s_selector_spends(base):
    """cell_params counts the cell; the default width is the widest within the selector's count (SmolLM2:
    D 576, V 49,152: 6,328,320 for the selector at rank 64, 6,319,008 for a cell 927 wide)."""
    d, v = base.cfg.hidden_size, base.cfg.vocab_size
    ours = make_drafter(drafter_config("dflash_clover", BLOCK - 1), base)
    two = make_drafter(drafter_config("dflash2", BLOCK - 1), base)
    assert ours.hcfg.cell_width == matched_width(d, v) and count(ours.clover_cell) == cell_params(d, matched_width(d, v))
    assert count(two.candidate_selector) == selector_params(d, v)
    for dim, vocab in ((d, v), (576, 49152)):
        w = matched_width(dim, vocab)
        assert cell_params(dim, w) <= selector_params(dim, vocab) < cell_params(dim, w + 1)
    assert (selector_params(576, 49152), matched_width(576, 49152), cell_params(576, 927)) == (6328320, 927, 6319008)
    wide = make_drafter(drafter_config("dflash_clover", BLOCK - 1, cell_width=5), base)
    assert wide.hcfg.cell_width == 5 and count(wide.clover_cell) == cell_params(d, 5)


@pytest.mark.parametrize("option, message", [
    ({"cell_width": 0}, "cell_width=0 must be an integer >= 1"),
    ({"cell_width": "wide"}, "cell_width='wide' must be an integer >= 1"),
    ({"selector_rank": 4}, "drafters have no option selector_rank"),
])
def test_a_bad_option_is_one_line(option, message):
    with pytest.raises(CloverError) as e:
        drafter_config("dflash_clover", BLOCK - 1, **option)
    assert_one_line(e)
    assert message in str(e.value)


def test_a_fresh_cell_drafts_exactly_as_dflash(base):
    """Its output starts at zero: every node's logits are DFlash's of the same weights at its depth (to
    rounding), and the drafted trees (static and dynamic) are DFlash's exactly."""
    ours = drafter(base, output=False)
    dflash = make_drafter(drafter_config("dflash", BLOCK - 1, **OPTIONS), base)
    nnx.update(dflash, nnx.state(ours, nnx.Param).filter(lambda path, _: path[0] != "clover_cell"))
    for spec in ("widths:3,2,2", "dynamic:8"):
        tree = resolve_tree(spec, "dflash", BLOCK - 1)
        got = []
        for d in (ours, dflash):
            logits = []

            class Recorder:
                feature_layers = d.feature_layers

                def expand(self, base, state, frontier, vocab=None, d=d):
                    out = d.expand(base, state, frontier, vocab)
                    logits.append(np.asarray(jnp.broadcast_to(out[0], frontier.tokens.shape + out[0].shape[-1:])))
                    return out

            drafted, _ = draft_tree(base, Recorder(), committed(base, d, PROMPT, PROMPT[1:] + [5]), tree,
                                    jnp.asarray([5]), jnp.asarray([len(PROMPT)]))
            got.append((logits, np.asarray(drafted.tokens)))
        for a, b in zip(got[0][0], got[1][0]):  # the lm_head scores F rows, not 1: rounding may differ
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(got[0][1], got[1][1])


@pytest.mark.parametrize("spec, batch", [("chain:3", 1), ("chain:3", 4), ("widths:3,2,2", 1), ("widths:3,2,2", 4),
                                         ("dynamic:8", 1), ("dynamic:8", 4)])
def test_greedy_decodes_as_plain(base, spec, batch):
    plain = Generator(base).generate(PROMPTS, 16, eos_ids=[]).tokens
    rows = list(range(len(PROMPTS))) if batch == 4 else [1]
    out = SpeculativeGenerator(base, drafter(base), resolve_tree(spec, "dflash_clover", BLOCK - 1)).generate(
        [PROMPTS[i] for i in rows], 16, eos_ids=[])
    assert out.tokens == [plain[i][:16] for i in rows]


def test_training_scores_what_decoding_scores(base):
    """train_forward's entry [k, 0, t] equals the logits decoding gives the depth-k node of the chain of
    the data's tokens from root t + 1 (each node stepping the cell from its parent's state); siblings
    holding other tokens get other logits, so the cell does correct by the path."""
    d = drafter(base)
    seq = PROMPTS[1] + [11, 12, 40, 3]
    tokens = jnp.asarray([seq], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq), feature_layers=d.feature_layers)
    _, logits = d.train_forward(base, tokens, out.hidden, out.hidden_normed, out.features)
    for t in (0, 3, len(seq) - 5):
        state, carry = committed(base, d, seq[: t + 1], seq[1 : t + 2]), None
        for k in range(BLOCK - 1):
            other = (seq[t + 1 + k] + 1) % base.cfg.vocab_size  # a sibling of the data's node
            nodes = [seq[t + 1 + k], other] if k else [seq[t + 1]]
            frontier = Frontier(tokens=jnp.asarray([nodes]), parents=jnp.zeros((1, len(nodes)), jnp.int32),
                                slots=jnp.full((1, len(nodes)), k, jnp.int32),
                                ancestors=jnp.ones((1, len(nodes), BLOCK), bool),
                                positions=jnp.full((1, len(nodes)), t + 1 + k), carry=carry, depth=k)
            got, carry, state = d.expand(base, state, frontier)
            np.testing.assert_allclose(np.asarray(logits[k, 0, t]), np.asarray(got)[0, 0], atol=1e-4, rtol=1e-4)
            if k:
                assert np.abs(np.asarray(got)[0, 0] - np.asarray(got)[0, 1]).max() > 1e-3
            carry = jax.tree.map(lambda c: c[:, :1], carry)  # the data's node is the next level's parent


@pytest.mark.parametrize("tree", ["widths:3,2,1", "dynamic:7"])
def test_speculative_sampling_has_the_base_distribution(monkeypatch, tree):
    """test_spec_sampling's chi-square check with a dflash_clover drafter of block 4 (logits tripled, as
    tests/test_dflash.py does): each node drafts from its own corrected distribution."""
    import test_spec_sampling as spec
    from clover_jax.engine.sampling import SamplingConfig

    base = spec.noisy(Llama(ModelConfig.tiny(vocab_size=spec.VOCAB), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)
    monkeypatch.setattr(spec, "noisy_heads", lambda base, method: spec.noisy(
        make_drafter(drafter_config(method, 3, output_multiplier=3.0, cell_width=16), base, seed=2),
        0.05, seed=3, replace=False))
    sampling = SamplingConfig(temperature=1.0)
    pv = spec.p_values(spec.sample_tokens(base, "dflash_clover", sampling, tree), spec.exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv


# ---------------------------------------------------------------- train.train --backbone

STEPS = 4


def run_train(model_dir, data, root, method, *extra):
    from train import train

    argv = ["--method", method, "--base", model_dir, "--data", data, "--out", root / "out", "--work-dir",
            root / "work", "--steps", STEPS, "--batch-size", 2, "--seq-len", 32, "--dtype", "float32", "--warmup", 1,
            "--lr", 1e-2, "--val-fraction", 0, *extra]
    return train.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def backbones(model_dir, datasets, tmp_path_factory):
    """Two trained dflash drafters (seeds 0 and 1) of the tiny test data."""
    roots = []
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"dflash-{seed}")
        assert run_train(model_dir, datasets["plain"], root, "dflash", "--seed", seed, "--num-heads", 2,
                         "--option", "target_layer_ids=0,1") == 0
        roots.append(root / "out")
    return roots


@pytest.mark.slow
def test_frozen_training_changes_the_cell_alone(model_dir, datasets, backbones, tmp_path, capsys):
    from clover_jax.io.hf import load_pretrained

    backbone = backbones[0]
    code = run_train(model_dir, datasets["plain"], tmp_path, "dflash_clover", "--backbone", backbone,
                     "--option", "cell_width=6", "--stop-after", 2)
    assert code == 0
    code = run_train(model_dir, datasets["plain"], tmp_path, "dflash_clover", "--backbone", backbone,
                     "--option", "cell_width=6", "--resume")
    assert code == 0, capsys.readouterr().err
    run = json.loads((tmp_path / "work" / "run.json").read_text())
    assert run["backbone_sha256"] == hashlib.sha256((backbone / "heads.safetensors").read_bytes()).hexdigest()
    theirs, ours = load_file(str(backbone / "heads.safetensors")), load_file(str(tmp_path / "out" / "heads.safetensors"))
    cell = {k for k in ours if k.startswith("clover_cell.")}
    assert cell and set(ours) - cell == set(theirs)
    for name in theirs:  # the backbone's weights exactly
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    base = load_pretrained(model_dir)[1]
    fresh = make_drafter(drafter_config("dflash_clover", 2, target_layer_ids=[0, 1], cell_width=6), base, seed=0)
    start = {".".join(map(str, p)): np.asarray(v.value) for p, v in nnx.to_flat_state(nnx.state(fresh.clover_cell))}
    assert all(not np.array_equal(ours[f"clover_cell.{k}"], start[k]) for k in start if "norm" not in k), sorted(start)
    # The checkpoints and the optimizer state hold the cell alone.
    restored = ocp.CheckpointManager(tmp_path / "work" / "checkpoints").restore(STEPS)
    sizes = [np.size(x) for x in jax.tree.leaves(restored["params"])]
    assert sum(sizes) == sum(np.size(ours[k]) for k in cell)
    # The export loads whole, and drafts: greedy as plain decoding.
    loaded = load_heads(tmp_path / "out", base)
    assert loaded.hcfg.method == "dflash_clover" and loaded.hcfg.cell_width == 6
    prompts = [[1, 7, 8, 9], [1, 2]]
    out = SpeculativeGenerator(base, loaded, resolve_tree("widths:2,2", "dflash_clover", 2)).generate(prompts, 8, eos_ids=[])
    assert out.tokens == Generator(base).generate(prompts, 8, eos_ids=[]).tokens

    # A resume on another backbone is refused in one line, before it trains.
    capsys.readouterr()
    code = run_train(model_dir, datasets["plain"], tmp_path, "dflash_clover", "--backbone", backbones[1],
                     "--option", "cell_width=6", "--resume", "--steps", STEPS + 2)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "was started with backbone_sha256=" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("case, message", [
    ("not dflash", "holds a Medusa drafter; DFlash + Clover cell trains on a trained DFlash one"),
    ("no backbone", "DFlash has no frozen backbone; drop --backbone"),
    ("other shape", "fixes draft_layers=1; drop --option draft_layers"),
    ("other depth", "fixes num_heads=2; drop --num-heads"),
    ("bad option", "cell_width=-1 must be an integer >= 1"),
])
def test_a_wrong_backbone_is_one_line(model_dir, datasets, backbones, tmp_path, capsys, case, message):
    from clover_jax.io.heads_dir import save_heads
    from clover_jax.io.hf import load_pretrained

    backbone = backbones[0]
    if case == "not dflash":
        backbone = tmp_path / "medusa"
        save_heads(make_drafter(drafter_config("medusa", 2), load_pretrained(model_dir)[1]), load_pretrained(model_dir)[1],
                   backbone)
    extra = {"other shape": ["--option", "draft_layers=2"], "other depth": ["--num-heads", 3],
             "bad option": ["--option", "cell_width=-1"]}.get(case, [])
    capsys.readouterr()
    code = run_train(model_dir, datasets["plain"], tmp_path, "dflash" if case == "no backbone" else "dflash_clover",
                     "--backbone", backbone, *extra)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
