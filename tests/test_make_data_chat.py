"""`python -m train.make_data` on chat data: each assistant turn as the chat template writes it, every
turn in the loss or the first alone, the model answering every user turn after its own earlier answers
(self mode), a template that rewrites earlier turns refused; and examples tokenized whole, as decoding
sees them, with the loss mask on the tokens of the answers."""

import json

import pytest

from clover_jax.engine.decode import Generator
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.errors import CloverError
from clover_jax.io import tokenization
from clover_jax.io.hf import load_pretrained
from clover_jax._cli import conversation
from conftest import tiny_llama_checkpoint, tiny_tokenizer
from test_make_data import NEW, RECORDS, _examples, run
from train import make_data

def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of tokens in the loss."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    return runs


def test_chat_sharegpt_fixed_response_is_the_templates_assistant_turn(model_dir, hf_tok, tmp_path, capsys):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([RECORDS[3], {"prompt": "for i in", "response": " range(10):\n    print(i)\n"}]))
    code, out, _ = run(capsys, "--base", model_dir, "--prompts", path, "--out", tmp_path / "d", "--mode", "fixed",
                       "--chat", "--system", "be kind")
    assert code == 0 and "wrote 2 examples" in out
    # The conversation keeps its own system turn; --system stands in for it in the record without one.
    for (tokens, mask), system in zip(_examples(tmp_path / "d"), ("be brief", "be kind")):
        p = tokenization.encode(hf_tok, "for i in", chat=True, system=system)
        assert hf_tok.decode(p) == f"{system}\n\n### User:\nfor i in\n### Assistant:\n"
        assert tokens[: len(p)] == p and mask == [0] * len(p) + [1] * (len(tokens) - len(p))
        assert hf_tok.decode(tokens[len(p):]) == " range(10):\n    print(i)\n<|endoftext|>"
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["system"] == "be kind" and meta["turns"] == "all" and meta["hidden_dtype"] is None
    assert not (tmp_path / "d" / "hidden.npy").exists()


def test_chat_sharegpt_fixed_trains_on_every_assistant_turn(hf_tok, tmp_path, capsys):
    """A conversation is one example: each assistant turn masked in, after the turns before it, exactly as
    the template renders the whole conversation; what breaks the human/gpt order ends it."""
    model_dir = tiny_llama_checkpoint(tmp_path / "model", max_position_embeddings=128)  # room for two exchanges
    turns = [("human", "def add(a, b):"), ("gpt", "\n    return a + b\n"), ("human", "and sub?"),
             ("gpt", "def sub(a, b):\n    return a - b\n"), ("gpt", "dropped: a second reply in a row"),
             ("human", "dropped too")]
    path = tmp_path / "multi.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]}) + "\n")
    code, out, _ = run(capsys, "--base", model_dir, "--prompts", path, "--out", tmp_path / "all", "--mode", "fixed",
                       "--chat")
    assert code == 0 and "wrote 1 examples" in out
    [(tokens, mask)] = _examples(tmp_path / "all")
    messages = [{"role": "user" if f == "human" else "assistant", "content": v} for f, v in turns[:4]]
    whole = hf_tok.apply_chat_template(messages, tokenize=False)
    assert hf_tok.decode(tokens) == whole[: whole.rindex("<|endoftext|>") + len("<|endoftext|>")]
    assert masked_runs(hf_tok, tokens, mask) == ["\n    return a + b\n<|endoftext|>",
                                                "def sub(a, b):\n    return a - b\n<|endoftext|>"]
    # --turns first: the first exchange alone, as before; --turns all without --chat is refused.
    code, _, _ = run(capsys, "--base", model_dir, "--prompts", path, "--out", tmp_path / "first", "--mode", "fixed",
                     "--chat", "--turns", "first")
    [(first, first_mask)] = _examples(tmp_path / "first")
    assert code == 0 and first == tokens[: len(first)] and first_mask == mask[: len(first)]
    assert hf_tok.decode(first).endswith("return a + b\n<|endoftext|>")
    assert json.loads((tmp_path / "first" / "meta.json").read_text())["turns"] == "first"
    code, _, err = run(capsys, "--base", model_dir, "--prompts", path, "--out", tmp_path / "raw", "--mode", "fixed",
                       "--turns", "all")
    assert code == 2 and err.count("\n") == 1 and "add --chat, or drop --turns" in err


