"""DFlash, the block drafter: a drafter the authors' own package (`dflash` 0.1.0, `DFlashDraftModel`)
writes loads here and drafts what its forward drafts, on the first block and on the block after a
verification that rejected slots (the draft cache cropped as `dflash_generate` crops it); greedy
speculative output is plain decoding's on chains, static and dynamic trees at batch 1 and 4, with the
draft cache holding only committed context; training drafts what decoding drafts; exports load back
into the authors' model; bad checkpoints are one line each.

The base is conftest's tiny random Qwen3 (2 layers); the draft model has 2 Qwen3 layers of its own
shape (2 kv heads of 8, MLP 48, epsilon 1e-5, RoPE theta 5e4) and reads both base layers, the last
one's output after the final norm (HF's last hidden state), so that path is exercised too.
"""

from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters.base import Committed
from clover_jax.drafters.dflash import block_gamma, default_layer_ids, dflash_loss
from clover_jax.drafters.registry import drafter_config, make_drafter
from clover_jax.engine.decode import Generator, prefill
from clover_jax.engine.drafting import draft_tree
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.io import formats
from clover_jax.io.heads_dir import load_heads, save_heads
from clover_jax.trees.spec import resolve_tree
from conftest import assert_one_line

torch = pytest.importorskip("torch")
dflash_model = pytest.importorskip("dflash.model", reason="the authors' package: pip install --no-deps dflash==0.1.0")

BLOCK, MASK = 4, 63
PROMPT = [1, 5, 9, 3, 17, 22, 8]
PROMPTS = [[1, 7, 8, 9], PROMPT, [1, 2], [9] * 11]
MAX_NEW = 16
DRAFT = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
         "rms_norm_eps": 1e-5, "rope_theta": 50000.0}


def authors_model(base, seed: int = 0, cls_name: str = "DFlashDraftModel", **dflash_config):
    """A random DFlashDraftModel (the authors' class, or `cls_name`) for `base`, at weights of order one."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=base.cfg.vocab_size, hidden_size=base.cfg.hidden_size, num_hidden_layers=2,
                      max_position_embeddings=256, **DRAFT)
    cfg.num_target_layers = base.cfg.num_layers
    cfg.dflash_config = {"block_size": BLOCK, "target_layer_ids": [0, 1], "mask_token_id": MASK, **dflash_config}
    torch.manual_seed(seed)
    model = getattr(dflash_model, cls_name)(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module")
def qwen3(loaded):
    hf, _, _, base = loaded("qwen3-kv2")
    return hf, base


@pytest.fixture(scope="module")
def written(qwen3, tmp_path_factory):
    """(the authors' model, its save_pretrained directory)."""
    model = authors_model(qwen3[1])
    path = tmp_path_factory.mktemp("dflash")
    model.save_pretrained(path)
    return model, path


def reference_block(model, hf, seq, context_from, root, cache):
    """The authors' draft logits [b - 1, V] for the block rooted at `root` after committed tokens `seq`:
    the context fed is the target's features at positions context_from..len(seq)-1 (the ones the cache
    does not hold yet), and the cache is cropped back to len(seq) after the pass, as dflash_generate does."""
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        feats = dflash_model.extract_context_feature(out.hidden_states, model.target_layer_ids)[:, context_from:]
        block = torch.tensor([[root] + [MASK] * (BLOCK - 1)])
        noise = dflash_model._raw_input_embeddings(hf, block)
        start = len(seq)
        hidden = model(target_hidden=feats, noise_embedding=noise,
                       position_ids=torch.arange(context_from, start + BLOCK)[None], past_key_values=cache,
                       use_cache=True)[:, 1 - BLOCK:]
        dflash_model._crop_to(cache, start)
        return model.compute_logits(hidden, dflash_model._output_head(hf))[0].numpy()


def our_blocks(drafter, base, state, root, length):
    """Our drafter's logits [b - 1, V], depth by depth, for the block rooted at `root` (one sequence)."""
    tree = resolve_tree(f"chain:{BLOCK - 1}", "dflash", BLOCK - 1)

    class Recorder:
        feature_layers = drafter.feature_layers

        def __init__(self):
            self.logits = []

        def expand(self, base, state, frontier, vocab=None):
            logits, carry, state = drafter.expand(base, state, frontier, vocab)
            self.logits.append(np.asarray(logits)[0, 0])
            return logits, carry, state

    rec = Recorder()
    _, state = draft_tree(base, rec, state, tree, jnp.asarray([root]), jnp.asarray([length]))
    return np.stack(rec.logits), state


def committed(base, drafter, seq, following, start=0, state=None, count=None):
    """The drafter's state after committing positions start.. of `seq` (each followed by `following`'s
    token there), from a forward over the whole of seq; `count` of them kept (default all)."""
    tokens = jnp.asarray([seq], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq) + 8, feature_layers=drafter.feature_layers)
    state = drafter.init(base, 1, len(seq) + 64) if state is None else state
    new = Committed(out.hidden[:, start:], out.hidden_normed[:, start:], jnp.asarray([following[start:]], jnp.int32),
                    out.features[:, start:])
    n = len(seq) - start if count is None else count
    return drafter.commit(base, state, new, jnp.asarray([n]), jnp.ones((1,), bool))


