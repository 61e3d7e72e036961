"""The decoding loops taken K steps at a time (`engine.chunks`): for K in 1, 3 and 8 the tokens, the step
counts, the statistics and what streaming is shown are K = 1's, for plain and speculative decoding,
greedy and sampling, paced and unpaced, with budgets and EOS that end sequences mid-chunk in a batch of
different lengths; the settings refuse a bad K, and the benchmark's --command-buffer sets XLA_FLAGS."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.engine.decode import Generator
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.plan.factory import make_generator
from clover_jax.trees.spec import resolve_tree
from infer import loop_flags

CHUNKS = (1, 3, 8)
PROMPTS = [[1, 7, 8, 9], [1, 3, 4, 22, 23, 24, 25, 60, 12, 40, 41], [1, 5], [9] * 6]
MAX_NEW = 11  # 10 steps after the prefill: neither K = 3 nor K = 8 divides them
# A budget cut mid-chunk, another cut, the whole budget (the row EOS cuts), a row with nothing to do.
BUDGETS = [4, 7, MAX_NEW, 0]
EOS_ROW = 2
SEED = 3
SAMPLINGS = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=1.0)}


def perturbed_heads(model):
    """Clover-2 heads moved off their identity-like init, so that they draft partly wrong tokens."""
    heads = make_heads(drafter_config("clover2", 3), model, seed=0)
    leaves, treedef = jax.tree.flatten(nnx.state(heads, nnx.Param))
    keys = jax.random.split(jax.random.key(7), len(leaves))
    nnx.update(heads, jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                                   for x, k in zip(leaves, keys)]))
    return heads


def run(gen, sampling, eos_ids):
    """(the output, every streamed (tokens, counts)) of one generation of PROMPTS under BUDGETS."""
    calls = []
    out = gen.generate(PROMPTS, MAX_NEW, sampling, seed=SEED, eos_ids=eos_ids, budgets=BUDGETS,
                       on_tokens=lambda t, c: calls.append((t.copy(), c.tolist())))
    return out, calls


def mid_eos(out) -> tuple[int]:
    """A token EOS_ROW writes at position 3 or later and not before it: as EOS it stops that row mid-way."""
    row = out.tokens[EOS_ROW]
    return (next(t for j, t in enumerate(row) if j >= 3 and t not in row[:j]),)


def assert_same_for_every_k(make, sampling):
    """Generations by `make(K)` for each K in CHUNKS, with EOS chosen to stop EOS_ROW mid-chunk, match K=1's."""
    free = make(1).generate(PROMPTS, MAX_NEW, sampling, seed=SEED, eos_ids=(), budgets=BUDGETS)
    eos = mid_eos(free)
    runs = {k: run(make(k), sampling, eos) for k in CHUNKS}
    ref, ref_calls = runs[1]
    assert len(ref.tokens[EOS_ROW]) < MAX_NEW and ref.tokens[EOS_ROW][-1] == eos[0]  # EOS cut the row
    assert [len(t) for t in ref.tokens][3] == 0 and len(ref.tokens[0]) <= 4
    for k, (out, calls) in runs.items():
        assert out.tokens == ref.tokens, k
        assert out.steps == ref.steps and out.sequence_steps == ref.sequence_steps, k
        for name in ("accept_hist", "node_hits"):
            a, b = getattr(out, name), getattr(ref, name)
            assert (a is None and b is None) or np.array_equal(a, b), (k, name)
        assert [c for _, c in calls] == [c for _, c in ref_calls], k  # no call for a masked step
        assert all(np.array_equal(t, u) for (t, _), (u, _) in zip(calls, ref_calls)), k
    assert len(ref_calls) == ref.steps - 1
    return ref, eos


@pytest.fixture(scope="module")
def model(loaded):
    return loaded("llama2")[3]


@pytest.fixture(scope="module")
def heads(model):
    return perturbed_heads(model)


@pytest.mark.parametrize("mode", SAMPLINGS)
def test_plain_output_is_the_same_for_every_chunk(model, mode):
    made = {}
    make = lambda k: made.setdefault(k, Generator(model, loop_chunk=k))
    ref, _ = assert_same_for_every_k(make, SAMPLINGS[mode])
    assert ref.steps == max(len(t) for t in ref.tokens)


@pytest.mark.parametrize("paced", [False, True], ids=["unpaced", "paced"])
@pytest.mark.parametrize("mode", SAMPLINGS)
def test_speculative_output_is_the_same_for_every_chunk(model, heads, mode, paced):
    """Unpaced: steps past the loop's end run masked; paced (a step cost that random heads do not pay
    for, so plain and speculative runs alternate): each run's steps past its end are skipped."""
    tree = resolve_tree("chain:3", "clover2", 3)
    made = {}
    make = lambda k: made.setdefault(k, SpeculativeGenerator(model, heads, tree, loop_chunk=k,
                                                             step_cost=2.5 if paced else None))
    ref, eos = assert_same_for_every_k(make, SAMPLINGS[mode])
    plain_steps = int(np.asarray(ref.state.plain_steps).sum())
    assert (plain_steps > 0) == paced and ref.drafted_steps > 0
    if not paced and mode == "greedy":  # and greedy speculative decoding writes plain decoding's text
        plain = Generator(model, loop_chunk=8).generate(PROMPTS, MAX_NEW, eos_ids=eos, budgets=BUDGETS)
        assert plain.tokens == ref.tokens


@pytest.mark.parametrize("chunk", [0, -2, 1.5, True])
def test_a_chunk_is_a_whole_number_of_steps(model, chunk):
    with pytest.raises(CloverError, match="loop chunk"):
        Generator(model, loop_chunk=chunk)


def test_the_factory_and_the_flags_pass_the_chunk_on(model):
    assert make_generator(model, None, loop_chunk=5).loop_chunk == 5
    assert make_generator(model, "medusa", heads="random", tree="chain:2", loop_chunk=4).loop_chunk == 4
    with pytest.raises(CloverError, match="--loop-chunk"):
        loop_flags.check_loop_chunk(type("Args", (), {"loop_chunk": 0})())


def test_command_buffer_is_set_before_jax_starts(monkeypatch):
    loop_flags.use_command_buffer(False)  # off: nothing to do, whatever has started
    jax.devices()
    with pytest.raises(CloverError, match="before JAX starts"):
        loop_flags.use_command_buffer(True)
    code = ("import os; from infer import loop_flags; loop_flags.use_command_buffer(True); import jax; "
            "print(jax.numpy.ones(2).sum()); print(os.environ['XLA_FLAGS'])")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_pass_re=none")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["2.0", "--xla_dump_hlo_pass_re=none " + loop_flags.COMMAND_BUFFER]
