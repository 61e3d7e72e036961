"""The draft heads shipped for Gemma 3 270M (models/gemma3/heads: Clover-2 and EAGLE-3): found by `--model
gemma3 --method M`, made for this model and no other, and greedy output equal to plain decoding's on
plain-text prompts, batch 1 on their default tree and batch 2 on a chain, with answers that run past
nothing the heads were fitted to. Skipped, with the reason, where the model's packages cannot be fetched."""

from __future__ import annotations

import pytest

from clover_jax.drafters import registry
from clover_jax.engine.decode import Generator
from clover_jax.io import sources, tokenization
from clover_jax.io.heads_dir import base_fingerprint, read_heads_config
from clover_jax.io.hf import load_pretrained
from clover_jax.plan import factory

pytestmark = pytest.mark.optimized

SHIPPED = sources.shipped_dir("gemma3") / "heads"
METHODS = ("clover2", "eagle3")
PROMPTS = ["The three primary colors are", "Translate into English: Der Hund schläft im Garten.\nEnglish:"]


@pytest.fixture(scope="module")
def gemma3(gemma3_files):
    """(float32 model, checkpoint dir, tokenizer) of `--model gemma3`."""
    _, path, tok = gemma3_files
    return load_pretrained(path)[1], path, tok


@pytest.fixture(scope="module")
def plain_answers(gemma3):
    model, _, tok = gemma3
    ids = [tokenization.encode(tok, p) for p in PROMPTS]
    return ids, Generator(model, max_len=256).generate(ids, 24, eos_ids=()).tokens


def test_the_shipped_heads_are_gemma3s():
    assert sorted(p.name for p in SHIPPED.iterdir() if p.is_dir()) == sorted(METHODS)
    for method in METHODS:
        meta = read_heads_config(SHIPPED / method)
        assert meta["heads"]["method"] == method
        assert (meta["base_model_type"], meta["base_hidden_size"], meta["base_vocab_size"]) == (
            "gemma3_text", 640, 262144)
        assert meta["final_step"] == meta["training"]["steps"]  # a finished run, not a checkpoint
    assert (SHIPPED / "MODEL_CARD.md").is_file()


@pytest.mark.parametrize("method", METHODS)
def test_shipped_heads_decode_exactly_as_plain_decoding(method, gemma3, plain_answers):
    model, _, _ = gemma3
    assert read_heads_config(SHIPPED / method)["base_fingerprint"] == base_fingerprint(model)
    ids, plain = plain_answers
    tree = factory.make_generator(model, method, model_path="gemma3", tree="default", max_len=256)
    out = tree.generate(ids[:1], 24, eos_ids=())
    assert out.tokens == plain[:1]
    assert out.steps < 24  # the heads draft something the model accepts
    depth = registry.get(method).depth
    chain = factory.make_generator(model, method, model_path="gemma3", tree=f"chain:{depth}", max_len=256)
    assert chain.generate(ids, 24, eos_ids=()).tokens == plain
