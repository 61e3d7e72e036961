"""Speculative decoding: greedy speculative output equals plain greedy output token for token for
every method, tree and batch size (random heads, then an oracle drafter that makes acceptance long);
the cache and statistics a run leaves; pacing; settings the engine refuses. Acceptance and compaction
by hand: tests/test_accept.py; dynamic trees as drafted: tests/test_dynamic_tree.py.

Compiling a speculative program on CPU takes seconds, so each generator is built once per module
and reused: budgets are runtime arguments, EOS comes from the model config (one static value)."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters import registry
from clover_jax.model.config import ModelConfig
from clover_jax.engine.decode import Generator, prefill
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.drafters.base import Committed
from clover_jax.errors import CloverError
from clover_jax.drafters.heads import Heads, make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.llama import Llama
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.engine.pacing import MAX_WAIT, PROBE_EVERY, Pace, Paced, speculate_now
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.static import Tree, chain
from clover_jax.trees.spec import resolve_tree
from conftest import assert_one_line, draft_with_context

PROMPTS = [[1, 7, 8, 9], [1, 3, 4, 22, 23, 24, 25, 60], [1, 2], [9] * 11]
EOS_ROW = 2  # the prompt whose greedy continuation is cut by EOS mid-way
MAX_NEW = 20
# Runtime budgets: a cut mid-run, a sequence with nothing to do, a cut before the EOS, a long one.
BUDGETS = [5, 0, 3, 17]
FREE_EXTRA = 8  # continuation past MAX_NEW: covers a last step's overshoot (at most tree depth + 1)
PREFILL_LEN = 48  # >= longest prompt + MAX_NEW + FREE_EXTRA
# (tree, batch) per method: a chain, a wide tree, the method's paper tree cut to its head count
# (None), and the two dynamic trees. Batch-1 cases keep the compile count (and the file's run time) down.
CASES = [("chain:3", 4), ("widths:4,2", 1), (None, 4), ("dynamic:8", 4), ("eagle2:10", 1), ("eagle2:10", 4)]
SEED = 1


def perturb(heads: Heads, seed: int, scale: float = 0.02) -> Heads:
    """Add N(0, scale^2) to every head parameter, so heads differ from their identity-like init and
    draft varied (partly wrong) tokens."""
    leaves, treedef = jax.tree.flatten(nnx.state(heads, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(heads, jax.tree.unflatten(treedef, noisy))
    return heads


class Reference:
    """The base model (float32, EOS in its config) and its plain greedy outputs."""

    def __init__(self):
        probe = Llama(ModelConfig.tiny(), rngs=nnx.Rngs(SEED))
        free = Generator(probe).generate(PROMPTS, MAX_NEW + FREE_EXTRA, eos_ids=[]).tokens
        self.free = free  # greedy continuations with no EOS, long enough for any cache check
        self.eos = pick_eos(free)
        self.base = Llama(ModelConfig.tiny(eos_token_ids=(self.eos,)), rngs=nnx.Rngs(SEED))
        same = jax.tree.map(jnp.array_equal, nnx.state(probe), nnx.state(self.base))
        assert all(jax.tree.leaves(same)), "the EOS id must not change the weights"
        # Plain greedy with the config's EOS and budgets cuts the free continuations at the budget and
        # after the first EOS; the speculative runs are compared with those cuts (one plain program).
        plain = Generator(self.base)
        self.full = plain.generate(PROMPTS, MAX_NEW).tokens
        assert self.full == [truncate(c, MAX_NEW, self.eos) for c in free]
        assert self.full[EOS_ROW][-1] == self.eos and len(self.full[EOS_ROW]) < MAX_NEW
        budgeted = plain.generate(PROMPTS, MAX_NEW, budgets=BUDGETS).tokens
        assert budgeted == [truncate(c, budget, self.eos) for c, budget in zip(free, BUDGETS)]


def truncate(tokens, budget, eos):
    out = tokens[:budget]
    return out[: out.index(eos) + 1] if eos in out else out


def pick_eos(free) -> int:
    """A token that the EOS_ROW continuation first emits mid-way and no other continuation emits."""
    others = {t for i, c in enumerate(free) if i != EOS_ROW for t in c}
    row = free[EOS_ROW][:MAX_NEW]
    for i, t in enumerate(row):
        if i >= 4 and t not in others and t not in row[:i]:
            return t
    raise AssertionError(f"no EOS candidate in {row}; change SEED or the prompts")


@pytest.fixture(scope="module")
def ref():
    return Reference()


@pytest.fixture(scope="module")
def fresh(ref):
    """(seq, next token, heads) -> what prefilling seq from scratch gives: the base cache k, v
    [L, len(seq), K, H], the heads' Augmenting Block cache (None without one) and their context
    state [D] at the last position (paired with the next token)."""
    base_def, base_params = nnx.split(ref.base)

    @functools.partial(jax.jit, static_argnums=0)
    def run(heads_def, params, tokens, next_tokens, length):
        base, heads = nnx.merge(base_def, params[0]), nnx.merge(heads_def, params[1])
        out, _ = prefill(base, tokens, length, PREFILL_LEN)
        state = heads.init(base, 1, PREFILL_LEN)
        new = Committed(out.hidden, out.hidden_normed, next_tokens)
        state = heads.commit(base, state, new, length, jnp.ones((1,), bool))
        return out.cache, state.aug_cache, state.context[0]

    def get(seq, next_token, heads):
        tokens = np.zeros((1, PREFILL_LEN), np.int32)
        tokens[0, : len(seq)] = seq
        following = np.zeros_like(tokens)
        following[0, : len(seq)] = seq[1:] + [next_token]
        heads_def, heads_params = nnx.split(heads)
        cache, aug, context = run(heads_def, (base_params, heads_params), jnp.asarray(tokens),
                                  jnp.asarray(following), jnp.asarray([len(seq)], jnp.int32))
        n = len(seq)
        aug = None if aug is None else (np.stack(aug.k)[:, 0, :, :n], np.stack(aug.v)[:, 0, :, :n])
        return np.stack(cache.k)[:, 0, :, :n], np.stack(cache.v)[:, 0, :, :n], aug, np.asarray(context)

    return get


@pytest.fixture(scope="module")
def random_generators(ref):
    """(method, tree spec) -> SpeculativeGenerator with perturbed heads, built on first use."""
    made = {}

    def get(method, spec):
        if (method, spec) not in made:
            heads = perturb(make_heads(drafter_config(method, registry.get(method).depth), ref.base, seed=3), seed=4)
            made[method, spec] = SpeculativeGenerator(ref.base, heads, resolve_tree(spec, method, heads.num_heads))
        return made[method, spec]

    return get


def check_run(out, want, prompts, budgets, ref, fresh, gen):
    """Tokens equal plain greedy; statistics consistent with the tokens; what the run committed to
    the caches equals a fresh prefill of prompt + greedy continuation.

    Per sequence b with hist = accept_hist[b] (live speculative steps that accepted d drafted tokens)
    and plain = plain_steps[b] (live steps paced to the root alone, which commit one token each):
    - live steps: sum(hist) + plain <= n_b - 1 (the prefill emits one token, each live step at least
      one), and the last sequence to finish was live in every step: max_b (sum(hist) + plain) == steps;
    - emitted before the cut: raw = 1 + plain + sum_d (d+1) hist[d]; only the final live step is cut
      (by the budget or after the EOS), so raw - depth <= n_b <= raw; each sequence ends at its EOS or
      its budget;
    - committed to the caches: root + accepted drafts per live step, i.e. raw - 1 tokens past the
      prompt; they are the greedy continuation (past a cut too), and the heads' context is the one at
      the last committed position, paired with the next root.
    """
    assert out.tokens == want
    state, depth = out.state, gen.tree.max_depth
    hist, plain = np.asarray(state.accept_hist), np.asarray(state.plain_steps)
    np.testing.assert_array_equal(out.accept_hist, hist)
    steps = int(state.plain.step)
    lengths = np.asarray(state.plain.cache.lengths)
    assert hist.shape == (len(prompts), depth + 1)
    assert out.steps == steps + 1
    assert (hist.sum(1) + plain).max() == steps
    # A static tree's node hits: every drafting step holds the root, and as many steps hold a node of
    # depth d as accepted d drafts or more (one node per depth on a path).
    if isinstance(gen.tree, Tree):
        hits = out.node_hits
        assert hits.shape == (len(prompts), gen.tree.num_nodes)
        np.testing.assert_array_equal(hits[:, 0], hist.sum(1))
        for d in range(1, depth + 1):
            np.testing.assert_array_equal(hits[:, gen.tree.depth_nodes[d - 1]].sum(1), hist[:, d:].sum(1))
    else:
        assert out.node_hits is None  # a dynamic tree's nodes are other paths every step
    committed = hist @ (np.arange(depth + 1) + 1) + plain
    for b, prompt in enumerate(prompts):
        n, live = len(out.tokens[b]), int(hist[b].sum() + plain[b])
        if budgets[b] == 0:
            assert n == 0 and live == 0 and committed[b] == 0
        else:
            assert live <= n - 1 and out.sequence_steps[b] == live + 1
            assert committed[b] + 1 - depth <= n <= committed[b] + 1
            assert out.tokens[b][-1] == ref.eos or n == budgets[b]
        assert lengths[b] == len(prompt) + committed[b]
        cont = ref.free[PROMPTS.index(prompt)]
        k, v, aug, context = fresh(prompt + cont[: committed[b]], cont[committed[b]], gen.drafter)
        np.testing.assert_allclose(np.stack(state.plain.cache.k)[:, b, :, : lengths[b]], k, atol=1e-5)
        np.testing.assert_allclose(np.stack(state.plain.cache.v)[:, b, :, : lengths[b]], v, atol=1e-5)
        assert (aug is None) == (state.draft.aug_cache is None)
        if aug is not None:
            assert int(state.draft.aug_cache.lengths[b]) == lengths[b]
            np.testing.assert_allclose(np.stack(state.draft.aug_cache.k)[:, b, :, : lengths[b]], aug[0], atol=1e-5)
            np.testing.assert_allclose(np.stack(state.draft.aug_cache.v)[:, b, :, : lengths[b]], aug[1], atol=1e-5)
        np.testing.assert_allclose(np.asarray(state.draft.context[b]), context, atol=1e-5)


# ---------------------------------------------------------------- random heads


@pytest.mark.parametrize("spec,batch", CASES,
                         ids=lambda x: x if isinstance(x, str) else f"b{x}" if x else "default")
@pytest.mark.parametrize("method", ["medusa", "clover", "clover2"])
def test_greedy_matches_plain(ref, fresh, random_generators, method, spec, batch):
    """Prompts of different lengths, one of them stopped by EOS mid-way; then per-sequence budgets."""
    gen = random_generators(method, spec)
    rows = range(len(PROMPTS)) if batch == len(PROMPTS) else [EOS_ROW]
    prompts = [PROMPTS[i] for i in rows]
    for budgets in ([MAX_NEW] * len(rows), [BUDGETS[i] for i in rows]):
        out = gen.generate(prompts, MAX_NEW, budgets=budgets)
        want = [truncate(ref.free[i], budget, ref.eos) for i, budget in zip(rows, budgets)]
        check_run(out, want, prompts, budgets, ref, fresh, gen)


DRAFT_VOCAB_CASES = [("clover2", "chain:3", 4), ("medusa", "widths:4,2", 1), ("clover", "dynamic:8", 4)]


@pytest.mark.parametrize("method, spec, batch", DRAFT_VOCAB_CASES, ids=[f"{m}-{s}" for m, s, _ in DRAFT_VOCAB_CASES])
def test_greedy_matches_plain_with_a_draft_vocabulary(ref, fresh, method, spec, batch):
    """Heads drafting from only half of the tokens the continuations use (so some of them can never be
    drafted) still write exactly the plain greedy text, and every drafted token is in the subset."""
    counts = np.bincount(np.concatenate(ref.free), minlength=ref.base.cfg.vocab_size)
    vocab = DraftVocab.most_frequent(ref.base.lm_head_weight(), counts, int((counts > 0).sum()) // 2)
    heads = perturb(make_heads(drafter_config(method, registry.get(method).depth), ref.base, seed=3), seed=4)
    gen = SpeculativeGenerator(ref.base, heads, resolve_tree(spec, method, heads.num_heads), draft_vocab=vocab)
    rows = range(len(PROMPTS)) if batch == len(PROMPTS) else [EOS_ROW]
    prompts = [PROMPTS[i] for i in rows]
    out = gen.generate(prompts, MAX_NEW, budgets=[BUDGETS[i] for i in rows])
    want = [truncate(ref.free[i], BUDGETS[i], ref.eos) for i in rows]
    check_run(out, want, prompts, [BUDGETS[i] for i in rows], ref, fresh, gen)
    out = gen.generate(PROMPTS, MAX_NEW)
    assert out.tokens == ref.full

    roots = jnp.asarray(np.arange(16, dtype=np.int32))
    context = jnp.asarray(np.random.default_rng(0).normal(size=(16, ref.base.cfg.hidden_size)), jnp.float32)
    if isinstance(gen.tree, DynamicTree):
        tokens, st, _ = draft_with_context(ref.base, heads, gen.tree, context, roots, vocab=vocab)
        drafted = np.asarray(tokens)[np.asarray(st.valid) & (np.arange(gen.tree.num_nodes) > 0)]
    else:
        drafted = np.asarray(draft_with_context(ref.base, heads, gen.tree, context, roots, vocab=vocab)[0])[:, 1:]
    assert drafted.size and np.isin(drafted, np.asarray(vocab.ids)).all()


# ---------------------------------------------------------------- oracle drafter


class OracleHeads(Heads):
    """A drafter that knows the base model's greedy continuation as a bigram table.

    The children of a node holding token t are ranked: first[t] (logit 100), second[t] (50), then
    the rest by a table noise[t] in [0, 1). The tables are Params, shared with the generator's
    split state, so a test rewrites them in place and reuses the compiled program."""

    def __init__(self, base: Llama, num_heads: int):
        super().__init__(drafter_config("clover", num_heads), base.cfg, [])
        v = base.cfg.vocab_size
        self.noise = nnx.Param(jnp.zeros((v, v), jnp.float32))
        self.first = nnx.Param(jnp.zeros((v,), jnp.int32))
        self.second = nnx.Param(jnp.zeros((v,), jnp.int32))

    def set_tables(self, first, second, noise):
        self.first[...] = jnp.asarray(first, jnp.int32)
        self.second[...] = jnp.asarray(second, jnp.int32)
        self.noise[...] = jnp.asarray(noise, jnp.float32)

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        return hidden_normed, cache

    def node_state(self, base, k, state, token):
        return state

    def node_logits(self, base, k, state, token, vocab=None):
        v = self.noise.shape[-1]
        logits = (self.noise[...][token] + 100 * jax.nn.one_hot(self.first[...][token], v)
                  + 50 * jax.nn.one_hot(self.second[...][token], v))
        return logits if vocab is None else vocab.take(logits)


def bigram(ref) -> dict[int, int]:
    """next[t]: the token that most often follows t in the plain greedy continuations (the first
    seen on a tie). The continuations disagree on some successors, so even this oracle errs."""
    pairs = Counter((a, b) for cont in ref.free for a, b in zip(cont, cont[1:]))
    nxt: dict[int, int] = {}
    for (a, b), count in pairs.items():  # insertion order = first occurrence
        if a not in nxt or count > pairs[a, nxt[a]]:
            nxt[a] = b
    return nxt


@pytest.fixture(scope="module")
def oracle(ref):
    """(heads, generator) on a width-2 depth-4 tree: every node has a rank-0 and a rank-1 child."""
    heads = OracleHeads(ref.base, num_heads=4)
    return heads, SpeculativeGenerator(ref.base, heads, resolve_tree("widths:2,2,2,2", "clover", 4))


def wrong(t: int, nxt: dict[int, int], v: int, shift: int) -> int:
    """A token other than t's true successor (and a different one per shift)."""
    return (nxt.get(t, 0) + shift) % v


def test_oracle_accepts_long_runs(ref, fresh, oracle):
    """Right at rank 0 (wherever the bigram holds): most steps accept several tokens, and EOS and
    budgets fall inside multi-token acceptances."""
    heads, gen = oracle
    nxt, v = bigram(ref), ref.base.cfg.vocab_size
    noise = np.random.default_rng(6).uniform(0, 1, (v, v))
    heads.set_tables([nxt.get(t, wrong(t, nxt, v, 1)) for t in range(v)],
                     [wrong(t, nxt, v, 2) for t in range(v)], noise)
    depth = gen.tree.max_depth
    out = gen.generate(PROMPTS, MAX_NEW)
    check_run(out, ref.full, PROMPTS, [MAX_NEW] * 4, ref, fresh, gen)
    hist = np.asarray(out.state.accept_hist)
    mean_accepted = (hist @ np.arange(depth + 1)).sum() / hist.sum()
    assert mean_accepted > 1.5, hist
    assert out.steps < max(len(t) for t in ref.full)
    budgeted = gen.generate(PROMPTS, MAX_NEW, budgets=BUDGETS)
    want = [truncate(c, budget, ref.eos) for c, budget in zip(ref.free, BUDGETS)]
    check_run(budgeted, want, PROMPTS, BUDGETS, ref, fresh, gen)


