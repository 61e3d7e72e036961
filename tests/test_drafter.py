"""The drafting interface carries EAGLE's shape before EAGLE is written: a tiny one-layer draft model
with a KV cache of its own, reading two base layers' features and attending over its ancestors in the
draft tree, drafts static, dynamic and EAGLE-2 trees with greedy output equal to plain decoding; and
every drafter's tree gives each node the logits of drafting that node's path as a chain."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters import HEADS
from clover_jax.drafters import registry
from clover_jax.model.cache import KVCache, causal_mask, tree_mask
from clover_jax.model.config import ModelConfig
from clover_jax.engine.decode import Generator, prefill
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.drafters.base import Committed, Drafter, DrafterConfig, Frontier
from clover_jax.engine.drafting import draft_tree
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.losses import cross_entropy
from clover_jax.model.layers import DecoderLayer, Linear
from clover_jax.model.llama import Llama
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.static import Tree
from clover_jax.trees.spec import resolve_tree

PROMPTS = [[1, 7, 8, 9], [1, 3, 4, 22, 23, 24, 25, 60], [1, 2], [9] * 11]
MAX_NEW = 16


@flax.struct.dataclass
class DraftModelState:
    cache: KVCache  # the draft layer's own cache: entry t = [E(token t+1); feature t], as EAGLE pairs them
    context: jax.Array  # [B, D] the layer's output at the last committed entry (predicts the root's children)


class TinyEagle(nnx.Module, Drafter):
    """EAGLE-shaped: entry t reads the input embedding of token t+1 and a fusion of base layers 0 and -1
    at t (EAGLE-3's low/high fusion, 2D -> D), one decoder layer over its own cache; its output o_t,
    through the base model's norm and lm_head, scores token t+2 and is the feature a child node reads.
    A tree node at depth k >= 1 is entry L - 1 + k (position) in slot L - 1 + its draft slot, reading the
    committed entries and its ancestors'; the root's entry is the last committed one."""

    feature_layers = (0, -1)
    chained = True

    def __init__(self, hcfg: DrafterConfig, base: Llama, *, rngs: nnx.Rngs):
        d, dtype = base.cfg.hidden_size, base.dtype
        self.hcfg = hcfg
        self.fuse = Linear(2 * d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.fc = Linear(2 * d, d, ("embed", "embed_out"), dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(base.cfg, dtype=dtype, rngs=rngs)

    @property
    def depth(self) -> int:
        return self.hcfg.num_heads

    def init(self, base, batch, cache_len, mesh=None):
        c = base.cfg
        return DraftModelState(KVCache.zeros(1, batch, cache_len, c.num_kv_heads, c.head_dim, base.dtype),
                               jnp.zeros((batch, c.hidden_size), base.dtype))

    def _run(self, base, tokens, feature, positions, mask, cache):
        x = self.fc(jnp.concatenate([base.embed_tokens(tokens, base.dtype), feature], -1))
        return self.layer(x, positions, mask, cache, 0)

    def commit(self, base, state, new: Committed, count, live):
        b, t = new.tokens.shape
        c = state.cache
        feature = self.fuse(new.features.reshape(b, t, -1))
        positions = c.lengths[:, None] + jnp.arange(t)
        out, cache = self._run(base, new.tokens, feature, positions, causal_mask(c.lengths, t, c.max_len), c)
        last = jnp.take_along_axis(out, (count - 1)[:, None, None], axis=1)[:, 0]
        return DraftModelState(cache.advance(jnp.where(live, count, 0)), jnp.where(live[:, None], last, state.context))

    def expand(self, base, state, frontier, vocab=None):
        if frontier.carry is None:  # the root: its entry is the last committed one
            out = state.context[:, None]
        else:
            c = state.cache
            here = c.replace(lengths=c.lengths - 1 + frontier.slots[:, 0])  # a level's slots are contiguous
            mask = tree_mask(c.lengths - 1, frontier.ancestors, c.max_len)
            out, here = self._run(base, frontier.tokens, frontier.carry, frontier.positions - 1, mask, here)
            state = state.replace(cache=here.replace(lengths=c.lengths))
        normed = base.norm(out)
        return (base.logits(normed) if vocab is None else vocab.logits(normed)), out, state


TINY_EAGLE = registry.register(registry.Method("tiny-eagle", TinyEagle, DrafterConfig, depth=3,
                                             tree="eagle_mc_sim_7b_63", loss=cross_entropy))


@pytest.fixture(scope="module")
def base():
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def plain(base):
    """Plain greedy continuations, past MAX_NEW by more than a step's overshoot (tree depth + 1)."""
    return Generator(base).generate(PROMPTS, MAX_NEW + 8, eos_ids=[]).tokens


def perturbed(method: str, base: Llama, depth: int):
    drafter = make_heads(drafter_config(method, depth), base, seed=3)
    leaves, treedef = jax.tree.flatten(nnx.state(drafter, nnx.Param))
    keys = jax.random.split(jax.random.key(4), len(leaves))
    nnx.update(drafter, jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                                     for x, k in zip(leaves, keys)]))
    return drafter