def test_chat_self_mode_answers_every_user_turn_after_its_own_answers(hf_tok, tmp_path, capsys):
    """Self mode: the model answers turn 1, then turn 2 after the conversation with its own answer rendered
    by the template (as a chat application sends it back), and so on; the example is the last prompt plus
    the last answer, every answer in the loss. Turn t's batches take the seeds after turn t-1's."""
    model_dir = tiny_llama_checkpoint(tmp_path / "model", max_position_embeddings=128)
    eos = tuple(range(1, hf_tok.vocab_size, 2))  # odd ids end an answer: short answers that end, sampled
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    records = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "x = 1"},
                                  {"from": "gpt", "value": "ignored in self mode"}, {"from": "human", "value": "y?"}]},
               {"turns": ["a = 2", "b?", "c?"]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, _ = run(capsys, "--base", model_dir, "--prompts", path, "--out", tmp_path / "d", "--chat",
                     "--batch-size=1", f"--max-new-tokens={NEW}", "--temperature=1", "--seed=3")
    assert code == 0
    model = load_pretrained(model_dir)[1]
    gen = Generator(model, max_len=128)
    eos = tokenization.eos_ids(model_dir, model.cfg, hf_tok)
    sampling = SamplingConfig(temperature=1.0)
    seeds = iter(range(3, 100))
    conversations = [("be brief", ["x = 1", "y?"]), (None, ["a = 2", "b?", "c?"])]
    expected = [None, None]
    history = [[], []]
    prompts = {i: tokenization.encode(hf_tok, users[0], chat=True, system=system) for i, (system, users) in
               enumerate(conversations)}
    masks = {i: [0] * len(p) for i, p in prompts.items()}
    turns_answered = [0, 0]
    for turn in range(3):
        nxt = {}
        for i, prompt in sorted(prompts.items(), key=lambda kv: len(kv[1])):  # shortest first
            reply = gen.generate([prompt], min(NEW, 128 - len(prompt)), sampling=sampling, seed=next(seeds),
                                 eos_ids=eos).tokens[0]
            expected[i] = (prompt + reply, masks[i] + [1] * len(reply))
            turns_answered[i] += 1
            system, users = conversations[i]
            if turn + 1 < len(users) and reply[-1] in eos:
                history[i].append((users[turn], hf_tok.decode(reply[:-1], skip_special_tokens=True)))
                nxt[i] = conversation.encode_conversation(hf_tok, history[i], system, eos, "", then=users[turn + 1])
        prompts = {i: ids for i, (ids, _) in nxt.items()}
        masks = {i: mask for i, (_, mask) in nxt.items()}
    assert turns_answered[0] == 2 and turns_answered[1] >= 2  # the seeds give answers that end in time
    assert _examples(tmp_path / "d") == [tuple(e) for e in expected]
    tokens, mask = expected[0]  # the system turn, both user turns, both answers in the loss
    text = hf_tok.decode(tokens)
    assert text.startswith("be brief\n\n### User:\nx = 1\n### Assistant:\n")
    assert "<|endoftext|>\n### User:\ny?\n### Assistant:\n" in text
    assert "".join(map(str, mask)).strip("0").count("10") == 1  # two runs of 1s


def test_a_template_that_rewrites_earlier_turns_is_one_line(hf_tok, monkeypatch):
    """Turns are masked apart by rendering the conversation turn by turn; a template whose rendering of
    turn 2 changes turn 1's text (here: only the last assistant turn keeps its text) cannot be."""
    rewriting = ("{% for m in messages %}{{ m['role'] }}: "
                 "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
                 "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    monkeypatch.setattr(hf_tok, "chat_template", rewriting)
    with pytest.raises(CloverError, match="f:1: the chat template rewrites earlier turns when it renders turn 2") as e:
        conversation.encode_conversation(hf_tok, (("a", "b"), ("c", "d")), None, (0,), "f:1")
    assert "\n" not in str(e.value)
    ids, mask = conversation.encode_conversation(hf_tok, (("a", "b"),), None, (0,), "f:1")
    assert hf_tok.decode(ids) == "user: a\nassistant: b\n" and sum(mask) > 0


def sentencepiece_like_tokenizer(legacy: bool):
    """A small BPE tokenizer that marks word starts with "▁" as Llama-2's and Mistral's do: the newer way
    (a Metaspace pre-tokenizer that prepends "▁" to the text's first piece only) or, with `legacy`, the
    original Llama-2 tokenizer.json's (a normalizer that prepends "▁" to every text it is given)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(["Hello there, how are you? I am fine. What is two and two? Four."] * 20,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=special))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"  # Mistral's shape
                        "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
                        "{% endif %}{% endfor %}")
    return hf


def test_examples_are_tokenized_whole_as_decoding_sees_them():
    """A conversation's ids are its whole rendered text's, as a chat application sends it, with the loss
    mask on each reply's tokens: tokenized turn by turn, "▁" tokenizers start each reply with a "▁" that
    the conversation does not have. The same for a prompt and its response without --chat."""
    tok = sentencepiece_like_tokenizer(legacy=False)
    eos = (tok.eos_token_id,)
    exchanges = (("Hello there", "How are you?"), ("What is two and two?", "Four."))
    ids, mask = conversation.encode_conversation(tok, exchanges, None, eos, "f:1")
    messages = [{"role": r, "content": c} for said in exchanges for r, c in zip(("user", "assistant"), said)]
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert masked_runs(tok, ids, mask) == ["How are you?</s>", "Four.</s>"]
    assert tok.convert_ids_to_tokens(tok("How are you?", add_special_tokens=False)["input_ids"])[0] == "▁"
    # The prompt for the next reply is the whole text up to the assistant's opening.
    prompt, prompt_mask = conversation.encode_conversation(tok, exchanges[:1], None, eos, "f:1", then="Four?")
    opening = tok.apply_chat_template(tokenization.chat_messages(exchanges[:1], "Four?"), tokenize=False,
                                      add_generation_prompt=True)
    assert prompt == tok(opening, add_special_tokens=False)["input_ids"]
    assert masked_runs(tok, prompt, prompt_mask) == ["How are you?</s>"]
    # Without --chat: the prompt and response as one text; the legacy tokenizer prepends "▁" to each text.
    tok = sentencepiece_like_tokenizer(legacy=True)
    record = make_data.Record(("Hello there",), (("Hello there", " How are you?"),), None, "f:1")
    ids, mask = make_data.fixed_example(tok, record, False, None, eos, False)
    assert ids == tok("Hello there How are you?")["input_ids"]
    assert masked_runs(tok, ids, mask) == ["How are you?"]  # (a decoded text drops its first "▁")
    apart = tok("Hello there")["input_ids"] + tok(" How are you?", add_special_tokens=False)["input_ids"]
    assert apart != ids


def test_loss_mask_holds_tokens_whose_offsets_are_trimmed_but_not_the_bos():
    """A tokenizer that trims spaces from its offsets (GPT-2's tokenizer.json does) gives an all-space token
    no width: it is still its reply's. The BOS the tokenizer adds has no width either, and is no reply's."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = tiny_tokenizer()
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "x =    1"
    ids, mask = conversation.masked_ids(tok, text, [(0, len(text))], (), add_special_tokens=True)
    offsets = tok(text, return_offsets_mapping=True)["offset_mapping"]
    assert ids[0] == bos and mask == [0] + [1] * (len(ids) - 1)
    assert any(start == end for start, end in offsets[1:])  # the spaces' token, trimmed to no width
    ids, mask = conversation.masked_ids(tok, text, [(len("x ="), len(text))], (), add_special_tokens=True)
    assert masked_runs(tok, ids, mask) == ["    1"]