def test_oracle_right_only_at_rank1_and_sometimes(ref, fresh, oracle):
    """The true successor sits at rank 1 for two tokens in three and nowhere near the top for the
    rest: accepted paths run through rank-1 nodes (non-trivial compaction), and steps accept
    anything from 0 to several tokens."""
    heads, gen = oracle
    nxt, v = bigram(ref), ref.base.cfg.vocab_size
    known = lambda t: t % 3 != 0
    noise = np.random.default_rng(7).uniform(0, 1, (v, v))
    for t in range(v):
        if not known(t):
            noise[t, nxt.get(t, 0)] = -1.0  # the successor ranks last among the children
    heads.set_tables([wrong(t, nxt, v, 1) for t in range(v)],
                     [nxt.get(t, 0) if known(t) else wrong(t, nxt, v, 2) for t in range(v)], noise)
    out = gen.generate(PROMPTS, MAX_NEW)
    check_run(out, ref.full, PROMPTS, [MAX_NEW] * 4, ref, fresh, gen)
    total = np.asarray(out.state.accept_hist).sum(0)
    assert total[0] > 0 and total[2:].sum() > 0, total


@pytest.fixture(scope="module")
def oracle_dynamic(ref, oracle):
    """The oracle's heads on the two dynamic trees (9 slots, depth 4)."""
    heads, _ = oracle
    return {spec: SpeculativeGenerator(ref.base, heads, resolve_tree(spec, "clover", 4))
            for spec in ("eagle2:9", "dynamic:9")}


