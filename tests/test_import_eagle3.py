"""Published EAGLE-3 drafters load into our EAGLE-3 drafter and draft what their authors' code drafts.

A tiny random Llama base (8 layers, so the feature layers are distinct) and, for each published format,
a tiny random drafter written as that format's files: SpecForge/SGLang's (midlayer.*), the EAGLE
authors' (layers.0.*, with the target's embed_tokens, no feature layers named; or no lm_head, over the
whole vocabulary) and speculators' (every switch on). Each one's draft logits, from the same base
features, equal `reference_eagle3`'s (the authors' forward in PyTorch) to 1e-4 at the root and after
three regressive steps; its draft layer has a config of its own (heads, head_dim, MLP width, epsilon,
RoPE theta) and its draft vocabulary is in no particular order. Exports load back identically, greedy
speculative output with an imported drafter is plain decoding's, and bad files are one line each.
"""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import clover_jax
from clover_jax.drafters.base import Committed, Frontier
from clover_jax.drafters.draft_model import NO_LOGIT
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from clover_jax.io import formats
from clover_jax.io.formats import weights
from clover_jax.io.heads_dir import load_heads, save_heads
from clover_jax.io.hf import load_pretrained, save_safetensors
from clover_jax.drafters.eagle3 import eagle3_layers
from clover_jax.model.llama import causal_self_mask
from conftest import assert_one_line, tiny_tokenizer
from reference_eagle3 import Eagle3Reference
from train import tokenizer as tokenizer_lib

