"""The public API (`clover_jax.load`, `Model.generator`, `TextGenerator.generate`) on the shipped
reference model: its greedy text is the command's and the plain engine's, speculative decoding writes
plain decoding's tokens, every kind of prompt encodes as the tokenizer would, the statistics add up,
and the README's "## Python API" example runs as it stands.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import clover_jax
from clover_jax.api import finish_reason
from clover_jax.engine.decode import Generator
from clover_jax.errors import CloverError
from clover_jax.io import sources, tokenization
from conftest import assert_one_line
from infer import generate

REPO = Path(__file__).resolve().parents[1]
NEW = 12
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os"]


@pytest.fixture(scope="module")
def model():
    return clover_jax.load()


@pytest.fixture(scope="module")
def plain(model):
    return model.generator()


@pytest.fixture(scope="module")
def plain_tokens(plain):
    """Plain greedy decoding's tokens for PROMPTS, in one batch."""
    return plain.generate(PROMPTS, NEW).tokens


def test_load_finds_the_reference_model_and_what_text_needs(model):
    assert model.path == sources.DEFAULT_MODEL_DIR and model.source is None and model.mesh is None
    assert model.config.vocab_size == model.module.cfg.vocab_size
    assert model.eos_ids == tokenization.eos_ids(model.path, model.config, model.tokenizer)
    assert "module" not in repr(model)  # the repr names the model, not its weights


def test_greedy_text_is_the_commands_and_the_plain_engines(model, plain, plain_tokens, capsys):
    out = plain.generate(PROMPTS[0], NEW)
    assert out.tokens == plain_tokens[:1]
    ids = tokenization.encode(model.tokenizer, PROMPTS[0], bos_id=model.config.bos_token_id)
    assert out.tokens == Generator(model.module).generate([ids], NEW, eos_ids=model.eos_ids).tokens
    assert out.text == model.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    capsys.readouterr()
    assert generate.main(["--prompt", PROMPTS[0], "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out == out.text + "\n"


@pytest.mark.parametrize("method,tree", [("clover2", "auto"), ("eagle3", "chain:2")])
def test_speculative_generator_writes_plain_decodings_tokens(method, tree, model, plain_tokens):
    gen = model.generator(method, tree=tree)
    assert gen.method == method and gen.speculative and gen.tree is not None
    out = gen.generate(PROMPTS, NEW)
    assert out.tokens == plain_tokens
    assert out.tau > 1.0  # the shipped heads draft tokens the model keeps
    assert out.accept_hist.shape == (len(PROMPTS), gen.tree.max_depth + 1)


def test_a_drafter_is_loaded_once_for_several_generators(model, plain_tokens):
    drafter = model.drafter("medusa", "random", num_heads=2)
    assert drafter.heads_dir is None and drafter.num_heads == 2
    gen = model.generator(heads=drafter, tree="chain:2")  # the method is the drafter's
    assert gen.method == "medusa" and gen.engine.drafter is drafter.drafter
    assert gen.generate(PROMPTS, NEW).tokens == plain_tokens  # untrained heads change no greedy token
    again = model.generator(heads=drafter, tree="chain:1")
    assert again.engine.drafter is drafter.drafter
    shipped = model.drafter("clover2")
    assert shipped.heads_dir == sources.DEFAULT_MODEL_DIR / "heads" / "clover2"
    assert model.drafter("clover2", shipped.heads_dir).num_heads == shipped.num_heads


def test_chat_conversation_and_token_id_prompts(model, plain):
    question, system = "Write a function that adds two numbers.", "Answer in Python."
    ids = tokenization.encode(model.tokenizer, question, chat=True, bos_id=model.config.bos_token_id)
    assert model.encode(question, chat=True) == ids
    as_text = plain.generate([question], NEW, chat=True)
    assert plain.generate(ids, NEW).tokens == as_text.tokens  # one prompt of token ids
    assert plain.generate(np.asarray([ids]), NEW).tokens == as_text.tokens  # a batch of them, as an array
    assert plain.generate([{"role": "user", "content": question}], NEW).tokens == as_text.tokens
    turns = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    assert plain.generate(question, NEW, chat=True, system=system).tokens == plain.generate(turns, NEW).tokens
    assert model.encode(turns) != ids
    with pytest.raises(CloverError) as e:
        model.encode(turns, system=system)
    assert_one_line(e)


def test_statistics_of_a_generation(model, plain):
    out = plain.generate(PROMPTS, NEW, stop_at_eos=False, batch_size=2)
    assert len(out.outputs) == 2  # two batches of two, the second filled
    assert [len(t) for t in out.tokens] == [NEW] * 3 and out.finish_reasons == ["length"] * 3
    assert out.steps == [NEW] * 3 and out.tau == 1.0  # plain: one forward pass per token
    assert out.num_new_tokens == 3 * NEW and out.tokens_per_second > 0 and out.run_seconds > 0
    assert out.accept_hist is None
    assert plain.generate(PROMPTS, NEW, stop_at_eos=False, batch_size=2).compile_seconds == 0  # compiled above
    ended = plain.generate(PROMPTS, 3 * NEW)
    for tokens, reason in zip(ended.tokens, ended.finish_reasons):
        assert reason == ("eos" if tokens[-1] in model.eos_ids else "length")
        assert reason == "eos" or len(tokens) == 3 * NEW
    assert finish_reason([5, 0], (0,)) == "eos" and finish_reason([], (0,)) == "length"
    with pytest.raises(CloverError, match="read .texts"):
        out.text


@pytest.mark.parametrize("call", ["dtype", "no prompts", "batch size", "drafter of another method", "plain heads"])
def test_a_user_error_is_one_line(call, model, plain):
    with pytest.raises(CloverError) as e:
        if call == "dtype":
            clover_jax.load(dtype="float16")
        elif call == "no prompts":
            plain.generate([], NEW)
        elif call == "batch size":
            plain.generate(PROMPTS, NEW, batch_size=0)
        elif call == "drafter of another method":
            model.generator("clover2", heads=model.drafter("medusa", "random"))
        else:
            model.drafter("plain")
    assert_one_line(e)


def test_the_package_names_the_api_without_importing_jax_for_its_errors():
    code = ("import sys, clover_jax.errors; assert 'jax' not in sys.modules; import clover_jax; "
            "assert all(getattr(clover_jax, n) for n in clover_jax.__all__); print(clover_jax.load.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout == "clover_jax.api\n", done.stderr


def test_the_readme_python_api_example_runs_as_it_stands(capsys):
    section = (REPO / "README.md").read_text().split("\n## Python API\n")[1].split("\n## ")[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"tau \d\.\d\d \(plain 1\.00\), steps \[\d+, \d+\]", printed), printed
