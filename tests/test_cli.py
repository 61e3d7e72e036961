"""`python -m infer.generate` end to end on a tiny random Llama checkpoint with a real tokenizer.

The checkpoint is what a user brings: `transformers` writes it (config.json, generation_config.json,
model.safetensors) and the repository's tokenizer code writes the tokenizer files beside it. The CLI's
output is checked against the library called directly, so the tool adds no tokens and drops none.
"""

import io
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from clover_jax.io.hf import load_pretrained
from clover_jax.model.llama import Llama
from clover_jax.engine.sampling import SamplingConfig
from conftest import CLI_NEW as NEW
from clover_jax import _cli as cli
from clover_jax.io import sources
from clover_jax._cli.stream import StreamPrinter
from infer import generate
from clover_jax.io import tokenization

REPO = pathlib.Path(__file__).resolve().parents[1]
FLAGS = ("--model", "--prompt", "--prompts", "--chat", "--method", "--max-new-tokens", "--temperature",
         "--top-p", "--top-k", "--draft-temperature", "--seed", "--dtype", "--max-len", "--batch-size", "--json",
         "--drafter", "--heads", "--tree", "--draft-vocab", "--num-heads", "--mesh", "--coordinator", "--num-processes", "--process-id",
         "--stream", "--system", "--interactive", "--compile-cache", "--chat-template", "--turns", "--step-cost",
         "--loop-chunk")
STATS = re.compile(r"^\[(plain|medusa|clover|clover2)\]( tree=\d+ nodes, depth \d+, drafting from (all|\d+) tokens"
                   r"(, paced at [\d.]+ plain steps: drafted in \d+/\d+ steps)?"
                   r"| plain decoding \(tree auto: no chain of these heads is modelled to beat it here\))? "
                   r"new_tokens=\d+ steps=\d+ tau=[\d.]+ tokens/s=[\d.]+ compile=[\d.]+s run=[\d.]+s$")


def run_cli(capsys, *argv):
    code = generate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_prompt_text_is_the_librarys_generation(model_dir, hf_tok, library, capsys):
    prompt = "def add(a, b):"
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW)
    assert code == 0
    [tokens] = library([hf_tok(prompt)["input_ids"]])
    assert out == hf_tok.decode(tokens, skip_special_tokens=True) + "\n"
    assert STATS.match(err.strip()), err
    assert f"new_tokens={len(tokens)} " in err


@pytest.mark.parametrize("method", ["medusa", "clover2"])
def test_speculative_methods_print_the_plain_text(method, model_dir, hf_tok, library, capsys, tmp_path):
    """Greedy speculative decoding through the CLI: the same text as plain decoding, from random heads
    and from a heads directory written by `save_heads`; heads of another base model are refused."""
    from clover_jax.io.heads_dir import save_heads
    from clover_jax.drafters.heads import make_heads
    from clover_jax.drafters.registry import drafter_config

    prompt = "def add(a, b):"
    [tokens] = library([hf_tok(prompt)["input_ids"]])
    expected = hf_tok.decode(tokens, skip_special_tokens=True) + "\n"
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW,
                             "--method", method, "--heads", "random", "--tree", "chain:2")
    assert (code, out) == (0, expected), err
    assert STATS.match(err.strip()) and err.startswith(f"[{method}] tree=3 nodes, depth 2, drafting from all "), err
    _, model = load_pretrained(model_dir)
    counts = np.zeros(model.cfg.vocab_size, np.int64)
    counts[tokens] = 1  # the continuation's own tokens: auto drafts from them (rounded up to 128 ids)
    save_heads(make_heads(drafter_config(method, 2), model, seed=1), model, tmp_path / "heads", token_counts=counts)
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW,
                             "--method", method, "--heads", tmp_path / "heads")
    assert (code, out) == (0, expected), err
    assert "drafting from 128 tokens" in err, err
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW,
                             "--method", method, "--heads", tmp_path / "heads", "--draft-vocab", 3)
    assert (code, out) == (0, expected) and "drafting from 3 tokens" in err, err
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW,
                             "--method", method, "--heads", "random", "--draft-vocab", 3)
    assert code == 2 and "carry no token counts" in err and err.count("\n") == 1
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--method", method)
    assert code == 2 and err.startswith(f"error: no {method} heads at") and err.count("\n") == 1
    other = make_heads(drafter_config(method, 2), Llama(model.cfg, rngs=nnx.Rngs(5)))
    save_heads(other, Llama(model.cfg, rngs=nnx.Rngs(5)), tmp_path / "other")
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--method", method,
                             "--heads", tmp_path / "other")
    assert code == 2 and "trained for another base model" in err and err.count("\n") == 1