def test_a_drafter_registers_as_itself(base):
    drafter = make_heads(drafter_config("tiny-eagle", 3), base)
    assert isinstance(drafter, TinyEagle) and registry.get("tiny-eagle") is TINY_EAGLE
    assert "tiny-eagle" in registry.names() and "tiny-eagle" not in HEADS
    assert resolve_tree("default", "tiny-eagle", 3).max_depth == 3
    with pytest.raises(Exception, match="unknown method 'eagle-9'"):
        drafter_config("eagle-9", 3)


def test_only_draft_models_draft_past_their_depth(base):
    """A draft model chains its layer, so it drafts a tree deeper than its steps; heads stop at their count."""
    deep = DynamicTree.eagle2(10, 3, 4)
    assert SpeculativeGenerator(base, perturbed("eagle3", base, 3), deep).tree is deep
    with pytest.raises(CloverError, match="tree depth 5 exceeds the 3 draft heads"):
        SpeculativeGenerator(base, perturbed("clover2", base, 3), deep)


# Each draft model on every tree, and every tree at both batch sizes (over the three models): the pairs,
# not the whole product, which took twice as long and held no case the pairs leave out; EAGLE-1 and
# EAGLE-3 on an eagle2 tree 5 deep (past their 3 chained steps) at both.
DRAFT_MODEL_CASES = [(method, spec, 4 if (i + j) % 2 == 0 else 1)
                     for i, method in enumerate(["tiny-eagle", "eagle", "eagle3"])
                     for j, spec in enumerate(["widths:3,2,2", "default", "dynamic:8", "eagle2:10,3,4"])]
DRAFT_MODEL_CASES += [("eagle", "eagle2:10,3,4", 1), ("eagle3", "eagle2:10,3,4", 4)]


