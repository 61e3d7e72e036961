"""DFlash 2 (the authors' `DFlash2DraftModel`): DFlash with grouped dynamic causal convolutions around
each layer's attention and MLP and a candidate selector over each position's top-k. A checkpoint their
package writes (codebooks without `.weight`, as published, or with it, as save_pretrained writes them)
loads here: the selector's greedy path is their `propose`'s on the first block and after a verification
that rejected slots, each node's scores are their top-k logits plus their bilinear term, and decoding
accepts step by step what their `dflash_generate` accepts. Greedy output is plain decoding's on chains,
static and dynamic trees at batch 1 and 4; sampling keeps the base distribution; training scores what
decoding scores; exports load back into their class.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from clover_jax.drafters.base import Frontier
from clover_jax.drafters.draft_model import NO_LOGIT
from clover_jax.drafters.registry import drafter_config, make_drafter
from clover_jax.engine.decode import Generator, prefill
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.io import formats
from clover_jax.io.heads_dir import load_heads, save_heads
from clover_jax.trees.spec import resolve_tree
from test_dflash import BLOCK, MASK, PROMPT, PROMPTS, authors_model, committed, our_blocks, qwen3, reference_block  # noqa: F401

torch = pytest.importorskip("torch")
dflash_model = pytest.importorskip("dflash.model", reason="the authors' package: pip install --no-deps dflash==0.1.0")

TWO = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def published(model, path):
    """`model` saved as DFlash 2 drafters are published: its codebooks without `.weight`."""
    model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in CODEBOOKS:
        tensors[name] = tensors.pop(f"{name}.weight")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def written(qwen3, tmp_path_factory):
    model = authors_model(qwen3[1], seed=2, cls_name="DFlash2DraftModel", **TWO)
    return model, published(model, tmp_path_factory.mktemp("dflash2"))


def their_path(model, hf, seq, context_from, root, cache):
    """(the selector's greedy path [b - 1], candidates [b - 1, k], draft hidden [b - 1, D]) of their
    model for the block rooted at `root` after `seq`, the cache cropped as dflash_generate crops it."""
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        feats = dflash_model.extract_context_feature(out.hidden_states, model.target_layer_ids)[:, context_from:]
        noise = dflash_model._raw_input_embeddings(hf, torch.tensor([[root] + [MASK] * (BLOCK - 1)]))
        hidden = model(target_hidden=feats, noise_embedding=noise,
                       position_ids=torch.arange(context_from, len(seq) + BLOCK)[None], past_key_values=cache,
                       use_cache=True)[:, 1 - BLOCK:]
        dflash_model._crop_to(cache, len(seq))
        path, candidates, _ = model.propose(hidden, torch.tensor([root]), hf.lm_head, 0.0)
    return path[0].tolist(), candidates[0].numpy(), hidden


def their_scores(model, hf, hidden, position, parent, candidates):
    """Their selector's scores [k] at `position` for `parent`'s children (the body of their `select`)."""
    sel = model.candidate_selector
    with torch.no_grad():
        unary = model.compute_logits(hidden, hf.lm_head)[0, position, torch.tensor(candidates)]
        bilinear = (sel.predecessor_codebook(torch.tensor(parent)) * sel.hidden_projection(hidden[0, position])
                    ) @ sel.successor_codebook(torch.tensor(candidates)).T
    return (unary + bilinear).numpy()


def check_block(drafter, base, state, root, length, model, hf, hidden, path, candidates):
    """Our chain from `root` follows their path, and each of its nodes scores exactly their candidates."""
    got, state = our_blocks(drafter, base, state, root, length)
    parents = [root] + path[:-1]
    for k in range(BLOCK - 1):
        finite = np.flatnonzero(got[k] > NO_LOGIT / 2)
        assert sorted(finite) == sorted(candidates[k])
        np.testing.assert_allclose(got[k][candidates[k]], their_scores(model, hf, hidden, k, parents[k], candidates[k]),
                                   atol=1e-4, rtol=1e-4)
    assert list(np.argmax(got, -1)) == path
    return state


@pytest.mark.parametrize("form", ["published", "save_pretrained"])
def test_the_authors_checkpoint_drafts_as_their_model(qwen3, written, tmp_path, form):
    hf, base = qwen3
    model, path = written
    if form == "save_pretrained":
        model.save_pretrained(tmp_path)
        path = tmp_path
    drafter = load_heads(path, base, "dflash2")
    cache = dflash_model._make_cache(model.config)
    plain = Generator(base).generate([PROMPT], 8, eos_ids=[]).tokens[0]
    root = plain[0]
    want_path, cands, hidden = their_path(model, hf, PROMPT, 0, root, cache)
    state = committed(base, drafter, PROMPT, PROMPT[1:] + [root])
    state = check_block(drafter, base, state, root, len(PROMPT), model, hf, hidden, want_path, cands)

    verified = PROMPT + [root] + want_path
    bonus = plain[1] if want_path[0] != plain[1] else (plain[1] + 1) % base.cfg.vocab_size
    kept = PROMPT + [root, want_path[0]]
    path2, cands2, hidden2 = their_path(model, hf, kept, len(PROMPT), bonus, cache)
    following = verified[1:] + [0]
    following[len(kept) - 1] = bonus
    state = committed(base, drafter, verified, following, start=len(PROMPT), state=state, count=2)
    check_block(drafter, base, state, bonus, len(kept), model, hf, hidden2, path2, cands2)
    np.testing.assert_allclose(  # the unary logits too: DFlash's forward, convolutions included
        reference_block(model, hf, PROMPT, 0, root, dflash_model._make_cache(model.config)),
        np.asarray(drafter.scores(base, committed_block(drafter, base, root))), atol=1e-4, rtol=1e-4)


def committed_block(drafter, base, root):
    """Our block outputs [b - 1, D] at positions 1..b-1 after committing PROMPT, rooted at `root`."""
    state = committed(base, drafter, PROMPT, PROMPT[1:] + [root])
    return drafter.run_block(base, state.cache, jnp.asarray([root]))[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_decoding_accepts_what_the_authors_loop_accepts(qwen3, tmp_path, monkeypatch, seed):
    """As for DFlash (tests/test_dflash.py): our chain at batch 4 against their greedy loop per prompt."""
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    hf, base = qwen3
    model = authors_model(base, seed=seed, cls_name="DFlash2DraftModel", **TWO)
    new = 40
    drafter = load_heads(published(model, tmp_path), base)
    out = SpeculativeGenerator(base, drafter, resolve_tree(f"chain:{BLOCK - 1}", "dflash2", BLOCK - 1)
                               ).generate(PROMPTS, new, eos_ids=[])
    for i, prompt in enumerate(PROMPTS):
        ref = dflash_model.dflash_generate(model, hf, torch.tensor([prompt]), new + BLOCK, None, return_stats=True)
        steps = int(np.searchsorted(1 + np.cumsum(ref.acceptance_lengths), new)) + 1
        want = np.bincount(np.asarray(ref.acceptance_lengths[:steps]) - 1, minlength=BLOCK)
        np.testing.assert_array_equal(np.asarray(out.accept_hist)[i], want)
        assert ref.output_ids[0, len(prompt):len(prompt) + new].tolist() == out.tokens[i]


def perturbed_drafter(base, **options):
    drafter = make_drafter(drafter_config("dflash2", BLOCK - 1, draft_layers=2, target_layer_ids=[0, 1], **TWO,
                                          **options), base, seed=3)
    leaves, treedef = jax.tree.flatten(nnx.state(drafter, nnx.Param))
    keys = jax.random.split(jax.random.key(4), len(leaves))
    nnx.update(drafter, jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                                     for x, k in zip(leaves, keys)]))
    return drafter


@pytest.mark.parametrize("spec, batch", [("chain:3", 4), ("widths:3,2,2", 1), ("dynamic:8", 1), ("eagle2:10,3,2", 4)])
def test_greedy_decodes_as_plain_and_the_cache_holds_committed_context_only(qwen3, spec, batch):
    base = qwen3[1]
    plain = Generator(base).generate(PROMPTS, 24, eos_ids=[]).tokens
    drafter = perturbed_drafter(base)
    rows = list(range(len(PROMPTS))) if batch == 4 else [1]
    out = SpeculativeGenerator(base, drafter, resolve_tree(spec, "dflash2", BLOCK - 1)).generate(
        [PROMPTS[i] for i in rows], 16, eos_ids=[])
    assert out.tokens == [plain[i][:16] for i in rows]
    state = out.state.draft
    for j, i in enumerate(rows):
        length = int(state.cache.lengths[j])
        seq = PROMPTS[i] + plain[i][: length - len(PROMPTS[i])]
        fresh = committed(base, drafter, seq, seq[1:] + [plain[i][length - len(PROMPTS[i])]])
        np.testing.assert_allclose(np.asarray(state.cache.k[1])[j, :, :length],
                                   np.asarray(fresh.cache.k[1])[0, :, :length], atol=1e-4, rtol=1e-4)


def test_training_scores_what_decoding_scores(qwen3):
    """train_forward's entry [k, 0, t], on the candidates decoding scores after committing tokens 0..t
    (the chain of the data's tokens from root t + 1), equals decoding's scores there; `drafted_logits`
    keeps those candidates only, so evaluation ranks what decoding drafts."""
    base = qwen3[1]
    drafter = perturbed_drafter(base)
    seq = PROMPTS[1] + [11, 12, 40, 3]
    tokens = jnp.asarray([seq], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq), feature_layers=drafter.feature_layers)
    hidden, logits = drafter.train_forward(base, tokens, out.hidden, out.hidden_normed, out.features)
    drafted = np.asarray(drafter.drafted_logits(base, hidden, logits))  # what evaluation ranks and replays
    for t in (0, 3, len(seq) - 5):
        state = committed(base, drafter, seq[: t + 1], seq[1 : t + 2])
        carry = None
        for k in range(BLOCK - 1):  # the chain of the data's tokens, one node a level
            frontier = Frontier(tokens=jnp.asarray([[seq[t + 1 + k]]]), parents=jnp.zeros((1, 1), jnp.int32),
                                slots=jnp.full((1, 1), k, jnp.int32), ancestors=jnp.asarray(np.arange(BLOCK) <= k)[None, None],
                                positions=jnp.asarray([[t + 1 + k]]), carry=carry, depth=k)
            got, carry, state = drafter.expand(base, state, frontier)
            got = np.asarray(got)[0, 0]
            finite = got > NO_LOGIT / 2
            np.testing.assert_allclose(np.asarray(logits[k, 0, t])[finite], got[finite], atol=1e-4, rtol=1e-4)
            np.testing.assert_array_equal(drafted[k, 0, t] > NO_LOGIT / 2, finite)  # the same candidates
            np.testing.assert_allclose(drafted[k, 0, t], got, atol=1e-4, rtol=1e-4)


def test_exports_load_back_into_the_authors_model_and_ours(qwen3, written, tmp_path):
    base = qwen3[1]
    model, path = written
    drafter = load_heads(path, base)
    formats.exporter("dflash2").export(drafter, base, tmp_path / "out")
    assert set(CODEBOOKS) <= set(load_file(str(tmp_path / "out" / "model.safetensors")))
    theirs = dflash_model.DFlash2DraftModel.from_pretrained(tmp_path / "out").eval()
    for name, p in model.state_dict().items():
        np.testing.assert_array_equal(theirs.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    save_heads(drafter, base, tmp_path / "ours")
    assert load_heads(tmp_path / "ours", base, "dflash2").hcfg == drafter.hcfg


def test_a_fresh_drafter_drafts_as_dflash(qwen3):
    """Its convolutions start as the identity: a fresh DFlash 2 drafter's block outputs are a DFlash
    drafter's of the same weights, and with the selector's term off (a zero codebook) so is its chain."""
    base = qwen3[1]
    two = make_drafter(drafter_config("dflash2", BLOCK - 1, **TWO), base, seed=5)
    one = make_drafter(drafter_config("dflash", BLOCK - 1), base, seed=5)
    nnx.update(one, nnx.state(two, nnx.Param).filter(lambda path, _: path[0] != "candidate_selector"
                                                     and "conv" not in str(path)))
    two.candidate_selector.predecessor_codebook[...] = jnp.zeros_like(two.candidate_selector.predecessor_codebook[...])
    np.testing.assert_allclose(committed_block(one, base, 5), committed_block(two, base, 5), atol=1e-6)
    state = committed(base, one, PROMPT, PROMPT[1:] + [5])
    a, _ = our_blocks(one, base, state, 5, len(PROMPT))
    b, _ = our_blocks(two, base, committed(base, two, PROMPT, PROMPT[1:] + [5]), 5, len(PROMPT))
    np.testing.assert_array_equal(np.argmax(a, -1), np.argmax(b, -1))


@pytest.mark.parametrize("tree", ["widths:3,2,1", "dynamic:7"])
def test_speculative_sampling_has_the_base_distribution(monkeypatch, tree):
    """test_spec_sampling's chi-square check with a DFlash 2 drafter of block 4 (logits tripled, as in
    tests/test_dflash.py): each node drafts from its own selector scores over 12 of the 24 tokens."""
    import test_spec_sampling as spec
    from clover_jax.engine.sampling import SamplingConfig
    from clover_jax.model.config import ModelConfig
    from clover_jax.model.llama import Llama

    base = spec.noisy(Llama(ModelConfig.tiny(vocab_size=spec.VOCAB), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)
    monkeypatch.setattr(spec, "noisy_heads", lambda base, method: spec.noisy(
        make_drafter(drafter_config(method, 3, output_multiplier=3.0, **{**TWO, "selector_top_k": 12}), base, seed=2),
        0.05, seed=3, replace=False))
    sampling = SamplingConfig(temperature=1.0)
    pv = spec.p_values(spec.sample_tokens(base, "dflash2", sampling, tree), spec.exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv
