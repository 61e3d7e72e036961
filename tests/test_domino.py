"""Domino (SpecForge 0.2.0's `DominoDraftModel`): DFlash with a GRU correction. With a tiny random
DominoDraftModel's weights copied in, our chain's logits are those their `apply_logits_head` gives the
block their `_sample_draft_tokens` draws greedily (positions before `suffix_start` left as DFlash's),
on the first block and on the block after a verification that rejected slots. Greedy output is plain
decoding's on chains, static and dynamic trees at batch 1 and 4; each tree node's GRU state follows its
own path; training scores what decoding scores; a bad option is one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters.registry import drafter_config, make_drafter
from clover_jax.errors import CloverError
from conftest import assert_one_line
from test_dflash import BLOCK, PROMPT, qwen3  # noqa: F401
from test_dspark import (greedy_is_plain, ours_of, perturbed, sampling_keeps_the_base_distribution, specforge_model,
                         the_blocks_are_theirs, their_hidden, training_scores_what_decoding_scores,
                         tree_nodes_score_their_paths)

torch = pytest.importorskip("torch")
domino = pytest.importorskip("specforge.modeling.draft.domino", reason="SpecForge 0.2.0: pip install specforge==0.2.0")

SIZES = {"emb_dim": 12, "gru_hidden_dim": 10}
RENAMES = {"embed_proj.0.weight": "embed_proj.up.weight", "embed_proj.2.weight": "embed_proj.out.weight"}


def their_chain(model, hf, hidden, root):
    """(their greedy block [b - 1], its corrected logits [b - 1, V] at positions 1..b-1)."""
    with torch.no_grad():
        block = torch.tensor([[root] + [0] * (BLOCK - 1)])
        tokens = model._sample_draft_tokens(hf, hidden, block)
        completed = torch.cat([block[:, :1], tokens], 1)
        logits = model.apply_logits_head(hf.lm_head(hidden)[:, None], hidden_states=hidden[:, None],
                                         prev_token_embeddings=hf.model.embed_tokens(completed)[:, None])
    return tokens[0].tolist(), logits[0, 0, 1:].numpy()


@pytest.mark.parametrize("prefix", [0, 1])
def test_the_corrected_block_is_specforges(qwen3, prefix):
    from transformers import DynamicCache

    hf, base = qwen3
    model = specforge_model(base, domino.DominoDraftModel, seed=prefix, pure_draft_prefix_len=prefix, **SIZES)
    assert model.suffix_start == 1 + prefix
    drafter = ours_of(model, base, "domino", RENAMES, pure_draft_prefix_len=prefix, **SIZES)
    got, root = the_blocks_are_theirs(model, hf, base, drafter, their_chain)
    with torch.no_grad():  # the positions it corrects differ from DFlash's logits; the others do not
        dflash = hf.lm_head(their_hidden(model, hf, PROMPT, 0, root, DynamicCache()))[0, 1:].numpy()
    corrected = [not np.allclose(g, d, atol=1e-3) for g, d in zip(got, dflash)]
    assert corrected == [k + 1 >= 1 + prefix for k in range(BLOCK - 1)]


def small(drafter, scale: float = 0.05):
    """`drafter` with its correction scaled by `scale`: a random one of full size drowns DFlash's logits,
    and the drafts would hardly ever be accepted."""
    drafter.embed_proj.out.kernel[...] = scale * drafter.embed_proj.out.kernel[...]
    return drafter


CASES = [(0, "chain:3", 1), (0, "chain:3", 4), (0, "widths:3,2,2", 4), (0, "widths:3,2,2", 1), (0, "dynamic:8", 4),
         (0, "eagle2:10,3,2", 1), (0, "eagle2:10,3,2", 4), (1, "widths:3,2,2", 4), (1, "eagle2:10,3,2", 1)]


@pytest.mark.parametrize("prefix, spec, batch", CASES)
def test_greedy_decodes_as_plain(qwen3, prefix, spec, batch):
    base = qwen3[1]
    drafter = small(perturbed(base, "domino", pure_draft_prefix_len=prefix, **SIZES))
    greedy_is_plain(base, drafter, "domino", spec, batch)


def test_a_draft_vocabulary_drafts_from_its_columns(qwen3):
    base = qwen3[1]
    greedy_is_plain(base, small(perturbed(base, "domino", **SIZES)), "domino", "widths:3,2,2", 4, draft_vocab=40)


@pytest.mark.parametrize("prefix", [0, 1])
def test_each_tree_node_scores_its_own_path(qwen3, prefix):
    base = qwen3[1]
    tree_nodes_score_their_paths(base, perturbed(base, "domino", pure_draft_prefix_len=prefix, **SIZES), "widths:3,2,2")


@pytest.mark.parametrize("prefix", [0, 1])
def test_training_scores_what_decoding_scores(qwen3, prefix):
    base = qwen3[1]
    training_scores_what_decoding_scores(base, perturbed(base, "domino", pure_draft_prefix_len=prefix, **SIZES))


@pytest.mark.parametrize("tree", ["widths:3,2,1", "dynamic:7"])
def test_speculative_sampling_has_the_base_distribution(monkeypatch, tree):
    """With tests/test_dflash.py's noisy DFlash as its backbone (whose drafts are accepted at every
    depth) and a small noisy correction."""
    import test_spec_sampling as spec

    def dflash_backbone(drafter, base):
        dflash = make_drafter(drafter_config("dflash", 3, output_multiplier=3.0), base, seed=2)
        nnx.update(drafter, nnx.state(spec.noisy(dflash, 0.05, seed=3, replace=False), nnx.Param))
        return small(drafter)

    sampling_keeps_the_base_distribution(monkeypatch, "domino", tree, adjust=dflash_backbone, **SIZES)


@pytest.mark.parametrize("options, message", [
    ({"emb_dim": 0}, "emb_dim=0 must be an integer >= 1"),
    ({"gru_hidden_dim": "8"}, "gru_hidden_dim='8' must be an integer >= 1"),
    ({"pure_draft_prefix_len": -1}, "pure_draft_prefix_len=-1 must be an integer >= 0"),
    ({"shift_label": True}, "shift_label=True: only False is drafted here"),
    ({"markov_rank": 4}, "Domino drafters have no option markov_rank"),
])
def test_a_bad_option_is_one_line(options, message):
    with pytest.raises(CloverError) as e:
        drafter_config("domino", 3, **options)
    assert message in str(e.value), str(e.value)
    assert_one_line(e)
