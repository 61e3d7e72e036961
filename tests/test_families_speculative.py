"""Speculative decoding on the families whose layers add to Llama's: on tiny random Qwen3 and Gemma 3
models (conftest.VARIANTS; Gemma's local layers see 4 tokens), greedy speculative output equals plain
greedy output token for token for every method, for answers of 24 tokens that cross the window many
times. Each method runs a static tree with batch 4 on one family and its dynamic tree with batch 1 on
the other (one compile each).

The drafters start from their own init, nudged at random (test_speculative.perturb). The heads
(Medusa, Clover, Clover-2) start as the base model's lm_head and draft partly right, so steps accept
drafted nodes, verified over keys both inside and outside the window; the draft models (EAGLE-1,
EAGLE-3) draft from an untrained layer and are checked for exactness alone."""

import numpy as np
import pytest

from clover_jax.drafters import HEADS, registry
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.engine.decode import Generator
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.trees.spec import resolve_tree
from test_speculative import perturb

FAMILIES = ("qwen3-kv2", "gemma3-kv1")
PROMPTS = [[1, 7, 8, 9, 10, 11], [1, 3], [1, 5, 6, 30, 31, 32, 33, 34, 35], [1, 12, 13]]
NEW = 24
STATIC, DYNAMIC = ("widths:3,2,2", 4), ("dynamic", 1)  # (tree, batch)
# Every method on both kinds of tree and both families, alternating: method i runs STATIC on family
# i % 2 and DYNAMIC on the other.
CASES = [(family, method, *(STATIC if (i + j) % 2 == 0 else DYNAMIC))
         for i, method in enumerate(registry.names()) for j, family in enumerate(FAMILIES)]


@pytest.fixture(scope="module")
def plain(loaded):
    """family -> the plain greedy continuations of PROMPTS (no EOS: every answer runs NEW tokens)."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = Generator(loaded(family)[3]).generate(PROMPTS, NEW, eos_ids=[]).tokens
        return made[family]

    return get


def tree_spec(spec: str, method: str) -> str:
    """A method's dynamic tree: eagle2 for the chained draft models, Clover's sampled widths for heads."""
    if spec != "dynamic":
        return spec
    return "eagle2:10,4,4" if registry.get(method).chained else "dynamic:8"


@pytest.mark.parametrize("family, method, spec, batch", CASES, ids=[f"{f}-{m}-{s}-b{b}" for f, m, s, b in CASES])
def test_greedy_speculative_output_is_plain_greedy_output(loaded, plain, family, method, spec, batch):
    base = loaded(family)[3]
    heads = perturb(make_heads(drafter_config(method, 4), base, seed=3), seed=4)
    gen = SpeculativeGenerator(base, heads, resolve_tree(tree_spec(spec, method), method, heads.num_heads))
    rows = list(range(len(PROMPTS)))[-batch:]
    out = gen.generate([PROMPTS[i] for i in rows], NEW, eos_ids=[])
    want = [plain(family)[i] for i in rows]
    assert out.tokens == want
    hist = np.asarray(out.accept_hist).sum(0)
    if method in HEADS:  # perturbed heads draft near the base model; a random block drafter need not
        assert hist[1:].sum() > 0, hist  # some steps accepted drafts


def test_drafters_on_gemma3_start_from_the_right_layers(loaded):
    """EAGLE's draft layer is a Llama layer (no q/k norms, window, score scalar or GeGLU) whose final
    norm starts at Gemma's 1 + w; Clover-2's Augmenting Block copies the last layer, a local one, as
    the local layer it is."""
    base = loaded("gemma3-kv1")[3]
    assert base.cfg.is_local(base.cfg.num_layers - 1)
    eagle3 = make_heads(drafter_config("eagle3", 2), base)
    attn = eagle3.layer.self_attn
    assert attn.q_norm is None and attn.k_norm is None and attn.window is None
    assert attn.cfg.query_pre_attn_scalar is None and attn.cfg.hidden_act == "silu" and not attn.cfg.norm_unit_offset
    np.testing.assert_allclose(np.asarray(eagle3.norm.weight[...]), 1 + np.asarray(base.norm.weight[...]))
    clover2 = make_heads(drafter_config("clover2", 2), base)
    last = base.layers[-1]
    for layer in clover2.aug:
        assert layer.self_attn.local and layer.self_attn.window == base.cfg.sliding_window
        np.testing.assert_array_equal(np.asarray(layer.self_attn.q_norm.weight[...]),
                                      np.asarray(last.self_attn.q_norm.weight[...]))
    np.testing.assert_allclose(np.asarray(clover2.head_norm.weight[...]), 1 + np.asarray(base.norm.weight[...]))