def test_auto_decodes_plain_where_no_chain_of_the_heads_pays(model_dir, hf_tok, library, capsys, tmp_path):
    """Heads whose held-out tau at one draft (1.3 tokens a step) beats a greedy chain:1 step's modelled
    cost on a CPU (1.29 plain steps) but not a sampling one's (1.39): `--tree auto` drafts one token a
    step greedy, and decodes plain when sampling, writing what plain decoding writes with the same seed,
    and the statistics line says so. A tree asked for by name still drafts."""
    from clover_jax.io.heads_dir import CONFIG, save_heads
    from clover_jax.drafters.heads import make_heads
    from clover_jax.drafters.registry import drafter_config

    _, model = load_pretrained(model_dir)
    heads = tmp_path / "heads"
    save_heads(make_heads(drafter_config("medusa", 2), model, seed=1), model, heads)
    meta = json.loads((heads / CONFIG).read_text())
    meta["held_out"] = {"val_chain_tau_by_depth": [1.3, 1.33]}
    (heads / CONFIG).write_text(json.dumps(meta))
    prompt = "def add(a, b):"
    ids = [hf_tok(prompt)["input_ids"]]
    common = ["--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW, "--method", "medusa", "--heads", heads]
    code, out, err = run_cli(capsys, *common)
    assert (code, out) == (0, hf_tok.decode(library(ids)[0], skip_special_tokens=True) + "\n"), err
    assert STATS.match(err.strip()) and err.startswith("[medusa] tree=2 nodes, depth 1,") and "paced at 1.29" in err
    hot = SamplingConfig(temperature=1.0)
    code, out, err = run_cli(capsys, *common, "--temperature", 1, "--seed", 3)
    assert (code, out) == (0, hf_tok.decode(library(ids, hot, 3)[0], skip_special_tokens=True) + "\n"), err
    assert STATS.match(err.strip()) and err.startswith("[medusa] plain decoding (tree auto:"), err
    code, out, err = run_cli(capsys, *common, "--temperature", 1, "--seed", 3, "--tree", "chain:1")
    assert code == 0 and err.startswith("[medusa] tree=2 nodes, depth 1,") and "paced" not in err, err


@pytest.mark.parametrize("method", ["plain", "medusa"])
def test_stream_prints_the_same_text_as_it_is_written(method, model_dir, hf_tok, library, capsys, tmp_path,
                                                      monkeypatch):
    """--stream: the library hands the host every step's tokens, the CLI prints them as they come, one
    prompt at a time (--batch-size 1 by default then), and stdout ends up what it is without --stream."""
    prompts = ["def add(a, b):", "class Point:"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    seen: dict[StreamPrinter, list[int]] = {}  # printer (kept alive, so never confused) -> its counts
    handed = StreamPrinter.__call__
    monkeypatch.setattr(StreamPrinter, "__call__",
                        lambda self, tokens, counts: (seen.setdefault(self, []).append(int(counts[0])),
                                                      handed(self, tokens, counts)))
    spec = [] if method == "plain" else ["--method", method, "--heads", "random", "--tree", "chain:2"]
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW, "--stream", *spec)
    assert code == 0, err
    expected = [library([hf_tok(p)["input_ids"]])[0] for p in prompts]
    assert out == "\n---\n".join(hf_tok.decode(t, skip_special_tokens=True) for t in expected) + "\n"
    assert STATS.match(err.strip()) and f"new_tokens={sum(map(len, expected))} " in err, err
    counts = list(seen.values())
    assert len(counts) == 2
    for got, tokens in zip(counts, expected):  # once per decoding step, after the prefill's first token
        assert got == sorted(set(got)) and got[-1] == len(tokens), (got, tokens)
        if method == "plain":
            assert got == list(range(2, len(tokens) + 1))


def test_stream_printer_waits_for_whole_characters(capsys):
    """A character whose bytes span tokens is printed once complete; a decoding that rewrites what was
    shown is printed again whole after a line break at the end, never lost."""

    class Bytes:  # one token per byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("aé b".encode())
    printer = StreamPrinter(Bytes())
    pieces = []
    for n in range(1, len(ids) + 1):
        printer(np.asarray([ids]), np.asarray([n]))
        pieces.append(capsys.readouterr().out)
    assert pieces == ["a", "", "é", " ", "b"]
    printer.show(ids, final=True)
    assert capsys.readouterr().out == ""

    class Rewrites:
        def decode(self, ids, skip_special_tokens=True):
            return "ab" if len(ids) == 1 else "xyz"

    printer = StreamPrinter(Rewrites())
    printer(np.asarray([[5, 6]]), np.asarray([1]))
    printer(np.asarray([[5, 6]]), np.asarray([2]))  # not a continuation of "ab": held back
    printer.show([5, 6], final=True)
    assert capsys.readouterr().out == "ab\nxyz"


def test_sampling_flags_reach_the_sampler(model_dir, hf_tok, library, capsys):
    prompt = "import os"
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompt", prompt, "--max-new-tokens", NEW,
                           "--temperature", 0.9, "--top-p", 0.95, "--top-k", 50, "--seed", 3, "--json")
    assert code == 0
    [tokens] = library([hf_tok(prompt)["input_ids"]], SamplingConfig(0.9, top_k=50, top_p=0.95), seed=3)
    assert json.loads(out)["tokens"] == tokens


def test_prompts_file_reads_all_three_formats(model_dir, hf_tok, library, capsys, tmp_path):
    prompts = ["def add(a, b):", "class Point:", "for i in range(10):"]
    records = [{"prompt": prompts[0]},
               {"question_id": 81, "category": "writing", "turns": [prompts[1], "a second turn"]},
               {"id": "x", "conversations": [{"from": "system", "value": "be brief"},
                                             {"from": "human", "value": prompts[2]},
                                             {"from": "gpt", "value": "ignored"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW,
                             "--batch-size", 3)
    assert code == 0
    expected = library([hf_tok(p)["input_ids"] for p in prompts])
    assert out == "\n---\n".join(hf_tok.decode(t, skip_special_tokens=True) for t in expected) + "\n"
    assert STATS.match(err.strip()), err


def test_progress_bar_while_the_answers_go_to_a_file(model_dir, capsys, tmp_path, monkeypatch):
    """Several batches with stdout redirected and stderr a terminal: a progress bar over the prompts on
    stderr, cleared before the statistics line; with the answers on the terminal, none."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a", "b", "c")))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW,
                           "--batch-size", 2, "--json")
    assert code == 0 and "generate:   0%" in err and "0/3 [" in err  # (later states: as time allows)
    assert STATS.match(err.rsplit("\r", 1)[-1].strip())  # the bar's last state is wiped, then the statistics
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, _, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW,
                           "--batch-size", 2, "--json")
    assert code == 0 and "generate:" not in err and STATS.match(err.strip())


def test_prompts_from_standard_input(model_dir, hf_tok, library, capsys, monkeypatch):
    """--prompts -: the records on standard input, as from a file; a bad one is named stdin:LINE."""
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "import os"}\n{"prompt": "class Point:"}\n'))
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompts", "-", "--max-new-tokens", NEW, "--json")
    assert code == 0
    expected = library([hf_tok(p)["input_ids"] for p in ("import os", "class Point:")])
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "import os"}\nnot json\n'))
    code, _, err = run_cli(capsys, "--model", model_dir, "--prompts", "-")
    assert code == 2 and err.startswith("error: stdin:2: not a JSON object") and err.count("\n") == 1


def test_json_output_one_object_per_prompt_across_batches(model_dir, hf_tok, library, capsys, tmp_path,
                                                          monkeypatch):
    prompts = ["def add(a, b):", "class Point:", "for i in range(10):"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    made = []
    make = generate.make_generator
    monkeypatch.setattr(generate, "make_generator", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW,
                             "--batch-size", 2, "--json")
    assert code == 0
    # The last batch, one prompt, is filled to two (a copy with no budget): one program serves both batches,
    # and the copy's tokens are neither printed nor counted.
    assert made[0].compilations == 1
    rows = [json.loads(line) for line in out.splitlines()]
    assert f"new_tokens={sum(r['num_tokens'] for r in rows)} " in err
    assert [r["prompt"] for r in rows] == prompts
    for row, prompt in zip(rows, prompts):
        [tokens] = library([hf_tok(prompt)["input_ids"]])
        assert row["tokens"] == tokens
        assert row["num_tokens"] == len(tokens)
        assert row["text"] == hf_tok.decode(tokens, skip_special_tokens=True)
        assert row["finish_reason"] == ("eos" if tokens[-1] == 0 else "length")
        assert row["steps"] == len(tokens) and row["tau"] == 1.0  # plain: one forward pass per token
    # Sampled, the filled batch gives its prompt the tokens a batch of one would (batch k takes seed + k).
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW,
                           "--batch-size", 2, "--json", "--temperature", 1, "--seed", 4)
    last = json.loads(out.splitlines()[-1])["tokens"]
    assert code == 0 and last == library([hf_tok(prompts[2])["input_ids"]], SamplingConfig(temperature=1.0), 5)[0]


def test_chat_template_flag_vicuna_and_a_file(model_dir, no_chat_dir, library, capsys, tmp_path):
    """--chat-template vicuna renders FastChat's vicuna_v1.1 conversation exactly (Vicuna's tokenizer ships
    no template); a file's template serves as well. Both work where the tokenizer has none."""
    tok = cli.load_tokenizer(no_chat_dir, "vicuna")
    text = tokenization.render_chat(tok, tokenization.chat_messages([("hi", "hello")], "q2"), add_generation_prompt=True)
    assert text == f"{tok.bos_token}{cli.VICUNA_SYSTEM} USER: hi ASSISTANT: hello{tok.eos_token}USER: q2 ASSISTANT:"
    text = tokenization.render_chat(tok, tokenization.chat_messages([], "hi", "be brief"), add_generation_prompt=True)
    assert text == f"{tok.bos_token}be brief USER: hi ASSISTANT:"
    code, out, _ = run_cli(capsys, "--model", no_chat_dir, "--prompt", "hi", "--chat", "--chat-template", "vicuna",
                           "--system", "be brief", "--max-new-tokens", NEW, "--json")
    assert code == 0 and json.loads(out)["tokens"] == library([tok(text, add_special_tokens=False)["input_ids"]])[0]
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    code, out, _ = run_cli(capsys, "--model", no_chat_dir, "--prompt", "hi", "--chat", "--chat-template", template,
                           "--max-new-tokens", NEW, "--json")
    assert code == 0 and json.loads(out)["tokens"] == library([tok("<hi>", add_special_tokens=False)["input_ids"]])[0]


def test_empty_prompt_starts_from_bos(model_dir, library, capsys):
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompt", "", "--max-new-tokens", NEW, "--json")
    assert code == 0
    assert json.loads(out)["tokens"] == library([[1]])[0]


def test_eos_ids_join_config_generation_config_and_tokenizer(model_dir, hf_tok, tmp_path):
    from clover_jax.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    assert tokenization.eos_ids(model_dir, cfg, hf_tok) == (0,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert tokenization.eos_ids(tmp_path, cfg, hf_tok) == (0, 5, 7)


@pytest.fixture(scope="module")
def no_chat_dir(model_dir, tmp_path_factory):
    """The same checkpoint with a tokenizer that has no chat template."""
    out = tmp_path_factory.mktemp("no-chat")
    for f in model_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case", ["missing model", "default model missing", "no tokenizer", "prompt too long",
                                  "bad top-p", "negative temperature", "zero draft temperature", "bad max-new-tokens",
                                  "bad batch size",
                                  "bad prompts line", "missing prompts file", "no chat template",
                                  "stream with json", "stream with a batch",
                                  "system without chat", "interactive with json", "interactive, no template",
                                  "unknown chat template", "chat template without chat"])
def test_bad_input_is_one_error_line_and_exit_2(case, model_dir, no_chat_dir, capsys, tmp_path, monkeypatch):
    m = ["--model", model_dir]
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((model_dir / "config.json").read_text())
    argv, needle = {
        "missing model": (["--model", tmp_path / "nope", "--prompt", "x"], "no such model directory"),
        "default model missing": (["--prompt", "x"], "reference model is not at"),
        "no tokenizer": (["--model", no_tokenizer, "--prompt", "x"], "cannot load a tokenizer"),
        "prompt too long": (m + ["--prompt", "def add(a, b): " * 20, "--max-len", 32], "--max-len"),
        "bad top-p": (m + ["--prompt", "x", "--top-p", 1.5], "top_p=1.5"),
        "negative temperature": (m + ["--prompt", "x", "--temperature", -1], "temperature=-1"),
        "zero draft temperature": (m + ["--prompt", "x", "--draft-temperature", 0], "draft_temperature=0"),
        "bad max-new-tokens": (m + ["--prompt", "x", "--max-new-tokens", 0], "max_new_tokens=0"),
        "bad batch size": (m + ["--prompt", "x", "--batch-size", 0], "--batch-size 0"),
        "bad prompts line": (m + ["--prompts", bad_line], "bad.jsonl:2: no prompt found"),
        "missing prompts file": (m + ["--prompts", tmp_path / "none.jsonl"], "cannot read the prompts file"),
        "no chat template": (["--model", no_chat_dir, "--prompt", "x", "--chat"], "no chat template"),
        "stream with json": (m + ["--prompt", "x", "--stream", "--json"], "--stream prints one prompt at a time, as text: drop --json"),
        "stream with a batch": (m + ["--prompts", bad_line, "--stream", "--batch-size", 2], "drop --batch-size 2"),
        "system without chat": (m + ["--prompt", "x", "--system", "be brief"], "--system is a turn of the chat template; add --chat"),
        "interactive with json": (m + ["--interactive", "--json"], "--interactive is a chat, one reply at a time, as text: drop --json"),
        "interactive, no template": (["--model", no_chat_dir, "--interactive"], "no chat template"),
        "unknown chat template": (m + ["--prompt", "x", "--chat", "--chat-template", "vicunaa"],
                                  "--chat-template vicunaa: neither a template name (vicuna) nor a readable file"),
        "chat template without chat": (m + ["--prompt", "x", "--chat-template", "vicuna"],
                                       "--chat-template is the template --chat renders prompts with; add --chat"),
    }[case]
    # The shipped model may or may not be built in this checkout; the error must not depend on it.
    monkeypatch.setattr(sources, "DEFAULT_MODEL_DIR", tmp_path / "models" / "reference")
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert needle in err, err


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    """Ctrl-C in any tool: one `interrupted` line, status 130 as a shell reports it, no traceback."""

    def body():
        raise KeyboardInterrupt

    assert cli.run_main(body) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_help_mentions_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in out
    assert "examples:" in out
    for action in generate.build_parser()._actions:
        assert action.help, action.option_strings
    assert {o for a in generate.build_parser()._actions for o in a.option_strings} == set(FLAGS) | {"-h", "--help"}


def test_runs_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "infer.generate", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--max-new-tokens" in proc.stdout


@pytest.mark.slow
def test_compiled_programs_are_kept_between_runs(model_dir, tmp_path):
    """--compile-cache: the first run writes its compiled programs there, a second run loads them and
    writes the same text; off writes nothing; a folder that cannot be written to is one error line."""
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # the tiny model compiles fast
    cache = tmp_path / "xla"

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "infer.generate", "--model", str(model_dir), "--prompt", "x",
                               "--max-new-tokens", "4", *flags], capture_output=True, text=True, timeout=300, env=env)

    first = run("--compile-cache", str(cache))
    files = sorted(p.name for p in cache.iterdir())
    second = run("--compile-cache", str(cache))
    assert first.returncode == second.returncode == 0 and files and first.stdout == second.stdout
    assert sorted(p.name for p in cache.iterdir()) == files  # loaded, not compiled and written again
    env[cli.COMPILE_CACHE_ENV] = str(tmp_path / "from-env")
    assert run("--compile-cache", "off").returncode == 0 and not (tmp_path / "from-env").exists()
    (tmp_path / "a-file").write_text("")
    bad = run("--compile-cache", str(tmp_path / "a-file" / "xla"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot write there" in bad.stderr


def test_ci_runs_the_readmes_test_command():
    """The README's test command (the fast tests) is a line of .ci/run, and the slow ones follow it there:
    together they are the whole suite."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    [command] = [line for block in blocks for line in block.splitlines() if "python -m pytest" in line]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert command in ci and command.endswith('python -m pytest -q -m "not slow"')
    assert ci.index(command) < ci.index("python -m pytest -q -m slow")
    assert "`python -m pytest -q` runs every test" in readme


def test_layers_read_library_then_tools():
    """The library imports no tool package, and the training tools do not import the inference ones:
    what both use lives in clover_jax (cli, conversation)."""
    import ast

    def imported(path):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        return names + [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]

    for package, banned in (("clover_jax", ("infer", "train")), ("train", ("infer",))):
        for path in sorted((REPO / package).glob("*.py")):
            bad = [m for m in imported(path) if m.split(".")[0] in banned]
            assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("tool", ["infer.generate", "train.evaluate", "train.export"])
def test_drafter_and_its_older_name_heads_are_one_flag(tool):
    import importlib

    parser = importlib.import_module(tool).build_parser()
    [action] = [a for a in parser._actions if "--drafter" in a.option_strings]
    assert action.option_strings == ["--drafter", "--heads"] and action.dest == "heads"
