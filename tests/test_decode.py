"""Plain generation: greedy equals Hugging Face `generate` token for token; budgets, EOS, buckets,
compile accounting and bad prompts."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clover_jax.io.hf import load_pretrained
from clover_jax.engine.decode import Generator
from clover_jax.errors import CloverError
from clover_jax.engine.sampling import SamplingConfig
from conftest import MAX_NEW, PROMPTS, VOCAB, assert_one_line


def hf_greedy(hf, prompt, max_new, eos=None) -> list[int]:
    """HF greedy continuation of one unpadded prompt (EOS included when hit)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama2(loaded, llama2_generator):
    return loaded("llama2")[0], llama2_generator


def pick_eos(hf) -> int:
    """A token that greedy decoding of PROMPTS[1] emits mid-way, so that sequence stops early."""
    free = hf_greedy(hf, PROMPTS[1], MAX_NEW, eos=[])
    return free[3]


@pytest.mark.parametrize("family", ["llama2", "llama3-gqa8x2", "qwen2"])
def test_greedy_matches_hf(loaded, family):
    """Batch 3 with prompts of different lengths, EOS from config.json; batch 1 for one family."""
    hf, _, cfg, model = loaded(family)
    gen = Generator(model)
    out = gen.generate(PROMPTS, MAX_NEW)
    for prompt, got in zip(PROMPTS, out.tokens):
        want = hf_greedy(hf, prompt, MAX_NEW, eos=list(cfg.eos_token_ids))
        assert got == want
    assert out.steps <= MAX_NEW
    if family == "llama2":
        single = gen.generate(PROMPTS[1:2], MAX_NEW)
        assert single.tokens == out.tokens[1:2]


def test_greedy_stops_at_eos_like_hf(llama2):
    hf, gen = llama2
    eos = pick_eos(hf)
    out = gen.generate(PROMPTS, MAX_NEW, eos_ids=[eos])
    assert out.tokens[1][-1] == eos and len(out.tokens[1]) <= 4  # stopped early, EOS kept
    for prompt, got in zip(PROMPTS, out.tokens):
        want = hf_greedy(hf, prompt, MAX_NEW, eos=eos)
        assert got == want
        assert eos not in got[:-1]


def test_per_sequence_budgets(llama2):
    hf, gen = llama2
    full = gen.generate(PROMPTS, MAX_NEW, eos_ids=[])
    assert [len(t) for t in full.tokens] == [MAX_NEW] * 3
    out = gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[2, 0, 7])
    assert [len(t) for t in out.tokens] == [2, 0, 7]
    assert out.tokens[0] == full.tokens[0][:2] == hf_greedy(hf, PROMPTS[0], 2, eos=[])
    assert out.tokens[2] == full.tokens[2][:7]
    # A budget above max_new_tokens is capped by it.
    capped = gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[50, 1, 3])
    assert capped.tokens == [full.tokens[0], full.tokens[1][:1], full.tokens[2][:3]]


def test_compiles_once_per_bucket(loaded):
    _, _, _, model = loaded("llama2")
    gen = Generator(model)
    first = gen.generate([[1, 2, 3]], 4)
    assert gen.compilations == 1 and first.compile_seconds > 0
    same_bucket = gen.generate([[1, 2, 3, 4, 5, 6, 7]], 4)
    assert gen.compilations == 1 and same_bucket.compile_seconds == 0
    longer = gen.generate([list(range(3, 43))], 4)  # 40 tokens: the next bucket
    assert gen.compilations == 2 and longer.compile_seconds > 0
    gen.generate([[1, 2]], 4)
    assert gen.compilations == 2


def test_set_up_run_leaves_the_output_alone(loaded):
    """A new program runs once on a prefill and one step before the timed run (its set-up counts as
    compile time); that run must not touch what the timed one writes, sampled tokens included."""
    _, _, _, model = loaded("llama2")
    gen = Generator(model)
    sampling = SamplingConfig(temperature=1.0)
    first = gen.generate(PROMPTS, MAX_NEW, sampling, seed=3, eos_ids=[], budgets=[MAX_NEW, 1, 0])
    again = gen.generate(PROMPTS, MAX_NEW, sampling, seed=3, eos_ids=[], budgets=[MAX_NEW, 1, 0])
    assert first.compile_seconds > 0 and again.compile_seconds == 0
    assert first.tokens == again.tokens and [len(t) for t in first.tokens] == [MAX_NEW, 1, 0]


def test_prompt_longer_than_cache(loaded):
    _, _, _, model = loaded("llama2")
    gen = Generator(model, max_len=32)
    with pytest.raises(CloverError, match=r"prompt of 30 tokens \+ 8 new tokens exceeds the cache of 32") as excinfo:
        gen.generate([list(range(3, 33))], 8)
    assert_one_line(excinfo)
    assert gen.compilations == 0