D, LAYERS, N = 32, 8, 40  # base width and depth; draft vocabulary
# The draft layer's own config, unlike the base's (4 heads of 8, 2 kv heads, MLP 64, eps 1e-6, theta 1e4).
DRAFT_LAYER = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                   rms_norm_eps=1e-5, rope_theta=5000.0)
SWITCHES = ("norm_before_residual", "fc_norm", "norm_output")


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights at a scale that gives activations and logits of order one (as conftest's models)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """(HF model, directory): a tiny random 8-layer Llama with the repository's tiny tokenizer."""
    out = tmp_path_factory.mktemp("eagle3-base")
    tok = tiny_tokenizer()
    tokenizer_lib.save_tokenizer(tok, out)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=D, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    redraw(model, 1)
    model.save_pretrained(out)
    return model, out


@pytest.fixture(scope="module")
def base(base_dir):
    return load_pretrained(base_dir[1])[1]


def draft_tensors(v: int, seed: int, prefix: str = "midlayer.", n: int = N, switches=(), embed=None,
                  lm_head: bool = True) -> dict[str, np.ndarray]:
    """A random EAGLE-3 drafter's tensors as the formats name them, its n target ids in random order."""
    rng = np.random.default_rng(seed)
    lin = lambda o, i: (rng.normal(size=(o, i)) / math.sqrt(i)).astype(np.float32)
    norm = lambda: (1 + 0.3 * rng.normal(size=D)).astype(np.float32)
    heads, kv, hd, f = (DRAFT_LAYER[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "intermediate_size"))
    w = {"fc.weight": lin(D, 3 * D), "norm.weight": norm(),
         prefix + "hidden_norm.weight": norm(), prefix + "input_layernorm.weight": norm(),
         prefix + "post_attention_layernorm.weight": norm(),
         prefix + "self_attn.q_proj.weight": lin(heads * hd, 2 * D), prefix + "self_attn.k_proj.weight": lin(kv * hd, 2 * D),
         prefix + "self_attn.v_proj.weight": lin(kv * hd, 2 * D), prefix + "self_attn.o_proj.weight": lin(D, heads * hd),
         prefix + "mlp.gate_proj.weight": lin(f, D), prefix + "mlp.up_proj.weight": lin(f, D),
         prefix + "mlp.down_proj.weight": lin(D, f)}
    if lm_head:
        w["lm_head.weight"] = lin(n, D)
    if n < v:
        targets = rng.permutation(v)[:n]
        w["d2t"] = (targets - np.arange(n)).astype(np.int64)
        w["t2d"] = np.isin(np.arange(v), targets)
    if "fc_norm" in switches:
        w.update({f"fc_norm.{i}.weight": norm() for i in range(3)})
    if embed is not None:
        w["embed_tokens.weight"] = embed
    return w


def sglang_config(v: int, aux=None, n: int = N, architecture: str = "LlamaForCausalLMEagle3", **extra) -> dict:
    config = {"architectures": [architecture], "model_type": "llama", "hidden_size": D, "num_hidden_layers": 1,
              "vocab_size": v, "draft_vocab_size": n, "hidden_act": "silu", "max_position_embeddings": 128,
              "tie_word_embeddings": False, "torch_dtype": "float32", **DRAFT_LAYER, **extra}
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
    return config


def speculators_config(v: int, aux, n: int = N, **extra) -> dict:
    """As speculators saves one: transformer_layer_config holds only what differs from LlamaConfig's
    defaults (no hidden_act, no max_position_embeddings), aux layers as hidden_states indices."""
    layer = {"model_type": "llama", "vocab_size": v, "hidden_size": D, "num_hidden_layers": 1, **DRAFT_LAYER}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": layer, "draft_vocab_size": n, "target_hidden_size": D,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux], **{s: True for s in SWITCHES}, **extra}


def write(folder, config: dict, tensors: dict, name: str = "model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_safetensors(tensors, folder / name)
    return folder


# (format module, prefix, feature layers named in the config, switches, tensors with embed_tokens, lm_head)
CASES = {
    "sglang": ("sglang", "midlayer.", (0, 3, 6), (), False, True),
    "authors-layers0-embed": ("sglang", "layers.0.", None, (), True, True),
    "authors-whole-vocab-no-lm_head": ("sglang", "midlayer.", None, (), False, False),
    "speculators-switches": ("speculators", "layers.0.", (2, 4, 6), SWITCHES, True, True),
}


def make_case(case: str, folder, base_dir):
    """(folder, tensors, feature layers) of a CASES drafter for the base in base_dir."""
    fmt, prefix, aux, switches, with_embed, lm_head = CASES[case]
    hf = base_dir[0]
    v = hf.config.vocab_size
    embed = hf.model.embed_tokens.weight.detach().numpy().copy() if with_embed else None
    n = N if lm_head else v
    tensors = draft_tensors(v, seed=len(case), prefix=prefix, n=n, switches=switches, embed=embed, lm_head=lm_head)
    if fmt == "speculators":
        config = speculators_config(v, aux, n)
    elif case.startswith("authors"):
        config = sglang_config(v, None, n, architecture="LlamaForCausalLM")
    else:
        config = sglang_config(v, aux, n)
    return write(folder, config, tensors), tensors, aux or eagle3_layers(LAYERS)


def reference(case: str, tensors: dict, base_dir) -> Eagle3Reference:
    fmt, prefix, _, switches, _, lm_head = CASES[case]
    hf = base_dir[0]
    weights_t = {k: torch.from_numpy(np.asarray(t)) for k, t in tensors.items()}
    if not lm_head:  # the base model's lm_head rows then, over the whole vocabulary
        weights_t["lm_head.weight"] = hf.lm_head.weight.detach().clone()
    config = {"hidden_size": D, **DRAFT_LAYER}
    return Eagle3Reference(weights_t, config, hf.model.embed_tokens.weight.detach(), prefix, switches)


@nnx.jit
def our_chain(base, drafter, tokens, path):
    """(features [1, n, F, D] our base model hands the drafter, logits [4, V] at the root and after each of
    path[1:]) for tokens [1, n + 1] (the base model runs on the first n) and path [1, 4] (the root first):
    commit the n entries, then expand one chain node per level (slots 0..3, each node's ancestors the
    nodes before it), as decoding drafts a chain. One program, so the test compiles once."""
    n = tokens.shape[1] - 1
    out = base(tokens[:, :n], jnp.arange(n)[None], causal_self_mask(1, n), feature_layers=drafter.feature_layers)
    lens = jnp.full((1,), n, jnp.int32)
    new = Committed(out.hidden, out.hidden_normed, tokens[:, 1:], out.features)
    state = drafter.commit(base, drafter.init(base, 1, 32), new, lens, jnp.ones((1,), bool))
    carry, logits = None, []
    for j in range(path.shape[1]):
        frontier = Frontier(tokens=path[:, j : j + 1], parents=jnp.zeros((1, 1), jnp.int32),
                            slots=jnp.full((1, 1), j, jnp.int32),
                            ancestors=(jnp.arange(path.shape[1]) <= j)[None, None], positions=lens[:, None] + j,
                            carry=carry, depth=j)
        step, carry, state = drafter.expand(base, state, frontier)
        logits.append(step[0, 0])
    return out.features, jnp.stack(logits)


def features_and_chain(base_dir, base, drafter, ref, aux, seed: int = 0, n: int = 7):
    """Our chain logits [4, V] and the reference's [4, N] at the root and after three drafted tokens, from
    a random prompt of n + 1 tokens; checks first that our base model hands EAGLE-3 HF's hidden_states[i + 1]."""
    hf = base_dir[0]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, hf.config.vocab_size, (1, n + 1))
    path = [int(tokens[0, n])] + [int(t) for t in rng.integers(3, hf.config.vocab_size, 3)]
    with torch.no_grad():
        states = hf(torch.tensor(tokens[:, :n]), output_hidden_states=True).hidden_states
        theirs = ref.chain(torch.cat([states[i + 1] for i in aux], -1), torch.tensor(tokens[:, 1:]), path)
    assert drafter.feature_layers == tuple(aux)
    features, ours = our_chain(base, drafter, jnp.asarray(tokens, jnp.int32), jnp.asarray([path], jnp.int32))
    np.testing.assert_allclose(np.asarray(features), torch.stack([states[i + 1] for i in aux], 2).numpy(),
                               atol=1e-4, rtol=1e-4)
    return np.asarray(ours), [t.numpy() for t in theirs]


@pytest.mark.parametrize("case", list(CASES))
def test_published_drafters_draft_as_their_authors_code(case, base_dir, base, tmp_path):
    folder, tensors, aux = make_case(case, tmp_path / case, base_dir)
    assert formats.recognise(folder).NAME == CASES[case][0]
    drafter = formats.load_drafter(folder, base, "eagle3")
    assert drafter.hcfg.draft_layer is not None and drafter.hcfg.switches == CASES[case][3]
    ref = reference(case, tensors, base_dir)
    targets = ref.targets.numpy()
    ours, theirs = features_and_chain(base_dir, base, drafter, ref, aux)
    assert len(ours) == 4  # the root's children, then three regressive steps
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got[targets], want, atol=1e-4, rtol=1e-4)
        assert (np.delete(got, targets) == NO_LOGIT).all()  # nothing outside the draft vocabulary


