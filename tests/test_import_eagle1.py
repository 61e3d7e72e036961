"""The EAGLE authors' EAGLE-1 drafters load into our EAGLE-1 drafter (switch normed_features) and draft
what their code drafts.

On the tiny 8-layer base of tests/test_import_eagle3.py, a random EAGLE-1 drafter in the authors' files
(fc with or without bias, layers.0.* without input_layernorm, the target's embed_tokens, a draft layer
config of its own) gives `reference_eagle3.Eagle1Reference`'s logits (their cnets1 forward fed the base
model's normed states, scored by its lm_head) to 1e-4 at the root and after three steps; the export
loads back identically; greedy `infer.generate` with it prints plain decoding's text; bad files, our
pre-norm EAGLE-1's export and training a normed one are one line each.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io import formats
from infer import generate
from reference_eagle3 import Eagle1Reference
from test_import_eagle3 import DRAFT_LAYER, D, base, base_dir, our_chain, refused, state_of, write  # noqa: F401

PREFIX = "layers.0."


def eagle1_tensors(v: int, seed: int, bias: bool = True, embed=None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lin = lambda o, i: (rng.normal(size=(o, i)) / math.sqrt(i)).astype(np.float32)
    heads, kv, hd, f = (DRAFT_LAYER[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "intermediate_size"))
    w = {"fc.weight": lin(D, 2 * D), PREFIX + "post_attention_layernorm.weight": (1 + 0.3 * rng.normal(size=D)).astype(np.float32),
         PREFIX + "self_attn.q_proj.weight": lin(heads * hd, D), PREFIX + "self_attn.k_proj.weight": lin(kv * hd, D),
         PREFIX + "self_attn.v_proj.weight": lin(kv * hd, D), PREFIX + "self_attn.o_proj.weight": lin(D, heads * hd),
         PREFIX + "mlp.gate_proj.weight": lin(f, D), PREFIX + "mlp.up_proj.weight": lin(f, D),
         PREFIX + "mlp.down_proj.weight": lin(D, f)}
    if bias:
        w["fc.bias"] = (0.3 * rng.normal(size=D)).astype(np.float32)
    if embed is not None:
        w["embed_tokens.weight"] = embed
    return w


def eagle1_config(v: int, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "num_hidden_layers": 1,
            "vocab_size": v, "hidden_act": "silu", "max_position_embeddings": 128, "tie_word_embeddings": False,
            "torch_dtype": "float32", **DRAFT_LAYER, **extra}


def make_eagle1(folder, base_dir, bias: bool = True):
    hf = base_dir[0]
    v = hf.config.vocab_size
    tensors = eagle1_tensors(v, seed=2, bias=bias, embed=hf.model.embed_tokens.weight.detach().numpy().copy())
    return write(folder, eagle1_config(v, **({} if bias else {"bias": False})), tensors), tensors


@pytest.mark.parametrize("bias", [True, False], ids=["fc-bias", "no-bias"])
def test_the_authors_eagle1_drafts_as_their_code(bias, base_dir, base, tmp_path):
    folder, tensors = make_eagle1(tmp_path / "eagle1", base_dir, bias)
    assert formats.recognise(folder).NAME == "eagle1"
    drafter = formats.load_drafter(folder, base, "eagle")
    assert drafter.hcfg.switches == ("normed_features",) and drafter.hcfg.draft_layer is not None
    hf = base_dir[0]
    ref = Eagle1Reference({k: torch.from_numpy(t) for k, t in tensors.items()}, {"hidden_size": D, **DRAFT_LAYER},
                          hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach())
    rng = np.random.default_rng(1)
    n = 7
    tokens = rng.integers(3, hf.config.vocab_size, (1, n + 1))
    path = [int(tokens[0, n])] + [int(t) for t in rng.integers(3, hf.config.vocab_size, 3)]
    with torch.no_grad():
        normed = hf(torch.tensor(tokens[:, :n]), output_hidden_states=True).hidden_states[-1]  # after the norm
        theirs = ref.chain(normed, torch.tensor(tokens[:, 1:]), path)
    _, ours = our_chain(base, drafter, np.asarray(tokens, np.int32), np.asarray([path], np.int32))
    for got, want in zip(np.asarray(ours), theirs):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)
    out = formats.exporter("eagle1").export(drafter, base, tmp_path / "out")
    back = formats.load_drafter(out, base)
    assert back.hcfg == drafter.hcfg
    mine = state_of(drafter)
    for name, value in state_of(back).items():
        np.testing.assert_array_equal(value, mine[name], err_msg=name)


def test_infer_generate_with_the_authors_eagle1_prints_plain_text(base_dir, tmp_path, capsys):
    folder, _ = make_eagle1(tmp_path / "eagle1", base_dir)
    common = ["--model", str(base_dir[1]), "--prompt", "def add(a, b):", "--max-new-tokens", "10"]
    assert generate.main(common) == 0
    plain = capsys.readouterr().out
    assert generate.main(common + ["--method", "eagle", "--heads", str(folder), "--tree", "chain:3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain, err
    assert "[eagle] tree=4 nodes" in err, err


def test_bad_eagle1_drafters_are_one_line_each(base_dir, base, tmp_path):
    v = base_dir[0].config.vocab_size
    good = eagle1_tensors(v, seed=3)
    cases = [
        (eagle1_config(v, hidden_size=64), good, "hidden_size 64"),
        (eagle1_config(v, vocab_size=v + 1), good, f"vocab_size {v + 1}"),
        (eagle1_config(v, architectures=["MixtralForCausalLM"]), good, "architectures"),
        (eagle1_config(v, bias=False), good, "bias false"),
        (eagle1_config(v, qkv_bias=True), good, "qkv_bias"),
        (eagle1_config(v), {**good, PREFIX + "input_layernorm.weight": np.ones(D, np.float32)}, "input_layernorm"),
        (eagle1_config(v), {**good, "embed_tokens.weight": np.zeros((v, 2 * D), np.float32)}, "embed_tokens"),
        (eagle1_config(v), {k: t for k, t in good.items() if "o_proj" not in k}, "lacks tensor"),
    ]
    for i, (config, tensors, words) in enumerate(cases):
        folder = write(tmp_path / f"bad{i}", config, tensors)
        message = refused(lambda: formats.load_drafter(folder, base), folder)
        assert words in message, message
    folder = write(tmp_path / "good", eagle1_config(v), good)
    refused(lambda: formats.load_drafter(folder, base, "eagle3"), folder)  # an EAGLE-1 drafter is no EAGLE-3's
    # Ours read the state before the final norm, which the authors' format has no place for; a normed
    # one drafts but does not train (the loss regresses the pre-norm feature).
    ours = make_heads(drafter_config("eagle", 2), base)
    message = refused(lambda: formats.exporter("eagle1").export(ours, base, tmp_path / "out"), tmp_path / "out")
    assert "before its final norm" in message
    imported = formats.load_drafter(folder, base)
    tokens = np.zeros((1, 4), np.int32)
    hidden = np.zeros((1, 4, D), np.float32)
    with pytest.raises(CloverError, match="do not train here") as excinfo:
        imported.train_forward(base, tokens, hidden, hidden)
    assert "\n" not in str(excinfo.value)
