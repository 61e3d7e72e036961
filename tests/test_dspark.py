"""DSpark (SpecForge 0.2.0's `DSparkDraftModel`): DFlash with a Markov head. With a tiny random
DSparkDraftModel's weights copied in, each Markov head's corrected logits along our chain are those
their `sample_block_tokens` draws greedily from, on the first block and on the block after a
verification that rejected slots (their draft cache cropped as their `spec_generate` crops it), and
their `apply_block_logits` (training's) gives the same along the same path. Greedy output is plain
decoding's on chains, static and dynamic trees at batch 1 and 4; training scores what decoding scores
on the data's chain; a bad option is one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters.base import Frontier
from clover_jax.drafters.registry import drafter_config, make_drafter
from clover_jax.engine.decode import Generator, prefill
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.io.formats.eagle3_layout import read_params
from clover_jax.trees.spec import resolve_tree
from conftest import assert_one_line
from test_dflash import BLOCK, DRAFT, MASK, PROMPT, PROMPTS, committed, our_blocks, qwen3  # noqa: F401

torch = pytest.importorskip("torch")
dspark = pytest.importorskip("specforge.modeling.draft.dspark", reason="SpecForge 0.2.0: pip install specforge==0.2.0")

HEADS = ("vanilla", "gated", "rnn")
RANK = 6


def specforge_model(base, cls, seed: int = 0, **dflash_config):
    """A tiny random SpecForge DFlash-family draft model `cls` for `base` (2 Qwen3 layers reading both
    base layers), its weights of order one."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=base.cfg.vocab_size, hidden_size=base.cfg.hidden_size, num_hidden_layers=2,
                      max_position_embeddings=256, **DRAFT)
    cfg.num_target_layers, cfg.block_size = base.cfg.num_layers, BLOCK
    cfg.dflash_config = {"target_layer_ids": [0, 1], "mask_token_id": MASK, **dflash_config}
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model


def ours_of(model, base, method: str, renames: dict, **options):
    """Our `method` drafter holding `model`'s weights (their names, `renames` applied)."""
    drafter = make_drafter(drafter_config(method, BLOCK - 1, draft_layers=2, target_layer_ids=[0, 1],
                                          mask_token_id=MASK, draft_layer={**DRAFT, "rope_scaling": None},
                                          **options), base)
    tensors = {renames.get(k, k): v.numpy() for k, v in model.state_dict().items()}
    assert read_params(drafter, tensors, Path("specforge"), "") == set(tensors)
    return drafter


def their_hidden(model, hf, seq, context_from, root, cache):
    """Their normed draft outputs [1, b, D] for the block rooted at `root` after committed `seq` (the
    target's features from context_from on fed, the cache cropped back to len(seq) after, as
    `spec_generate` does; its `crop(start)` is refused by transformers 5, which crops by a negative
    count)."""
    from specforge.modeling.draft.dflash import extract_context_feature

    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, model.target_layer_ids)[:, context_from:]
        noise = hf.model.embed_tokens(torch.tensor([[root] + [MASK] * (BLOCK - 1)]))
        hidden = model(target_hidden=feats, noise_embedding=noise,
                       position_ids=torch.arange(context_from, len(seq) + BLOCK)[None], past_key_values=cache,
                       use_cache=True, is_causal=False)
        cache.crop(len(seq) - cache.get_seq_length())  # their crop(start), in this transformers' terms
    return hidden


def their_chain(model, hf, hidden, root):
    """(their greedy block [b - 1], its corrected logits [b - 1, V]) from `_sample_draft_tokens`'s
    path, and the training path's `apply_block_logits` over the same predecessors."""
    with torch.no_grad():
        proposal = hidden[:, 1 - BLOCK:]
        base_logits = hf.lm_head(proposal)
        tokens, logits = model.markov_head.sample_block_tokens(base_logits, first_prev_token_ids=torch.tensor([root]),
                                                               hidden_states=proposal)
        prev = torch.cat([torch.tensor([[root]]), tokens[:, :-1]], 1)
        trained = model.apply_logits_head(base_logits, prev_token_ids=prev, hidden_states=proposal)
    np.testing.assert_allclose(trained.numpy(), logits.numpy(), atol=1e-5, rtol=1e-5)
    return tokens[0].tolist(), logits[0].numpy()