def test_the_authors_checkpoint_drafts_as_their_forward(qwen3, written):
    """Loaded through --heads, the first block's logits and, after a verification that accepted one of
    the three drafts (the features of its 4 verified positions committed, 2 of them kept), the next
    block's, equal the authors' forward over their cropped cache."""
    hf, base = qwen3
    model, path = written
    drafter = load_heads(path, base, "dflash")
    assert drafter.feature_layers == (0, 1) and drafter.depth == BLOCK - 1 and drafter.hcfg.mask_token_id == MASK
    cache = dflash_model._make_cache(model.config)
    plain = Generator(base).generate([PROMPT], 8, eos_ids=[]).tokens[0]
    root = plain[0]
    want = reference_block(model, hf, PROMPT, 0, root, cache)
    state = committed(base, drafter, PROMPT, PROMPT[1:] + [root])
    got, state = our_blocks(drafter, base, state, root, len(PROMPT))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == len(PROMPT)

    drafts = list(np.argmax(got, -1))
    verified = PROMPT + [root] + drafts  # the step verified the root and its 3 drafts; 2 of them stay
    bonus = plain[1] if drafts[0] != plain[1] else (plain[1] + 1) % base.cfg.vocab_size
    kept = PROMPT + [root, drafts[0]]
    want = reference_block(model, hf, kept, len(PROMPT), bonus, cache)
    following = verified[1:] + [0]
    following[len(kept) - 1] = bonus
    state = committed(base, drafter, verified, following, start=len(PROMPT), state=state, count=2)
    assert int(state.cache.lengths[0]) == len(kept)
    got, _ = our_blocks(drafter, base, state, bonus, len(kept))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_decoding_accepts_what_the_authors_loop_accepts(qwen3, tmp_path, monkeypatch, seed):
    """Our chain of b - 1 at batch 4 accepts, step by step, what `dflash_generate` (the authors' loop,
    batch 1, greedy, their drafter on the HF target) accepts on each prompt, and writes its text. Their
    loop shrinks the last block to the tokens left, so it runs BLOCK tokens longer and only the steps
    ours takes are compared."""
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # their stats time with CUDA
    hf, base = qwen3
    model = authors_model(base, seed=seed)
    model.save_pretrained(tmp_path)
    new = 40
    out = SpeculativeGenerator(base, load_heads(tmp_path, base), resolve_tree(f"chain:{BLOCK - 1}", "dflash", BLOCK - 1)
                               ).generate(PROMPTS, new, eos_ids=[])
    for i, prompt in enumerate(PROMPTS):
        ref = dflash_model.dflash_generate(model, hf, torch.tensor([prompt]), new + BLOCK, None, return_stats=True)
        steps = int(np.searchsorted(1 + np.cumsum(ref.acceptance_lengths), new)) + 1
        want = np.bincount(np.asarray(ref.acceptance_lengths[:steps]) - 1, minlength=BLOCK)
        np.testing.assert_array_equal(np.asarray(out.accept_hist)[i], want)
        assert ref.output_ids[0, len(prompt):len(prompt) + new].tolist() == out.tokens[i]
    assert np.asarray(out.accept_hist)[:, 1:].sum() > 0