def test_oracle_on_dynamic_trees(ref, fresh, oracle, oracle_dynamic):
    """The true successor of a token is its rank-0 child for two tokens in three and its rank-1 child
    for the rest. EAGLE-2's rerank keeps rank-1 children (joint probability e^-50 still beats the
    noise), so its paths switch ranks and run long; Clover's sampler drops them (under a quarter of
    the top-1) and stops at the first rank-1 successor. Both write exactly the plain greedy text."""
    heads, _ = oracle
    nxt, v = bigram(ref), ref.base.cfg.vocab_size
    known = lambda t: t % 3 != 0
    heads.set_tables([nxt.get(t, 0) if known(t) else wrong(t, nxt, v, 1) for t in range(v)],
                     [wrong(t, nxt, v, 2) if known(t) else nxt.get(t, 0) for t in range(v)],
                     np.random.default_rng(8).uniform(0, 1, (v, v)))
    mean_accepted = {}
    for spec, gen in oracle_dynamic.items():
        out = gen.generate(PROMPTS, MAX_NEW)
        check_run(out, ref.full, PROMPTS, [MAX_NEW] * 4, ref, fresh, gen)
        hist = np.asarray(out.state.accept_hist).sum(0)
        mean_accepted[spec] = (hist @ np.arange(len(hist))) / hist.sum()
    assert mean_accepted["eagle2:9"] > mean_accepted["dynamic:9"] > 0.3, mean_accepted


