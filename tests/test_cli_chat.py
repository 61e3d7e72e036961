"""`python -m infer.generate` with chat models: the chat template applied (a system turn from --system
or from the record itself; a template that refuses one is one line), --turns all answering each turn
after the model's own earlier answers, and --interactive sending the whole conversation back."""

import io
import json
import sys

import pytest

from clover_jax import _cli as cli
from clover_jax._cli import conversation
from clover_jax.engine.decode import Generator
from clover_jax.errors import CloverError
from clover_jax.io import tokenization
from clover_jax.io.hf import load_pretrained
from conftest import CLI_NEW as NEW, tiny_llama_checkpoint
from test_cli import STATS, run_cli

def test_interactive_chat_sends_the_conversation_back(hf_tok, capsys, tmp_path, monkeypatch):
    """--interactive: each line is a user turn, the reply is streamed, and the next prompt is the whole
    conversation as the chat template renders it, the model's reply included; blank lines are skipped;
    the oldest exchange goes when the conversation no longer leaves --max-new-tokens of room."""
    model_dir = tiny_llama_checkpoint(tmp_path / "model", max_position_embeddings=128)
    gen = Generator(load_pretrained(model_dir)[1])

    def reply(messages):
        ids = hf_tok(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        tokens = gen.generate([ids], NEW, eos_ids=(0,)).tokens[0]
        return hf_tok.decode(tokens, skip_special_tokens=True), tokens

    def chat(*argv):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\nand x?\n"))
        return run_cli(capsys, "--model", model_dir, "--interactive", "--system", "be brief",
                       "--max-new-tokens", NEW, *argv)

    system = [{"role": "system", "content": "be brief"}]
    first, tokens = reply(system + [{"role": "user", "content": "hi"}])
    answer = hf_tok.decode(tokens[:-1] if tokens[-1] == 0 else tokens, skip_special_tokens=True)
    second, _ = reply(system + [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
                                {"role": "user", "content": "and x?"}])
    code, out, err = chat()
    assert code == 0, err
    assert out == f"{first}\n{second}\n"
    assert len([line for line in err.splitlines() if STATS.match(line)]) == 3  # one per reply, then the total
    assert "dropped" not in err
    # In a cache too small for both exchanges, the second prompt starts again from its own turn.
    alone, _ = reply(system + [{"role": "user", "content": "and x?"}])
    code, out, err = chat("--max-len", 48)  # 36 + 6 tokens for the first turn; 38 + 6 for the second alone
    assert code == 0, err
    assert out == f"{first}\n{alone}\n" and "(the oldest exchange no longer fits --max-len: dropped)" in err


def test_turns_all_answers_each_turn_after_the_models_own_answers(capsys, tmp_path):
    """--turns all: a record's second turn is asked after the conversation so far, with the model's own
    first answer in it, as FastChat answers MT-Bench; one JSON object per turn answered, by record."""
    model_dir = tiny_llama_checkpoint(tmp_path / "model", max_position_embeddings=128)
    tok = cli.load_tokenizer(model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(1, tok.vocab_size, 2))}))
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"turns": ["x = 1", "y?"]}) + "\n" + json.dumps({"prompt": "z"}) + "\n")
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--chat", "--turns", "all",
                             "--max-new-tokens", 8, "--batch-size", 2, "--json")
    assert code == 0 and STATS.match(err.strip().splitlines()[-1]), err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["record"], r["turn"], r["prompt"]) for r in rows] == [(1, 1, "x = 1"), (1, 2, "y?"), (2, 1, "z")]
    model = load_pretrained(model_dir)[1]
    gen, eos = Generator(model, max_len=128), tokenization.eos_ids(model_dir, model.cfg, tok)
    first = gen.generate([tokenization.encode(tok, "x = 1", chat=True)], 8, eos_ids=eos)
    assert first.tokens[0][-1] in eos  # it ended, so the second turn was asked
    history = [("x = 1", tok.decode(first.tokens[0][:-1], skip_special_tokens=True))]
    second = gen.generate([conversation.encode_conversation(tok, history, None, eos, "", then="y?")[0]], 8, eos_ids=eos)
    assert [r["tokens"] for r in rows[:2]] == [first.tokens[0], second.tokens[0]]
    assert rows[1]["steps"] == second.sequence_steps[0]
    for argv, needle in (([], "add --chat"), (["--stream", "--chat"], "drop --stream")):
        code, _, err = run_cli(capsys, "--model", model_dir, "--prompts", path, "--turns", "all", *argv)
        assert code == 2 and err.count("\n") == 1 and needle in err


def test_chat_applies_the_template(model_dir, hf_tok, library, capsys):
    ids = tokenization.encode(hf_tok, "hi", chat=True)
    assert hf_tok.decode(ids) == "### User:\nhi\n### Assistant:\n"
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompt", "hi", "--chat", "--max-new-tokens", NEW,
                           "--json")
    assert code == 0
    assert json.loads(out)["tokens"] == library([ids])[0]
    ids = tokenization.encode(hf_tok, "hi", chat=True, system="be brief")
    assert hf_tok.decode(ids) == "be brief\n\n### User:\nhi\n### Assistant:\n"
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompt", "hi", "--chat", "--system", "be brief",
                           "--max-new-tokens", NEW, "--json")
    assert code == 0
    assert json.loads(out)["tokens"] == library([ids])[0]


def test_a_records_own_system_turn_is_kept_under_chat(model_dir, hf_tok, library, tmp_path, capsys):
    """ShareGPT's system turn (or a top-level "system") is part of the conversation: under --chat it comes
    before the prompt, and --system fills in only for records without one; raw text has no turns."""
    records = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}]},
               {"prompt": "hi", "system": "be kind"}, {"prompt": "hi"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.read_prompt_turns(path) == [("hi", "be brief"), ("hi", "be kind"), ("hi", None)]
    assert cli.read_prompts(path) == ["hi"] * 3
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompts", path, "--chat", "--system", "be fast",
                           "--max-new-tokens", NEW, "--json")
    assert code == 0
    for row, system in zip(map(json.loads, out.splitlines()), ("be brief", "be kind", "be fast")):
        ids = tokenization.encode(hf_tok, "hi", chat=True, system=system)
        assert hf_tok.decode(ids) == f"{system}\n\n### User:\nhi\n### Assistant:\n"
        assert row["tokens"] == library([ids])[0]
    code, out, _ = run_cli(capsys, "--model", model_dir, "--prompts", path, "--max-new-tokens", NEW, "--json")
    assert code == 0
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == library([hf_tok("hi")["input_ids"]] * 3)


def test_a_template_that_refuses_a_system_turn_is_one_line(hf_tok, monkeypatch):
    """Some templates (Mistral's, Gemma's) raise on a system turn: that is the user's error, in one line."""
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    monkeypatch.setattr(hf_tok, "chat_template", refusing)
    needle = r"refused the prompt: System role not supported; it may take no system turn: drop system="
    with pytest.raises(CloverError, match=needle) as e:
        tokenization.encode(hf_tok, "hi", chat=True, system="be brief")
    assert "\n" not in str(e.value)