def the_blocks_are_theirs(model, hf, base, drafter, their_chain):
    """Our drafted blocks against theirs (`their_chain(model, hf, hidden, root)`: their greedy block and
    its corrected logits): the first after the prompt, then the one after a verification that kept 2 of
    its 4 slots. Returns (our first block's logits [b - 1, V], its root)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    plain = Generator(base).generate([PROMPT], 8, eos_ids=[]).tokens[0]
    root = plain[0]
    want_tokens, want = their_chain(model, hf, their_hidden(model, hf, PROMPT, 0, root, cache), root)
    state = committed(base, drafter, PROMPT, PROMPT[1:] + [root])
    first, state = our_blocks(drafter, base, state, root, len(PROMPT))
    np.testing.assert_allclose(first, want, atol=1e-4, rtol=1e-4)
    assert list(np.argmax(first, -1)) == want_tokens

    verified = PROMPT + [root] + want_tokens  # the step verified the root and its 3 drafts; 2 of them stay
    bonus = plain[1] if want_tokens[0] != plain[1] else (plain[1] + 1) % base.cfg.vocab_size
    kept = PROMPT + [root, want_tokens[0]]
    want_tokens, want = their_chain(model, hf, their_hidden(model, hf, kept, len(PROMPT), bonus, cache), bonus)
    following = verified[1:] + [0]
    following[len(kept) - 1] = bonus
    state = committed(base, drafter, verified, following, start=len(PROMPT), state=state, count=2)
    got, _ = our_blocks(drafter, base, state, bonus, len(kept))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert list(np.argmax(got, -1)) == want_tokens
    return first, root


@pytest.mark.parametrize("kind", HEADS)
def test_the_corrected_block_is_specforges(qwen3, kind):
    hf, base = qwen3
    model = specforge_model(base, dspark.DSparkDraftModel, seed=len(kind), markov_rank=RANK, markov_head_type=kind)
    drafter = ours_of(model, base, "dspark", {"markov_head.markov_w1.weight": "markov_head.markov_w1"},
                      markov_rank=RANK, markov_head_type=kind)
    the_blocks_are_theirs(model, hf, base, drafter, their_chain)


def perturbed(base, method: str, seed: int = 3, **options):
    drafter = make_drafter(drafter_config(method, BLOCK - 1, draft_layers=2, target_layer_ids=[0, 1], **options),
                           base, seed=seed)
    leaves, treedef = jax.tree.flatten(nnx.state(drafter, nnx.Param))
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    nnx.update(drafter, jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                                     for x, k in zip(leaves, keys)]))
    return drafter


def greedy_is_plain(base, drafter, method: str, spec: str, batch: int, draft_vocab: int = 0):
    """Greedy speculative output is plain decoding's (drafting from the first `draft_vocab` ids, 0: all)."""
    from clover_jax.drafters.vocab import DraftVocab

    plain = Generator(base).generate(PROMPTS, 16, eos_ids=[]).tokens
    rows = list(range(len(PROMPTS))) if batch == 4 else [1]
    vocab = DraftVocab.most_frequent(base.lm_head_weight(), None, draft_vocab) if draft_vocab else None
    out = SpeculativeGenerator(base, drafter, resolve_tree(spec, method, BLOCK - 1), draft_vocab=vocab).generate(
        [PROMPTS[i] for i in rows], 16, eos_ids=[])
    assert out.tokens == [plain[i][:16] for i in rows]
    if batch == 4:  # drafts were accepted, so commits kept more than one position
        assert np.asarray(out.accept_hist)[:, 1:].sum() > 0


CASES = [("rnn", "chain:3", 1), ("rnn", "chain:3", 4), ("rnn", "widths:3,2,2", 4), ("rnn", "widths:3,2,2", 1),
         ("rnn", "eagle2:10,3,2", 1), ("rnn", "eagle2:10,3,2", 4), ("vanilla", "widths:3,2,2", 4),
         ("vanilla", "dynamic:8", 1), ("gated", "chain:3", 4), ("gated", "eagle2:10,3,2", 1)]