def test_output_scaling_and_softcapping_match_the_authors(qwen3, tmp_path):
    """input_embedding_scale, output_multiplier and final_logit_softcapping, as their forward applies them."""
    hf, base = qwen3
    model = authors_model(base, seed=5, input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=3.0)
    model.save_pretrained(tmp_path)
    drafter = load_heads(tmp_path, base)
    cache = dflash_model._make_cache(model.config)
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT]), output_hidden_states=True)
        feats = dflash_model.extract_context_feature(out.hidden_states, model.target_layer_ids)
        noise = dflash_model._raw_input_embeddings(hf, torch.tensor([[5] + [MASK] * (BLOCK - 1)]), 1.7)
        hidden = model(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(len(PROMPT) + BLOCK)[None],
                       past_key_values=cache, use_cache=True)[:, 1 - BLOCK:]
        want = model.compute_logits(hidden, hf.lm_head)[0].numpy()
    got, _ = our_blocks(drafter, base, committed(base, drafter, PROMPT, PROMPT[1:] + [5]), 5, len(PROMPT))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(got).max() <= 3.0


def perturbed_drafter(base, depth: int = BLOCK - 1):
    drafter = make_drafter(drafter_config("dflash", depth, draft_layers=2, target_layer_ids=[0, 1]), base, seed=3)
    leaves, treedef = jax.tree.flatten(nnx.state(drafter, nnx.Param))
    keys = jax.random.split(jax.random.key(4), len(leaves))
    nnx.update(drafter, jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                                     for x, k in zip(leaves, keys)]))
    return drafter


@pytest.mark.parametrize("spec, batch", [("chain:3", 1), ("chain:3", 4), ("widths:3,2,2", 4), ("default", 1),
                                         ("dynamic:8", 4), ("eagle2:10,3,2", 1)])
def test_greedy_decodes_as_plain_and_the_cache_holds_committed_context_only(qwen3, spec, batch):
    """Greedy output equals plain decoding; the draft cache then holds exactly what committing the
    prompt and the accepted text from scratch writes."""
    base = qwen3[1]
    plain = Generator(base).generate(PROMPTS, MAX_NEW + 8, eos_ids=[]).tokens
    drafter = perturbed_drafter(base)
    gen = SpeculativeGenerator(base, drafter, resolve_tree(spec, "dflash", BLOCK - 1))
    rows = list(range(len(PROMPTS))) if batch == 4 else [1]
    out = gen.generate([PROMPTS[i] for i in rows], MAX_NEW, eos_ids=[])
    assert out.tokens == [plain[i][:MAX_NEW] for i in rows]
    if batch == 4:  # some drafts were accepted, so commits kept more than one position
        assert np.asarray(out.accept_hist)[:, 1:].sum() > 0
    state = out.state.draft
    for j, i in enumerate(rows):
        length = int(state.cache.lengths[j])
        assert length == int(out.state.plain.cache.lengths[j])
        seq = PROMPTS[i] + plain[i][: length - len(PROMPTS[i])]
        fresh = committed(base, drafter, seq, seq[1:] + [plain[i][length - len(PROMPTS[i])]])
        for layer in range(2):
            np.testing.assert_allclose(np.asarray(state.cache.k[layer])[j, :, :length],
                                       np.asarray(fresh.cache.k[layer])[0, :, :length], atol=1e-4, rtol=1e-4)


def test_training_drafts_what_decoding_drafts(qwen3):
    """train_forward's entry [k, 0, t] equals decoding's depth-k logits after committing tokens 0..t
    with root t + 1."""
    base = qwen3[1]
    drafter = perturbed_drafter(base)
    seq = PROMPTS[1] + [11, 12, 40, 3]
    tokens = jnp.asarray([seq], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq), feature_layers=drafter.feature_layers)
    _, logits = drafter.train_forward(base, tokens, out.hidden, out.hidden_normed, out.features)
    assert logits.shape == (BLOCK - 1, 1, len(seq), base.cfg.vocab_size)
    for t in (0, 3, len(seq) - 2):
        state = committed(base, drafter, seq[: t + 1], seq[1 : t + 2])
        got, _ = our_blocks(drafter, base, state, seq[t + 1], t + 1)
        np.testing.assert_allclose(np.asarray(logits[:, 0, t]), got, atol=1e-4, rtol=1e-4)


def test_the_loss_weights_block_positions_by_the_papers_decay():
    k, b, t, v = BLOCK - 1, 2, 6, 11
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(k, b, t, v)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.ones((b, t))
    loss, per_step, _, _ = dflash_loss(None, logits, None, None, tokens, mask)
    gamma = block_gamma(BLOCK)
    want = []
    for j in range(k):
        ce = [-jax.nn.log_softmax(logits[j, i, p])[tokens[i, p + j + 2]] for i in range(b) for p in range(t - j - 2)]
        want.append(float(np.mean(ce)))
    np.testing.assert_allclose(per_step, want, rtol=1e-5)
    np.testing.assert_allclose(loss, sum(math.exp(-j / gamma) * w for j, w in enumerate(want)), rtol=1e-5)
    assert (block_gamma(16), block_gamma(10), block_gamma(8), block_gamma(4)) == (7.0, 5.0, 4.0, 4.0)
    assert default_layer_ids(36, 1) == (18,) and default_layer_ids(36, 5) == (1, 9, 17, 25, 33)


