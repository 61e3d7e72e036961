"""The draft heads shipped for SmolLM2-135M-Instruct (models/smollm2/heads): found by `--model smollm2`,
greedy output equal to plain decoding's for every method at batch 1 and 4 on chat prompts, theirs and
no other model's. A file of its own, so the test workers share the SmolLM2 tests' time."""

from __future__ import annotations

import json
import numpy as np
import pytest

from clover_jax import _cli as cli
from clover_jax.drafters import BUILT_IN
from clover_jax.drafters import registry
from clover_jax.io import sources
from clover_jax.io.heads_dir import TREE, base_fingerprint, held_out_chain_tau, load_draft_vocab, load_fitted_tree, load_token_counts, read_heads_config
from clover_jax.io.hf import load_pretrained
from clover_jax.drafters.vocab import AUTO_MASS_COVERAGE
from clover_jax.engine.decode import Generator
from clover_jax.plan.auto import auto_tree
from clover_jax.trees.spec import resolve_tree
from clover_jax.plan import factory
from infer import generate
from clover_jax.io import tokenization

# The methods with shipped heads: the corrections of a DFlash block (DSpark, Domino, DFlash + Clover cell)
# have none yet (their 1,000-step training does not fit a CPU session beside the rest).
UNSHIPPED = ("dspark", "domino", "dflash_clover")
BUILT_IN = tuple(m for m in BUILT_IN if m not in UNSHIPPED)

pytestmark = pytest.mark.optimized  # its time goes into running programs, not compiling them

SHIPPED = sources.shipped_dir("smollm2") / "heads"
CHAT_PROMPTS = ["What is a KV cache?", "Write a haiku about autumn.", "Give me three tips for learning Python.",
                "Why is the sky blue?"]


@pytest.fixture(scope="module")
def smollm2():
    """(float32 model, tokenizer) of `--model smollm2`."""
    path = sources.model_dir("smollm2")
    return load_pretrained(path)[1], cli.load_tokenizer(path)


@pytest.fixture(scope="module")
def plain_answers(smollm2):
    """The chat prompts' ids and plain greedy decoding's 24 tokens for each (never stopping at EOS)."""
    model, tok = smollm2
    ids = [tokenization.encode(tok, p, chat=True) for p in CHAT_PROMPTS]
    return ids, Generator(model, max_len=256).generate(ids, 24, eos_ids=()).tokens


@pytest.mark.parametrize("method", BUILT_IN)
def test_shipped_heads_decode_exactly_as_plain_decoding(method, smollm2, plain_answers):
    """`--model smollm2 --method M` finds its shipped heads; greedy, they write plain decoding's tokens:
    batch 1 on the tree fitted to them (their default), batch 4 on a chain through every head, from the draft vocabulary.
    (This way round, not the other: Medusa's 64-node tree at batch 4 verifies 256 rows a step, and its 24
    tokens took 10 s of a 35-second test on this CPU.)"""
    model, _ = smollm2
    ids, plain = plain_answers
    depth = read_heads_config(SHIPPED / method)["heads"]["num_heads"]  # DFlash's: its block less one
    tree = factory.make_generator(model, method, model_path="smollm2", tree="default", max_len=256)
    assert tree.tree == load_fitted_tree(SHIPPED / method, depth)  # the heads' own tree
    out = tree.generate(ids[:1], 24, eos_ids=())
    assert out.tokens == plain[:1]
    assert out.steps < 24  # the heads draft something a real answer accepts
    chain = factory.make_generator(model, method, model_path="smollm2", tree=f"chain:{depth}", max_len=256)
    assert chain.generate(ids, 24, eos_ids=()).tokens == plain


@pytest.mark.parametrize("method", BUILT_IN)
def test_shipped_heads_draft_a_tree_fitted_to_them_at_one_node_budget(method):
    """Each method's shipped tree.json (`train.evaluate --fit-tree 64 --record`, MODEL_CARD.md) has the
    same number of nodes as every other method's, the largest paper tree's (Medusa's 64), so on their
    default trees the methods compare at one verification cost; replayed on the held-out split heads.json
    recorded its figures on, it accepts more than the method's paper tree. The tree's recorded tau is
    `fit:64` where it was fitted on that split, and `default` (the shipped tree replayed) where it was
    fitted on another (EAGLE-3's, on its training data's held-out split)."""
    depth = read_heads_config(SHIPPED / method)["heads"]["num_heads"]
    budget = max(resolve_tree("paper", m, registry.get(m).depth).num_nodes for m in BUILT_IN)
    fitted, paper = load_fitted_tree(SHIPPED / method, depth), resolve_tree("paper", method, depth)
    assert fitted is not None and fitted.num_nodes == budget >= paper.num_nodes and fitted != paper
    evaluated = read_heads_config(SHIPPED / method)["evaluated"]
    fitted_here = json.loads((SHIPPED / method / TREE).read_text())["fitted_on"] == evaluated["data"]
    taus = evaluated["val_tree_tau"]
    assert taus[f"fit:{budget}" if fitted_here else "default"] > taus["paper"] > 1


def test_shipped_heads_are_smollm2s_and_fit_their_budget(smollm2):
    model, _ = smollm2
    for method in BUILT_IN:
        meta = read_heads_config(SHIPPED / method)
        assert meta["base_fingerprint"] == base_fingerprint(model) and meta["heads"]["method"] == method
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    # Medusa, Clover and Clover-2 under 45 MiB; EAGLE-1, EAGLE-3 and DFlash 30 MiB more; DFlash 2 25 MiB more
    # (its candidate selector's two codebooks, 49,152 x 64 each, are 12.6 MB of its 22.4)
    assert size < (45 + 30 + 25) * 2**20


def test_shipped_heads_sample_from_the_tokens_holding_the_probability_mass(smollm2):
    """When sampling, `auto` drafts from the most probable tokens holding 99% of the base model's mass
    over the heads' training answers: a sixth to a quarter of SmolLM2's 49,152, not all of them."""
    model, _ = smollm2
    v = model.cfg.vocab_size
    for method in BUILT_IN:
        mass = load_token_counts(SHIPPED / method, v, "mass")
        assert mass is not None and (mass >= 0).all() and mass.sum() > 1000, method
        vocab = load_draft_vocab(SHIPPED / method, model, "auto", greedy=False)
        assert vocab is not None and v // 8 < vocab.size < v // 2, method
        held = mass[np.asarray(vocab.ids)].sum() / mass.sum()
        assert AUTO_MASS_COVERAGE <= held < AUTO_MASS_COVERAGE + 0.005, (method, held)


@pytest.mark.parametrize("model,heads", [("smollm2", "reference/heads/clover2"),
                                         (str(sources.DEFAULT_MODEL_DIR), "smollm2/heads/clover2")])
def test_heads_of_the_other_model_are_one_error_line(model, heads, smollm2, capsys):
    code = generate.main(["--model", model, "--method", "clover2", "--heads", str(sources.shipped_root() / heads),
                          "--prompt", "Hi", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and err.count("\n") == 1 and "trained for another base model" in err, err


def test_auto_on_a_cpu_drafts_as_deep_as_the_heads_held_out_tau_pays():
    """Round 5's Clover-2 recorded its held-out tau per chain depth (1.38 at one head, 1.55 at five): on
    a CPU each further draft adds less than it costs, so `auto` drafts one token a step greedy (MT-Bench:
    chain:1 1.01x plain decoding, the full chain 0.74x; docs/history/benchmarks.md). Sampling, a one-draft step
    costs more than any shipped head's first draft brings (measured: 0.77-0.94x plain decoding drafting at
    every step, 0.87-0.92x paced), so `auto` decodes plain then, for every method."""
    taus = held_out_chain_tau(SHIPPED / "clover2")
    assert taus is not None and len(taus) == 5 and taus == sorted(taus)
    assert auto_tree(5, "cpu", taus) == "chain:1"
    for method in ("medusa", "clover", "clover2", "eagle", "eagle3"):
        taus = held_out_chain_tau(SHIPPED / method)
        assert auto_tree(len(taus), "cpu", taus) == "chain:1"
        assert auto_tree(len(taus), "cpu", taus, sampling=True) is None  # no drafting