@pytest.mark.parametrize("kind, spec, batch", CASES)
def test_greedy_decodes_as_plain(qwen3, kind, spec, batch):
    base = qwen3[1]
    greedy_is_plain(base, perturbed(base, "dspark", markov_rank=RANK, markov_head_type=kind), "dspark", spec, batch)


def chain_logits(base, drafter, state, path):
    """[len(path), V] the logits `expand` gives each node of the chain of tokens `path` (root first),
    each node's carry handed to its child."""
    carry, out = None, []
    length = int(state.cache.lengths[0])
    for k, token in enumerate(path):
        frontier = Frontier(tokens=jnp.asarray([[token]]), parents=jnp.zeros((1, 1), jnp.int32),
                            slots=jnp.full((1, 1), k, jnp.int32),
                            ancestors=jnp.asarray(np.arange(BLOCK) <= k)[None, None],
                            positions=jnp.asarray([[length + k]]), carry=carry, depth=k)
        got, carry, state = drafter.expand(base, state, frontier)
        out.append(np.asarray(got)[0, 0])
    return np.stack(out)


def tree_nodes_score_their_paths(base, drafter, spec: str):
    """Every node of a static tree drafted after PROMPT scores its children as the chain of its own path
    does: its state (an rnn's, a GRU's) follows its ancestors, not its depth's other nodes."""
    from clover_jax.engine.drafting import draft_tree

    levels = []

    class Recorder:
        feature_layers = drafter.feature_layers

        def expand(self, base, state, frontier, vocab=None):
            logits, carry, state = drafter.expand(base, state, frontier, vocab)
            levels.append((np.asarray(frontier.tokens)[0], np.asarray(frontier.parents)[0], np.asarray(logits)[0]))
            return logits, carry, state

    state = committed(base, drafter, PROMPT, PROMPT[1:] + [5])
    draft_tree(base, Recorder(), state, resolve_tree(spec, "dflash", BLOCK - 1), jnp.asarray([5]),
               jnp.asarray([len(PROMPT)]))
    paths = [[[5]]]
    for tokens, parents, _ in levels[1:]:
        paths.append([paths[-1][p] + [int(t)] for t, p in zip(tokens, parents)])
    assert max(len(level[0]) for level in levels) > 1
    for (_, _, logits), level_paths in zip(levels, paths):
        for node, path in enumerate(level_paths):
            own = logits[node if len(logits) > 1 else 0]  # [1, V]: the level's nodes share it
            np.testing.assert_allclose(own, chain_logits(base, drafter, state, path)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", HEADS)
def test_each_tree_node_scores_its_own_path(qwen3, kind):
    base = qwen3[1]
    drafter = perturbed(base, "dspark", markov_rank=RANK, markov_head_type=kind)
    tree_nodes_score_their_paths(base, drafter, "widths:3,2,2")


@pytest.mark.parametrize("kind", HEADS)
def test_a_draft_vocabulary_drafts_from_its_columns(qwen3, kind):
    base = qwen3[1]
    drafter = perturbed(base, "dspark", markov_rank=RANK, markov_head_type=kind)
    greedy_is_plain(base, drafter, "dspark", "widths:3,2,2", 4, draft_vocab=40)


def training_scores_what_decoding_scores(base, drafter):
    """train_forward's entry [k, 0, t] equals the logits `expand` gives the depth-k node of the chain of
    the data's tokens from root t + 1."""
    seq = PROMPTS[1] + [11, 12, 40, 3]
    tokens = jnp.asarray([seq], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq), feature_layers=drafter.feature_layers)
    _, logits = drafter.train_forward(base, tokens, out.hidden, out.hidden_normed, out.features)
    for t in (0, 3, len(seq) - 5):
        state = committed(base, drafter, seq[: t + 1], seq[1 : t + 2])
        want = chain_logits(base, drafter, state, seq[t + 1 : t + BLOCK])
        np.testing.assert_allclose(np.asarray(logits[:, 0, t]), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", HEADS)
def test_training_scores_what_decoding_scores(qwen3, kind):
    base = qwen3[1]
    training_scores_what_decoding_scores(base, perturbed(base, "dspark", markov_rank=RANK, markov_head_type=kind))


@pytest.mark.parametrize("options, message", [
    ({"markov_head_type": "lstm"}, "markov_head_type='lstm' must be one of vanilla, gated, rnn"),
    ({"markov_rank": 0}, "markov_rank=0 must be an integer >= 1"),
    ({"markov_rank": 2.5}, "markov_rank=2.5 must be an integer >= 1"),
    ({"selector_rank": 4}, "DSpark drafters have no option selector_rank"),
])
def test_a_bad_option_is_one_line(options, message):
    with pytest.raises(CloverError) as e:
        drafter_config("dspark", 3, **options)
    assert message in str(e.value), str(e.value)
    assert_one_line(e)


def sampling_keeps_the_base_distribution(monkeypatch, method: str, tree: str, noise_seed: int = 3, adjust=None,
                                         **options):
    """test_spec_sampling's chi-square check with a `method` drafter of block 4 (logits tripled, as in
    tests/test_dflash.py), each node drafting from its own corrected distribution. `noise_seed`: a draw
    of the drafter's noise under which drafts are accepted at every depth, as the check requires;
    `adjust(drafter, base)`: what is done to the noisy drafter before it drafts."""
    import test_spec_sampling as spec
    from clover_jax.engine.sampling import SamplingConfig
    from clover_jax.model.config import ModelConfig
    from clover_jax.model.llama import Llama

    base = spec.noisy(Llama(ModelConfig.tiny(vocab_size=spec.VOCAB), rngs=nnx.Rngs(0)), 0.35, seed=1, replace=True)
    def noisy_heads(base, method):
        drafter = make_drafter(drafter_config(method, 3, output_multiplier=3.0, **options), base, seed=2)
        drafter = spec.noisy(drafter, 0.05, seed=noise_seed, replace=False)
        return drafter if adjust is None else adjust(drafter, base)

    monkeypatch.setattr(spec, "noisy_heads", noisy_heads)
    sampling = SamplingConfig(temperature=1.0)
    pv = spec.p_values(spec.sample_tokens(base, method, sampling, tree), spec.exact_joint(base, sampling))
    assert min(pv.values()) > 1e-3, pv


@pytest.mark.parametrize("kind, tree, seed", [("rnn", "widths:3,2,1", 3), ("rnn", "dynamic:7", 4),
                                              ("vanilla", "dynamic:7", 4), ("gated", "widths:3,2,1", 3)])
def test_speculative_sampling_has_the_base_distribution(monkeypatch, kind, tree, seed):
    sampling_keeps_the_base_distribution(monkeypatch, "dspark", tree, noise_seed=seed, markov_rank=RANK,
                                         markov_head_type=kind)


@pytest.mark.slow
@pytest.mark.parametrize("method, options", [("dspark", ["markov_head_type=rnn", "markov_rank=6"]),
                                             ("domino", ["emb_dim=8", "gru_hidden_dim=6"])])
def test_frozen_training_keeps_the_dflash_backbone(model_dir, datasets, tmp_path, method, options):
    """train.train --backbone DIR (a trained dflash drafter) trains the correction and keeps DIR's
    weights exactly."""
    from safetensors.numpy import load_file
    from test_dflash_clover import run_train

    assert run_train(model_dir, datasets["plain"], tmp_path / "dflash", "dflash", "--num-heads", 2,
                     "--option", "target_layer_ids=0,1") == 0
    backbone = tmp_path / "dflash" / "out"
    flags = [a for option in options for a in ("--option", option)]
    assert run_train(model_dir, datasets["plain"], tmp_path / method, method, "--backbone", backbone, *flags) == 0
    theirs = load_file(str(backbone / "heads.safetensors"))
    ours = load_file(str(tmp_path / method / "out" / "heads.safetensors"))
    assert set(theirs) < set(ours)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