def test_exports_load_back_into_the_authors_model_and_ours(qwen3, written, tmp_path):
    base = qwen3[1]
    model, path = written
    drafter = load_heads(path, base)
    formats.exporter("dflash").export(drafter, base, tmp_path / "out")
    theirs = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "out").eval()
    for name, p in model.state_dict().items():
        np.testing.assert_array_equal(theirs.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    assert theirs.block_size == BLOCK and theirs.target_layer_ids == [0, 1] and theirs.mask_token_id == MASK
    save_heads(drafter, base, tmp_path / "ours")
    again = load_heads(tmp_path / "ours", base, "dflash")
    assert again.hcfg == drafter.hcfg
    state = committed(base, drafter, PROMPT, PROMPT[1:] + [5])
    np.testing.assert_array_equal(our_blocks(again, base, state, 5, len(PROMPT))[0],
                                  our_blocks(drafter, base, state, 5, len(PROMPT))[0])


@pytest.mark.parametrize("case, edit, message", [
    ("block size 0", {"dflash_config.block_size": 0}, "block_size 0 must be an integer >= 2"),
    ("block above the tree budget", {"dflash_config.block_size": 4097}, "block size 4097 is above the 4096 nodes"),
    ("mask token outside", {"dflash_config.mask_token_id": 64}, "mask_token_id 64 is outside the base model's vocabulary"),
    ("no mask token", {"dflash_config.mask_token_id": None}, "mask_token_id"),
    ("unknown option", {"dflash_config.block_rotation": 2}, "dflash_config has unknown key 'block_rotation'"),
    ("DFlash 2 key", {"dflash_config.selector_rank": 8}, "selector_rank is a DFlash 2 key"),
    ("DFlash 2 model", {"architectures": ["DFlash2DraftModel"]}, "dflash_config has no conv_kernel_size"),
    ("sliding layer", {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
                       "sliding_window": 4}, "sliding_attention draft layers"),
    ("causal block", {"is_causal": True}, "is_causal True"),
    ("other target", {"num_target_layers": 36}, "num_target_layers 36"),
    ("layer outside", {"dflash_config.target_layer_ids": [0, 5]}, "target_layer_ids [0, 5]"),
    ("unknown tensor", {"tensor": "layers.0.attention_conv.base_kernel"}, "has tensor layers.0.attention_conv.base_kernel"),
])
def test_bad_checkpoints_are_one_line_each(qwen3, written, tmp_path, case, edit, message):
    from safetensors.numpy import load_file, save_file

    base = qwen3[1]
    _, path = written
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    for key, value in edit.items():
        if key == "tensor":
            tensors[value] = np.zeros((3,), np.float32)
        elif key.startswith("dflash_config."):
            config["dflash_config"][key.split(".", 1)[1]] = value
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CloverError) as e:
        load_heads(tmp_path, base)
    assert message in str(e.value), str(e.value)
    assert_one_line(e)


@pytest.mark.parametrize("tree", ["widths:3,2,1", "dynamic:7"])
def test_speculative_sampling_has_the_base_distribution(monkeypatch, tree):
    """test_spec_sampling's chi-square check (24,576 samples of 4 tokens against the exact joint) with a
    DFlash drafter of block 4, on a static and a dynamic tree. Its logits are tripled
    (output_multiplier 3): a random drafter's flat distributions would fill a dynamic tree's budget at
    depth 1 and leave the deeper drafts untested."""
    import test_spec_sampling as spec
    from clover_jax.engine.sampling import SamplingConfig
    from clover_jax.model.config import ModelConfig
    from clover_jax.model.llama import Llama

    base = spec.noisy(Llama(ModelConfig.tiny(vocab_size=spec.VOCAB), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)
    monkeypatch.setattr(spec, "noisy_heads", lambda base, method: spec.noisy(
        make_drafter(drafter_config(method, 3, output_multiplier=3.0), base, seed=2), 0.05, seed=3, replace=False))
    sampling = SamplingConfig(temperature=1.0)
    pv = spec.p_values(spec.sample_tokens(base, "dflash", sampling, tree), spec.exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv
