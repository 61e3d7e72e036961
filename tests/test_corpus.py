"""The reference model's data: corpus split, byte-level tokenizer, token streams, evaluation prompts.

A tokenizer is trained once on 40 train-split files at vocab 1000, which takes a second or two.
"""

import json
import pathlib
import shutil

import numpy as np
import pytest

from clover_jax.errors import CloverError
from train import corpus, make_prompts, tokenizer

SOURCES = [
    "",
    "def f(x):\n    return x + 1\n",
    "class A:\n\tdef g(self):\n\t\treturn 'tab'  \n\n",  # tabs and trailing whitespace
    "def größe(ñ):\n    π = 3.14159\n    return ñ * π\n",  # unicode identifiers
    "MSG = 'done \U0001F600 \u2713'  # emoji\n",
    "if True:\r\n    x = 1\r\n\r\n",  # CRLF
    "x = 1\ry = 2\n\x0c\nz = '\\n'\n   ",  # lone CR, form feed, no final newline
    "    \n\n\n        indented_start()",
    "s = '中文字符串' + \"\"\"\n    doc\n\"\"\"\n",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    files = corpus.split_files(corpus.list_files())["train"][:40]
    tok = tokenizer.train_tokenizer((corpus.read_text(f) for f in files), vocab_size=1000)
    return tokenizer.save_tokenizer(tok, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def raw_tok(tok_dir):
    return corpus.load_tokenizer(tok_dir)


def test_files_skip_tests_and_generated_code():
    files = corpus.list_files()
    assert files == sorted(files) and len(files) > 300
    assert "os.py" in files and "json/decoder.py" in files
    for rel in files:
        parts = pathlib.PurePosixPath(rel).parts
        assert rel.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), rel
    assert "encodings/cp037.py" not in files  # generated charmap table
    assert "pydoc_data/topics.py" not in files  # > 300 KB


def test_split_is_stable_disjoint_and_covers_every_file():
    files = corpus.list_files()
    split = corpus.split_files(files)
    assert split == corpus.split_files(reversed(files))
    sets = [set(split[name]) for name in corpus.SPLITS]
    assert all(sets) and sum(map(len, sets)) == len(files) == len(set().union(*sets))
    assert len(split["train"]) > 0.8 * len(files)
    # Pinned: SHA-1 buckets do not depend on the process, the machine or the file list.
    assert [corpus._bucket(p) for p in ("os.py", "json/decoder.py", "asyncio/staggered.py")] == [29, 14, 97]
    assert "asyncio/staggered.py" in split["test"] and "os.py" in split["train"]


def test_write_split_records_the_split(tmp_path):
    record = json.loads(corpus.write_split(tmp_path).read_text())
    assert record["stdlib"] == str(corpus.stdlib_root())
    assert {k: record[k] for k in corpus.SPLITS} == corpus.split_files(corpus.list_files())


@pytest.mark.parametrize("text", SOURCES)
def test_tokenizer_round_trips_bytes(raw_tok, text):
    ids = raw_tok.encode(text, add_special_tokens=False).ids
    assert raw_tok.decode(ids, skip_special_tokens=False).encode("utf-8") == text.encode("utf-8")
    assert raw_tok.encode(text).ids == ids  # the post-processor adds nothing (no BOS)


def test_special_token_ids(raw_tok):
    assert raw_tok.token_to_id("<|endoftext|>") == 0
    assert raw_tok.token_to_id("<|bos|>") == 1
    assert raw_tok.get_vocab_size() == 1000


def test_auto_tokenizer_matches_raw(tok_dir, raw_tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert hf.is_fast and hf.model_max_length == 2048
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token_id, hf.bos_token, hf.bos_token_id) == (
        "<|endoftext|>", 0, 0, "<|bos|>", 1)
    for text in SOURCES:
        ids = hf(text)["input_ids"]
        assert ids == raw_tok.encode(text).ids
        assert hf.decode(ids) == text
    chat = hf.apply_chat_template([{"role": "user", "content": "Write a function."}],
                                  tokenize=False, add_generation_prompt=True)
    assert chat == "### User:\nWrite a function.\n### Assistant:\n"


def test_encode_split_ends_every_document_with_eos(raw_tok):
    files = corpus.split_files(corpus.list_files())["validation"][:3]
    stream = corpus.encode_split(raw_tok, files, eos_id=0)
    assert stream.dtype == np.uint16 and stream[-1] == 0
    ends = np.flatnonzero(stream == 0)
    assert len(ends) == len(files)
    docs = np.split(stream, ends + 1)[:-1]
    assert [raw_tok.decode(d[:-1].tolist()) for d in docs] == [corpus.read_text(f) for f in files]


def test_load_or_encode_caches_per_tokenizer(tmp_path, tok_dir):
    first = corpus.load_or_encode(tmp_path / "data", tok_dir, "validation")
    assert len(list((tmp_path / "data").glob("validation-*.npy"))) == 1
    np.testing.assert_array_equal(corpus.load_or_encode(tmp_path / "data", tok_dir, "validation"), first)
    other = tmp_path / "other.json"  # same tokenizer, different file bytes: a new cache entry
    shutil.copy(tok_dir / "tokenizer.json", other)
    other.write_text(other.read_text() + "\n")
    np.testing.assert_array_equal(corpus.load_or_encode(tmp_path / "data", other, "validation"), first)
    assert len(list((tmp_path / "data").glob("validation-*.npy"))) == 2
    with pytest.raises(CloverError):
        corpus.load_or_encode(tmp_path / "data", tok_dir, "dev")


def test_prompts_come_from_test_definitions_and_fit(tmp_path, tok_dir, raw_tok):
    prompts = make_prompts.make_prompts(tok_dir, count=25, seed=3, max_tokens=120)
    assert len(prompts) == 25
    assert prompts == make_prompts.make_prompts(tok_dir, count=25, seed=3, max_tokens=120)
    assert prompts != make_prompts.make_prompts(tok_dir, count=25, seed=4, max_tokens=120)
    test_files = set(corpus.split_files(corpus.list_files())["test"])
    for p in prompts:
        rel, lineno = p["source"].rsplit(":", 1)
        assert rel in test_files
        def_line = corpus.read_text(rel).split("\n")[int(lineno) - 1].rstrip()
        assert def_line.lstrip().startswith(("def ", "async def ", "class ")) and def_line in p["prompt"]
        assert len(raw_tok.encode(p["prompt"]).ids) <= 120
        assert p["prompt"] == p["prompt"].rstrip()

    out = tmp_path / "prompts.jsonl"
    assert make_prompts.main(["--tokenizer", str(tok_dir), "--out", str(out), "--count", "25",
                              "--seed", "3", "--max-tokens", "120"]) == 0
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == prompts


def test_user_errors_are_clover_errors(tmp_path):
    with pytest.raises(CloverError):
        tokenizer.train_tokenizer(iter(["x"]), vocab_size=10)
    with pytest.raises(CloverError):
        make_prompts.make_prompts(tmp_path / "missing", count=1)
    assert tokenizer.main(["--out", str(tmp_path / "t"), "--vocab-size", "10"]) == 2