def state_of(drafter) -> dict:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(drafter))}


@pytest.mark.parametrize("case, out_format", [("sglang", "sglang"), ("sglang", "speculators"),
                                              ("authors-layers0-embed", "sglang"),
                                              ("speculators-switches", "speculators"), ("ours", "sglang"),
                                              ("ours", "speculators"), ("speculators-switches", "heads.json")])
def test_exports_load_back_identically(case, out_format, base_dir, base, tmp_path):
    """Export -> import gives the same drafter (config, every tensor, the draft vocabulary), in SpecForge's
    or speculators' format; for our own drafters too (their base-shaped layer, default feature layers);
    and an imported drafter saved as our heads (heads.json keeping its draft layer and switches)."""
    if case == "ours":
        drafter = make_heads(drafter_config("eagle3", 7, draft_vocab=N), base, seed=5)
        drafter.set_vocab(base, jnp.asarray(np.sort(np.random.default_rng(0).permutation(base.cfg.vocab_size)[:N])))
    else:
        drafter = formats.load_drafter(make_case(case, tmp_path / "in", base_dir)[0], base)
    if out_format == "heads.json":
        back = load_heads(save_heads(drafter, base, tmp_path / "ours"), base, "eagle3")
        assert back.hcfg == drafter.hcfg and back.hcfg.switches == SWITCHES
        for k, a in state_of(back).items():
            np.testing.assert_array_equal(a, state_of(drafter)[k], err_msg=k)
        return
    out = formats.exporter(out_format).export(drafter, base, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == N
    if out_format == "sglang":  # SGLang captures the state entering layer id + 1: ids are outputs of layers
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["vocab_size"] == base.cfg.vocab_size
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(drafter.feature_layers)
    else:  # speculators' ids are hidden_states indices, one above
        assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
        assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.feature_layers]
        assert config["transformer_layer_config"]["vocab_size"] == base.cfg.vocab_size
    stored = load_file(str(out / "model.safetensors"))
    assert stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == bool and stored["t2d"].sum() == N
    assert ("embed_tokens.weight" in stored) == (out_format == "speculators")
    assert formats.recognise(out).NAME == out_format
    back = formats.load_drafter(out, base)
    assert back.hcfg == drafter.hcfg
    mine, theirs = state_of(drafter), state_of(back)
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(theirs[name], mine[name], err_msg=name)


def test_an_imported_drafter_decodes_as_plain(base_dir, tmp_path):
    """Greedy speculative text with a published drafter (--heads pointing at its folder, through the Python
    API) is plain decoding's, and its drafts are accepted at times (the drafter runs)."""
    folder = make_case("speculators-switches", tmp_path / "spec", base_dir)[0]
    model = clover_jax.load(base_dir[1])
    prompts = [[1, 5, 9, 14, 3], [1, 44, 2, 7]]
    plain = model.generator("plain").generate(prompts, 12, stop_at_eos=False)
    drafter = model.drafter("eagle3", heads=folder)
    assert drafter.heads_dir == folder and drafter.chain_tau is None
    spec = model.generator(heads=drafter, tree="widths:3,2,2").generate(prompts, 12, stop_at_eos=False)
    assert spec.tokens == plain.tokens
    assert sum(spec.steps) <= sum(plain.steps)


def refused(call, folder) -> str:
    """The one-line error of `call`, which must leave `folder` as it was."""
    before = sorted(os.listdir(folder)) if folder.exists() else None
    with pytest.raises(CloverError) as excinfo:
        call()
    assert_one_line(excinfo)
    assert (sorted(os.listdir(folder)) if folder.exists() else None) == before
    return str(excinfo.value)


def test_bad_drafters_are_one_line_each(base_dir, base, tmp_path, monkeypatch):
    """Another base's hidden size or vocabulary, an unknown architecture, d2t out of range or at odds with
    t2d, a variant or setting not implemented, feature layers outside the base, a pickle not converted:
    each one line naming the problem, nothing written."""
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path / "cache"))
    v = base_dir[0].config.vocab_size
    good = draft_tensors(v, seed=1)
    cases = [
        (sglang_config(v, hidden_size=64), good, "hidden_size 64"),
        (sglang_config(v, target_hidden_size=48), good, "target_hidden_size 48"),
        (sglang_config(v + 5), good, f"vocab_size {v + 5}"),
        (sglang_config(v, architecture="Qwen3ForCausalLMEagle3"), good, "architectures"),
        (sglang_config(v, aux=(0, 3, LAYERS)), good, "not all inside"),
        (sglang_config(v, aux=(0, 3, LAYERS - 1)), good, "the last decoder layer"),
        (sglang_config(v, hidden_act="gelu"), good, "hidden_act"),
        (sglang_config(v, num_hidden_layers=2), good, "num_hidden_layers 2"),
        (sglang_config(v, rope_scaling={"type": "dynamic", "factor": 2.0}), good, "dynamic"),
        (sglang_config(v, norm_output=False), good, "norm_output"),
        (sglang_config(v), {**good, "d2t": good["d2t"] + v}, "outside the base model's vocabulary"),
        (sglang_config(v), {**good, "t2d": ~good["t2d"]}, "disagree"),
        (sglang_config(v), {k: t for k, t in good.items() if k != "fc.weight"}, "lacks tensor fc.weight"),
        (sglang_config(v), {**good, "fc_norm.0.weight": np.ones(D, np.float32)}, "fc_norm.0.weight"),
        (speculators_config(v, (1, 2, 3), norm_before_fc=True), draft_tensors(v, 1, "layers.0.", switches=SWITCHES),
         "norm_before_fc"),
        ({**speculators_config(v, (1, 2, 3)), "speculators_model_type": "eagle"}, good, "speculators_model_type"),
    ]
    for i, (config, tensors, words) in enumerate(cases):
        folder = write(tmp_path / f"bad{i}", config, tensors)
        message = refused(lambda: formats.load_drafter(folder, base), folder)
        assert words in message, message
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(sglang_config(v, architecture="LlamaForCausalLM")))
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    message = refused(lambda: formats.load_drafter(pickled, base), pickled)
    assert "python -m infer.convert_pickle" in message and not weights.converted_dir().exists()
    # Exports: a variant SpecForge has no key for, and a method that is not EAGLE-3's, write nothing.
    switched = formats.load_drafter(make_case("speculators-switches", tmp_path / "sw", base_dir)[0], base)
    message = refused(lambda: formats.exporter("sglang").export(switched, base, tmp_path / "out"), tmp_path / "out")
    assert "norm_before_residual" in message
    medusa = make_heads(drafter_config("medusa", 2), base)
    refused(lambda: formats.exporter("speculators").export(medusa, base, tmp_path / "out"), tmp_path / "out")