@pytest.mark.parametrize("prompts, match", [
    ([[1, VOCAB]], r"prompt token ids must be in \[0, 64\)"),
    ([[1, 2], [-1]], r"prompt token ids must be in \[0, 64\)"),
    ([[1, 2], []], r"every prompt must have at least one token"),
    ([], r"every prompt must have at least one token"),
])
def test_bad_prompts(llama2_generator, prompts, match):
    gen = llama2_generator
    with pytest.raises(CloverError, match=match) as excinfo:
        gen.generate(prompts, 4)
    assert_one_line(excinfo)


def test_bad_max_new_tokens(llama2_generator):
    with pytest.raises(CloverError, match=r"max_new_tokens=0 must be >= 1") as excinfo:
        llama2_generator.generate([[1, 2]], 0)
    assert_one_line(excinfo)


def test_output_accounting(llama2):
    _, gen = llama2
    out = gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[4, 10, 6])
    assert out.num_new_tokens == 20 and out.steps == MAX_NEW
    assert out.run_seconds > 0 and out.tokens_per_second > 0
    assert np.asarray(out.state.num_new).tolist() == [4, 10, 6]


def test_on_tokens_sees_every_step_and_its_errors_come_back(llama2):
    """Streaming: `on_tokens` is handed each step's tokens so far, in order, the last being the output,
    and nothing from the set-up run; an error it raises reaches the caller, and the next call is clean."""
    _, gen = llama2
    plain = gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[4, MAX_NEW, 6])
    calls = []
    out = gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[4, MAX_NEW, 6],
                       on_tokens=lambda tokens, counts: calls.append((tokens.copy(), counts.tolist())))
    assert out.tokens == plain.tokens and len(calls) == out.steps - 1 == MAX_NEW - 1
    assert [c for _, c in calls] == [[min(n, b) for b in (4, MAX_NEW, 6)] for n in range(2, MAX_NEW + 1)]
    assert [calls[-1][0][i, :n].tolist() for i, n in enumerate(calls[-1][1])] == out.tokens

    def fail(tokens, counts):
        raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError, match="stdout closed"):
        gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[4, MAX_NEW, 6], on_tokens=fail)
    assert gen.generate(PROMPTS, MAX_NEW, eos_ids=[], budgets=[4, MAX_NEW, 6],
                        on_tokens=lambda *_: None).tokens == out.tokens


def test_non_finite_logits(hf_checkpoint):
    _, model = load_pretrained(hf_checkpoint("llama2")[1])
    model.norm.weight[...] = jnp.full(model.norm.weight.shape, jnp.nan)
    with pytest.raises(CloverError, match=r"non-finite logits") as excinfo:
        Generator(model).generate([[1, 2, 3]], 2)
    assert_one_line(excinfo)


def test_batch_size_fills_the_batch_and_returns_the_real_rows(llama2):
    """`batch_size` fills a smaller batch with budget-0 copies, so one program serves every batch, and
    hands back only the real rows: the tokens an unfilled batch gives them, sampled ones too (a row's key
    depends on its index alone), with the streaming callback shown those rows alone."""
    _, gen = llama2
    sampling = SamplingConfig(temperature=1.0)
    for s in (SamplingConfig(), sampling):
        alone = gen.generate(PROMPTS[:2], MAX_NEW, s, seed=5, eos_ids=[])
        filled = gen.generate(PROMPTS[:2], MAX_NEW, s, seed=5, eos_ids=[], batch_size=4)
        assert filled.tokens == alone.tokens and filled.sequence_steps == alone.sequence_steps
        assert np.asarray(filled.state.num_new).tolist() == [MAX_NEW, MAX_NEW, 0, 0]  # the filler: no budget
    # The generator is the session's, shared with other files' tests in this worker: which programs exist
    # already depends on their order, so the check is on what this call compiled: only batch-of-4 programs
    # (the streaming one), none for its single real row.
    before = set(gen._compiled)
    shown = []
    one = gen.generate(PROMPTS[1:2], MAX_NEW, sampling, seed=5, eos_ids=[], batch_size=4,
                       on_tokens=lambda tokens, counts: shown.append(counts.tolist()))
    assert all(key[0] == 4 for key in set(gen._compiled) - before)
    assert len(one.tokens) == 1 and one.tokens[0] == gen.generate(PROMPTS[1:2], MAX_NEW, sampling, seed=5,
                                                                 eos_ids=[]).tokens[0]
    assert shown and all(len(c) == 1 for c in shown)
    with pytest.raises(CloverError, match="batch_size=2 is smaller than the 3 prompts") as excinfo:
        gen.generate(PROMPTS, MAX_NEW, batch_size=2)
    assert_one_line(excinfo)
