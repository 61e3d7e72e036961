"""The draft vocabulary: which tokens it keeps, how a `--draft-vocab` value is read, the token counts
on disk beside the heads. That drafting from it changes no greedy output is in test_speculative, that
speculative sampling stays exact with it in test_spec_sampling."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from clover_jax.io.heads_dir import COUNTS, load_draft_vocab, load_token_counts, save_heads
from clover_jax.model.config import ModelConfig
from clover_jax.drafters.vocab import ALIGN, AUTO_MASS_COVERAGE, DraftVocab, parse_size, probability_mass, ranking, resolve_size, token_counts
from clover_jax.errors import CloverError
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.model.llama import Llama
from conftest import assert_one_line


def test_token_counts_count_only_the_trained_on_targets():
    tokens = np.array([5, 5, 2, 7, 5, 2, 9])
    mask = np.array([0, 1, 1, 1, 1, 0, 0], np.uint8)
    np.testing.assert_array_equal(token_counts(tokens, mask, 10), [0, 0, 1, 0, 0, 2, 0, 1, 0, 0])


def test_auto_covers_the_counts_greedily_and_takes_everything_when_sampling():
    v = 4 * ALIGN
    counts = np.zeros(v, np.int64)
    counts[:150] = 1000  # 150 common tokens: 99.99% of the mass with the rare ones below
    counts[150:160] = 1
    assert resolve_size("auto", counts, v) == 2 * ALIGN  # 150 needed, rounded up to a multiple of ALIGN
    assert resolve_size("auto", counts, v, greedy=False) == 0
    assert resolve_size(None, None, v) == 0  # no counts (random heads): the whole vocabulary
    assert resolve_size("auto", counts, ALIGN + 10) == 0  # rounded up past V: the whole vocabulary
    assert resolve_size("0", counts, v) == 0
    assert resolve_size("100", counts, v, greedy=False) == 100  # an explicit size is kept, unrounded
    assert resolve_size(v, None, v) == 0  # N >= V needs no counts


def test_auto_covers_the_probability_mass_when_sampling():
    """Sampling draws from the tail greedy counts never see: with the base model's probability mass
    `auto` keeps the most probable tokens holding AUTO_MASS_COVERAGE of it, and N picks by mass."""
    v = 8 * ALIGN
    counts = np.zeros(v, np.int64)
    counts[:100] = 1000  # greedy text: 100 tokens
    mass = np.zeros(v, np.float32)
    mass[:100] = 1.0
    mass[100:400] = 0.3  # the tail sampling reaches: 90 of 190, so 100 tokens hold under half the mass
    mass[400:] = 1e-6
    share = np.cumsum(np.sort(mass)[::-1]) / mass.sum()
    needed = int(np.searchsorted(share, AUTO_MASS_COVERAGE)) + 1
    assert 100 < needed <= 400
    assert resolve_size("auto", counts, v, greedy=False, mass=mass) == -(-needed // ALIGN) * ALIGN
    assert resolve_size("auto", counts, v, greedy=True, mass=mass) == ALIGN  # greedy ignores the mass
    assert resolve_size("auto", None, v, greedy=False, mass=mass) > 0  # the mass alone is enough
    assert resolve_size("64", None, v, greedy=False, mass=mass) == 64
    np.testing.assert_array_equal(ranking(counts, mass, greedy=False), mass)
    np.testing.assert_array_equal(ranking(counts, mass, greedy=True), counts)
    np.testing.assert_array_equal(ranking(counts, None, greedy=False), counts)  # older heads: by counts


def test_probability_mass_sums_the_next_token_distributions_where_masked():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    mask = np.array([[1, 0, 1, 1, 0], [0, 0, 0, 1, 1]], np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = (probs * mask[..., None]).sum((0, 1))
    got = np.asarray(probability_mass(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got.sum() == pytest.approx(mask.sum(), rel=1e-5)  # each position's distribution sums to one


@pytest.mark.parametrize("spec, message", [
    ("many", "draft_vocab='many': give auto, 0"),
    ("-3", "draft_vocab=-3 must be >= 0"),
])
def test_bad_sizes_are_one_line(spec, message):
    with pytest.raises(CloverError, match=message) as err:
        parse_size(spec)
    assert_one_line(err)


def test_a_size_without_counts_says_what_to_do():
    with pytest.raises(CloverError, match="carry no token counts.*train.train.*draft_vocab=0") as err:
        resolve_size("16", None, 64)
    assert_one_line(err)


def test_most_frequent_keeps_the_top_tokens_and_their_rows():
    table = jnp.arange(10 * 3, dtype=jnp.float32).reshape(10, 3)
    counts = np.array([0, 9, 3, 9, 0, 7, 1, 0, 2, 0])
    vocab = DraftVocab.most_frequent(table, counts, 4)
    np.testing.assert_array_equal(vocab.ids, [1, 2, 3, 5])
    np.testing.assert_array_equal(vocab.rows, np.asarray(table)[[1, 2, 3, 5]])
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)), jnp.float32)
    full = hidden @ table.T
    np.testing.assert_allclose(vocab.logits(hidden), vocab.take(full), rtol=1e-5)
    np.testing.assert_array_equal(vocab.token(jnp.array([[0, 3]])), [[1, 5]])
    q = jnp.array([0.1, 0.2, 0.3, 0.4])
    expanded = np.asarray(vocab.expand(q, 10))
    assert expanded.sum() == pytest.approx(1.0) and expanded[[0, 4, 6, 7, 8, 9]].sum() == 0
    np.testing.assert_allclose(expanded[[1, 2, 3, 5]], q)
    with pytest.raises(CloverError, match="counts cover 3 tokens but the model has 10"):
        DraftVocab.most_frequent(table, counts[:3], 2)
    with pytest.raises(CloverError, match="does not fit"):
        DraftVocab.most_frequent(table, counts, 11)


@pytest.fixture(scope="module")
def base():
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(0))


def test_counts_are_saved_beside_the_heads_and_replaced_with_them(base, tmp_path):
    heads = make_heads(drafter_config("medusa", 1), base)
    v = base.cfg.vocab_size
    assert load_token_counts(tmp_path, v) is None  # heads exported before counts existed
    counts = np.arange(v)
    save_heads(heads, base, tmp_path, token_counts=counts)
    np.testing.assert_array_equal(load_token_counts(tmp_path, v), counts)
    save_heads(heads, base, tmp_path)  # new heads without counts: the old heads' counts go with them
    assert not (tmp_path / COUNTS).exists()


def test_sampling_drafts_from_the_probability_mass_saved_beside_the_heads(base, tmp_path):
    """The counts rank tokens for greedy decoding and the probability mass for sampling; heads exported
    before the mass existed still sample over the whole vocabulary under `auto`."""
    heads = make_heads(drafter_config("medusa", 1), base)
    v = base.cfg.vocab_size
    counts = np.zeros(v, np.int64)
    counts[:4] = 10  # greedy text uses four tokens
    mass = np.linspace(1.0, 2.0, v).astype(np.float32)  # the base model's distribution favours the last ids
    save_heads(heads, base, tmp_path, token_counts=counts)
    assert load_token_counts(tmp_path, v, "mass") is None
    assert load_draft_vocab(tmp_path, base, "auto", greedy=False) is None
    save_heads(heads, base, tmp_path, token_counts=counts, token_mass=mass)
    np.testing.assert_array_equal(load_token_counts(tmp_path, v, "mass"), mass)
    np.testing.assert_array_equal(np.asarray(load_draft_vocab(tmp_path, base, "4").ids), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(load_draft_vocab(tmp_path, base, "4", greedy=False).ids),
                                  np.arange(v - 4, v))
    assert load_draft_vocab(tmp_path, base, "auto", greedy=False) is None  # rounded up to ALIGN: past V (64)


@pytest.mark.parametrize("damage, message", [("garbage", "cannot read the token counts"),
                                             ("short", "counts for 3 tokens, but the model has 64")])
def test_damaged_counts_are_one_line(damage, message, base, tmp_path):
    if damage == "garbage":
        (tmp_path / COUNTS).write_bytes(b"not safetensors")
    else:
        save_file({"counts": np.zeros(3, np.int64)}, str(tmp_path / COUNTS))
    with pytest.raises(CloverError, match=message) as err:
        load_token_counts(tmp_path, base.cfg.vocab_size)
    assert_one_line(err)


def test_index_of_inverts_token():
    vocab = DraftVocab(ids=jnp.asarray([2, 5, 7], jnp.int32), rows=jnp.zeros((3, 4)))
    np.testing.assert_array_equal(vocab.index_of(jnp.asarray([[7, 2], [3, 5]]), 9), [[2, 0], [-1, 1]])
    np.testing.assert_array_equal(vocab.token(vocab.index_of(vocab.ids, 9)), vocab.ids)