def probe_steps(num_steps: int) -> list[int]:
    """The steps (counted from 0) that draft in a paced loop of `num_steps` whose drafts are never
    accepted: the first, then a probe after PROBE_EVERY plain steps, after twice as many following each
    failed probe, at most MAX_WAIT."""
    steps, wait = [0], PROBE_EVERY
    while steps[-1] + wait + 1 < num_steps:
        steps.append(steps[-1] + wait + 1)
        wait = min(2 * wait, MAX_WAIT)
    return steps


def test_failed_probes_wait_longer_and_drafts_that_pay_bring_them_back():
    """The pacing rule alone, step by step: drafts never accepted are probed after 8, 16, 32, 64, 64, ...
    plain steps; once a probe's drafts pay the loop drafts at every step, and when they stop paying the
    next probe comes after 8 plain steps again."""
    pacer = Paced(2.0, None, None, sampling=SamplingConfig(), cache_len=8)
    pace = Pace(gain=jnp.float32(1.0), idle=jnp.int32(0), wait=jnp.int32(PROBE_EVERY),
                plain_steps=jnp.zeros((1,), jnp.int32), pending=None, pending_n=jnp.zeros((1,), jnp.int32))
    live = jnp.ones((1,), bool)

    def run(pace, accepted: int, num_steps: int):
        drafted = []
        for k in range(num_steps):
            if bool(speculate_now(pace, pacer.step_cost)):
                drafted.append(k)
                pace = pacer.update(pace, jnp.full((1,), accepted), live)
            else:
                pace = pace.replace(idle=pace.idle + 1)
        return pace, drafted

    pace, drafted = run(pace, 0, 300)
    assert drafted == probe_steps(300) == [0, 9, 26, 59, 124, 189, 254]
    pace, drafted = run(pace, 4, 80)  # the next probe (MAX_WAIT after the last) pays, and every step after
    assert drafted == list(range(19, 80)) and int(pace.wait) == PROBE_EVERY
    pace, drafted = run(pace, 0, 30)  # the running mean falls short after 5 steps; a probe after 8 plain ones
    assert drafted == [0, 1, 2, 3, 4, 13] and int(pace.wait) == 2 * PROBE_EVERY