@pytest.mark.parametrize("method, spec, batch", DRAFT_MODEL_CASES)
def test_a_draft_model_with_its_own_cache_decodes_as_plain(base, plain, method, spec, batch):
    """Greedy output equals plain decoding; the draft cache then holds exactly what committing the
    prompt and the accepted text from scratch writes (rejected drafts never stay in it)."""
    drafter = perturbed(method, base, 3)
    gen = SpeculativeGenerator(base, drafter, resolve_tree(spec, method, 3))
    rows = list(range(len(PROMPTS))) if batch == 4 else [1]
    out = gen.generate([PROMPTS[i] for i in rows], MAX_NEW, eos_ids=[])
    assert out.tokens == [plain[i][:MAX_NEW] for i in rows]
    if batch == 4:  # some drafts were accepted (random drafters: one sequence may see none)
        assert np.asarray(out.accept_hist)[:, 1:].sum() > 0
    state = out.state.draft
    for j, i in enumerate(rows):
        length = int(state.cache.lengths[j])
        assert length == int(out.state.plain.cache.lengths[j])
        seq = PROMPTS[i] + plain[i][: length - len(PROMPTS[i])]
        fresh = fresh_commit(base, drafter, seq, plain[i][length - len(PROMPTS[i])])
        np.testing.assert_allclose(np.asarray(state.cache.k[0])[j, :, :length], fresh.cache.k[0][0, :, :length],
                                   atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(state.context[j]), fresh.context[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["clover2", "eagle", "eagle3"])
def test_paced_drafting_hands_the_drafter_what_plain_steps_committed(base, plain, method):
    """Paced by a step cost its random drafts never pay (3 plain steps), the loop takes plain steps,
    whose positions reach the drafter in one commit before each probing speculative step: greedy output
    is plain decoding's, and the drafter's cache (EAGLE's, or Clover-2's Augmenting Block's) and context
    end as committing the prompt and the whole text from scratch leaves them."""
    drafter = perturbed(method, base, 3)
    gen = SpeculativeGenerator(base, drafter, resolve_tree("widths:3,2,2", method, 3), step_cost=3.0)
    out = gen.generate(PROMPTS, MAX_NEW, eos_ids=[])
    assert out.tokens == [p[:MAX_NEW] for p in plain]
    plain_steps = np.asarray(out.state.plain_steps)
    assert plain_steps.min() > 0 and np.asarray(out.accept_hist).sum(1).min() > 1  # both kinds of step
    state = out.state.draft
    cache = state.aug_cache if method == "clover2" else state.cache
    for j, prompt in enumerate(PROMPTS):
        length = int(cache.lengths[j])
        assert length == int(out.state.plain.cache.lengths[j])
        seq = prompt + plain[j][: length - len(prompt)]
        fresh = fresh_commit(base, drafter, seq, plain[j][length - len(prompt)])
        fresh_cache = fresh.aug_cache if method == "clover2" else fresh.cache
        np.testing.assert_allclose(np.asarray(cache.k[0])[j, :, :length], fresh_cache.k[0][0, :, :length],
                                   atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(state.context[j]), fresh.context[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 4])
def test_eagle3_over_a_draft_vocabulary_decodes_as_plain(base, plain, batch):
    """EAGLE-3 with a draft vocabulary of its own (every other token the text uses) under the engine's
    (the more frequent half of them): it drafts from the tokens in both, scored by its own rows, and
    greedy output still equals plain decoding."""
    counts = np.bincount(np.concatenate(plain), minlength=base.cfg.vocab_size)
    own = np.flatnonzero(counts)[::2]
    drafter = make_heads(drafter_config("eagle3", 3, draft_vocab=len(own)), base, seed=3)
    drafter.set_vocab(base, own)
    leaves, treedef = jax.tree.flatten(nnx.state(drafter, nnx.Param))
    keys = jax.random.split(jax.random.key(4), len(leaves))
    nnx.update(drafter, jax.tree.unflatten(treedef, [x + 0.02 * jax.random.normal(k, x.shape, x.dtype)
                                                     for x, k in zip(leaves, keys)]))
    asked = DraftVocab.most_frequent(base.lm_head_weight(), counts, int((counts > 0).sum()) // 2)
    tree = resolve_tree("widths:3,2,2", "eagle3", 3)
    gen = SpeculativeGenerator(base, drafter, tree, draft_vocab=asked)
    vocab = gen.draft_vocab
    kept = np.intersect1d(np.asarray(asked.ids), own)
    assert 0 < len(kept) < asked.size and np.array_equal(np.asarray(vocab.ids), kept)
    rows = list(range(len(PROMPTS))) if batch == 4 else [1]
    out = gen.generate([PROMPTS[i] for i in rows], MAX_NEW, eos_ids=[])
    assert out.tokens == [plain[i][:MAX_NEW] for i in rows]
    seq = PROMPTS[1] + plain[1][:5]
    state = fresh_commit(base, drafter, seq, plain[1][5])
    drafted, _ = draft_tree(base, drafter, state, tree, jnp.asarray([plain[1][5]]), jnp.asarray([len(seq)]),
                            vocab=vocab)
    assert np.isin(np.asarray(drafted.tokens)[:, 1:], kept).all()


def fresh_commit(base, drafter, seq, next_token):
    """The drafter's state after committing `seq` (followed by next_token) in one prefill."""
    tokens = jnp.asarray([seq], jnp.int32)
    following = jnp.asarray([seq[1:] + [next_token]], jnp.int32)
    out, _ = prefill(base, tokens, jnp.asarray([len(seq)]), len(seq) + 4, feature_layers=drafter.feature_layers)
    state = drafter.init(base, 1, len(seq) + 4)
    new = Committed(out.hidden, out.hidden_normed, following, out.features)
    return drafter.commit(base, state, new, jnp.asarray([len(seq)]), jnp.ones((1,), bool))


class Recorder:
    """Wraps a drafter: every `expand` call's logits, in call order (run eagerly)."""

    def __init__(self, drafter):
        self.drafter, self.logits = drafter, []

    def expand(self, base, state, frontier, vocab=None):
        logits, carry, state = self.drafter.expand(base, state, frontier, vocab)
        self.logits.append(np.asarray(logits))
        return logits, carry, state


def chain_logits(base, drafter, state, path, lens) -> list[np.ndarray]:
    """The logits [B, V] a drafter gives each node of one chain of tokens path [B, k+1] (root first),
    expanded one node per level: slots 0..k, each node's ancestors the nodes before it."""
    b, n = path.shape
    carry, out = None, []
    for j in range(n):
        frontier = Frontier(tokens=path[:, j : j + 1], parents=jnp.zeros((b, 1), jnp.int32),
                            slots=jnp.full((b, 1), j, jnp.int32),
                            ancestors=jnp.asarray(np.arange(n) <= j)[None, None], positions=lens[:, None] + j,
                            carry=carry, depth=j)
        logits, carry, state = drafter.expand(base, state, frontier)
        out.append(np.asarray(logits)[:, 0])
    return out


@pytest.mark.parametrize("method", ["medusa", "clover", "clover2", "tiny-eagle", "eagle", "eagle3"])
def test_each_node_gets_the_logits_of_its_path_drafted_as_a_chain(base, method):
    """Draft a static tree once; then, for every node that has children, draft the tokens of its path
    as a chain, one node per level: at every depth the chain's logits are the ones the tree gave the
    node's ancestor there (siblings and cousins change nothing, whatever the drafter keeps)."""
    drafter = perturbed(method, base, 3)
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [0, 0, 0], [0, 1, 0], [2, 1, 0]])
    prompts = jnp.asarray([[1, 7, 8, 9, 5], [1, 3, 4, 22, 0]], jnp.int32)
    lens = jnp.asarray([5, 4], jnp.int32)
    out, logits = prefill(base, prompts, lens, 32, feature_layers=drafter.feature_layers)
    root = jnp.argmax(logits, -1).astype(jnp.int32)
    following = jnp.concatenate([prompts[:, 1:], jnp.zeros((2, 1), jnp.int32)], 1).at[jnp.arange(2), lens - 1].set(root)
    new = Committed(out.hidden, out.hidden_normed, following, out.features)
    state = drafter.commit(base, drafter.init(base, 2, 32), new, lens, jnp.ones((2,), bool))
    rec = Recorder(drafter)
    drafted, _ = draft_tree(base, rec, state, tree, root, lens)
    tokens = np.asarray(drafted.tokens)
    checked = 0
    for node in range(tree.num_nodes):
        if tree.depth[node] == tree.max_depth:
            continue  # a leaf is never expanded
        ancestors = np.flatnonzero(tree.ancestor_mask[node])  # root .. node, by depth
        chain = chain_logits(base, drafter, state, jnp.asarray(tokens[:, ancestors]), lens)
        for d, a in enumerate(ancestors):
            level = rec.logits[d]
            got = level[:, a - tree.level(d).start] if level.shape[1] > 1 else level[:, 0]
            np.testing.assert_allclose(chain[d], got, atol=2e-5, rtol=1e-5)
            checked += 1
    assert checked == 1 + 3 * 2 + 5 * 3  # the root, 3 depth-1 and 5 depth-2 nodes, each with its ancestors