def test_sampling_with_an_imported_drafter_has_the_base_distribution(tmp_path):
    """The chi-square test of tests/test_spec_sampling.py (its tiny peaked base model and exact joint) with
    a published drafter: SGLang's, over a draft vocabulary of 16 of the 24 tokens in no order, its draft
    layer a config of its own. The samples keep the base model's distribution."""
    from clover_jax.engine.sampling import SamplingConfig
    from clover_jax.engine.speculative import SpeculativeGenerator
    from clover_jax.model.config import ModelConfig
    from clover_jax.model.llama import Llama
    from clover_jax.trees.spec import resolve_tree
    from test_spec_sampling import NEW, PREFIX, TREE, VOCAB, exact_joint, noisy, p_values

    base = noisy(Llama(ModelConfig.tiny(vocab_size=VOCAB), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)
    folder = write(tmp_path / "sglang", sglang_config(VOCAB, aux=(0, 0, 0), n=16), draft_tensors(VOCAB, seed=3, n=16))
    drafter = formats.load_drafter(folder, base, "eagle3")
    sampling = SamplingConfig(temperature=1.0)
    gen = SpeculativeGenerator(base, drafter, resolve_tree(TREE, "eagle3", drafter.depth), buckets=(8,))
    out = gen.generate([PREFIX] * 8192, NEW, sampling, seed=0, eos_ids=())
    hist = out.accept_hist.sum(0)
    assert (hist[1:] > 0).all() and hist[1:].sum() > 0.15 * hist.sum()  # drafts are accepted at every depth
    pv = p_values(np.array(out.tokens), exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv


def test_an_imported_drafter_drafts_the_authors_eagle2_tree(base_dir, base, tmp_path):
    """eagle2:20,3,4 (up to 5 deep) with SGLang's drafter: the tree the engine drafts
    is the one `eagle2_reference` (the authors' topK_genrate rule) selects when each node's
    log-probabilities come from the PyTorch reference run along the node's path."""
    from clover_jax.engine.drafting import draft_tree
    from clover_jax.trees.spec import resolve_tree
    from eagle2_reference import eagle2_tree
    from test_eagle2_tree import drafted_paths, reference_paths

    folder, tensors, aux = make_case("sglang", tmp_path / "sglang", base_dir)
    drafter = formats.load_drafter(folder, base)
    ref = reference("sglang", tensors, base_dir)
    hf, n = base_dir[0], 7
    v = hf.config.vocab_size
    tokens = np.random.default_rng(4).integers(3, v, (1, n + 1))
    tree = resolve_tree("eagle2:20,3,4", "eagle3", drafter.depth)

    @nnx.jit
    def drafted(base, drafter, tokens):
        out = base(tokens[:, :n], jnp.arange(n)[None], causal_self_mask(1, n), feature_layers=drafter.feature_layers)
        lens = jnp.full((1,), n, jnp.int32)
        new = Committed(out.hidden, out.hidden_normed, tokens[:, 1:], out.features)
        state = drafter.commit(base, drafter.init(base, 1, 32), new, lens, jnp.ones((1,), bool))
        return draft_tree(base, drafter, state, tree, tokens[:, n], lens)[0]

    got = drafted(base, drafter, jnp.asarray(tokens, jnp.int32))
    with torch.no_grad():
        states = hf(torch.tensor(tokens[:, :n]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in aux], -1)

    def log_probs(path):
        with torch.no_grad():
            draft = ref.chain(features, torch.tensor(tokens[:, 1:]), list(path))[-1]
        full = torch.full((v,), -torch.inf).index_put_((ref.targets,), draft)
        return torch.log_softmax(full, -1).numpy()

    want = eagle2_tree(log_probs, int(tokens[0, n]), 20, 3, 4)
    assert drafted_paths(got.tokens, got.tree, 0) == reference_paths(want)


def test_bfloat16_checkpoints_read_as_their_values(base_dir, base, tmp_path):
    """A drafter published in bfloat16 (most are) reads through `weights.read_tensors` as its values: the
    same drafter as its float32 copy of those values."""
    import ml_dtypes

    folder, tensors, _ = make_case("sglang", tmp_path / "f32", base_dir)
    halved = {k: t.astype(ml_dtypes.bfloat16) if t.dtype == np.float32 else t for k, t in tensors.items()}
    config = json.loads((folder / "config.json").read_text())
    bf16 = write(tmp_path / "bf16", {**config, "torch_dtype": "bfloat16"}, halved)
    f32 = write(tmp_path / "rounded", config, {k: t.astype(np.float32) if t.dtype == ml_dtypes.bfloat16 else t
                                              for k, t in halved.items()})
    assert weights.read_tensors(bf16, ("model.safetensors",))["fc.weight"].dtype == ml_dtypes.bfloat16
    want = state_of(formats.load_drafter(f32, base))
    for name, value in state_of(formats.load_drafter(bf16, base)).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