def test_pacing_drafts_only_while_drafts_pay(ref, fresh, oracle):
    """With a step cost, drafts that are never accepted send the loop to plain steps, with probes after
    PROBE_EVERY plain steps and twice as many after each failed one (`probe_steps`): the second run of
    plain steps outlasts the PROBE_EVERY rows plain steps keep for the drafter, which gets them in two
    commits. Drafts that are accepted keep it drafting. The tokens are plain greedy's either way, and
    the caches hold exactly the committed tokens."""
    heads, _ = oracle
    gen = SpeculativeGenerator(ref.base, heads, resolve_tree("widths:2,2,2,2", "clover", 4), step_cost=1.5)
    nxt, v = bigram(ref), ref.base.cfg.vocab_size
    noise = np.random.default_rng(8).uniform(0, 1, (v, v))
    heads.set_tables([wrong(t, nxt, v, 1) for t in range(v)], [wrong(t, nxt, v, 2) for t in range(v)], noise)
    out = gen.generate(PROMPTS, MAX_NEW)
    check_run(out, ref.full, PROMPTS, [MAX_NEW] * 4, ref, fresh, gen)
    # The prefill writes the first token, then one-token steps: drafting at the first, it accepts
    # nothing, so plain steps follow, with a probe after PROBE_EVERY of them (which fails: 16 more).
    spec_steps = probe_steps(MAX_NEW)
    assert spec_steps == [0, PROBE_EVERY + 1]
    longest = int(np.argmax([len(t) for t in out.tokens]))
    assert out.accept_hist[longest].sum() == out.accept_hist[longest, 0] == len(spec_steps)
    assert int(out.state.plain_steps[longest]) == MAX_NEW - 1 - len(spec_steps)
    budgeted = gen.generate(PROMPTS, MAX_NEW, budgets=BUDGETS)
    want = [truncate(c, budget, ref.eos) for c, budget in zip(ref.free, BUDGETS)]
    check_run(budgeted, want, PROMPTS, BUDGETS, ref, fresh, gen)

    heads.set_tables([nxt.get(t, wrong(t, nxt, v, 1)) for t in range(v)], [wrong(t, nxt, v, 2) for t in range(v)],
                     noise)
    out = gen.generate(PROMPTS, MAX_NEW)
    check_run(out, ref.full, PROMPTS, [MAX_NEW] * 4, ref, fresh, gen)
    assert int(np.asarray(out.state.plain_steps).sum()) == 0
    assert out.steps < max(len(t) for t in ref.full)


# ---------------------------------------------------------------- refused settings


def test_tree_deeper_than_heads_is_refused(ref):
    heads = make_heads(drafter_config("medusa", 2), ref.base)
    with pytest.raises(CloverError, match="depth 3") as e:
        SpeculativeGenerator(ref.base, heads, chain(3))
    assert_one_line(e)


def test_speculative_sampling_rows_are_independent_and_seeded(ref, oracle):
    """Each row samples with its own key: reproducible per seed, unchanged by what the other rows hold
    (their acceptances differ), different across seeds. Exactness is tests/test_spec_sampling.py's."""
    _, gen = oracle
    hot = SamplingConfig(temperature=1.0)
    a = gen.generate(PROMPTS, 8, hot, seed=3, eos_ids=()).tokens
    assert gen.generate(PROMPTS, 8, hot, seed=3, eos_ids=()).tokens == a
    other = gen.generate([PROMPTS[0]] + [[5, 6, 7]] * (len(PROMPTS) - 1), 8, hot, seed=3, eos_ids=()).tokens
    assert other[0] == a[0]
    assert gen.generate(PROMPTS, 8, hot, seed=4, eos_ids=()).tokens != a
