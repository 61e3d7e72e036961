"""`python -m train.make_data` and `train.data.HeadDataset` on a tiny random Llama with a real tokenizer.

Every stored array is checked against the library called directly: token ids against the tokenizer,
self-distilled responses against `Generator`, hidden states against a plain forward of the model.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from clover_jax.io.hf import load_pretrained
from clover_jax.engine.decode import Generator
from clover_jax.errors import CloverError
from clover_jax.model.llama import causal_self_mask
from clover_jax.engine.sampling import SamplingConfig
from conftest import save_tiny_llama
from clover_jax import _cli as cli
from train import hidden_states, make_data, merge_data
from train.data import HeadDataset

RECORDS = [{"prompt": "def add(a, b):", "response": "\n    return a + b\n"},
           {"prompt": "class Point:", "response": "\n    def __init__(self, x):\n        self.x = x\n" * 3},
           {"prompt": "import os", "response": "\nprint(os.getcwd())"},
           {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "for i in"},
                              {"from": "gpt", "value": " range(10):\n    print(i)\n"}]}]
NEW = 6


@pytest.fixture(scope="module")
def model(model_dir):
    return load_pretrained(model_dir)[1]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def run(capsys, *argv):
    capsys.readouterr()  # drop what setting up printed (transformers' progress bars)
    code = make_data.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def fixed_dir(model_dir, prompts_file, tmp_path_factory):
    """Fixed responses with float16 hidden states; max-len 24 so the long response is cut."""
    out = tmp_path_factory.mktemp("fixed")
    assert make_data.main([f"--base={model_dir}", f"--prompts={prompts_file}", f"--out={out}", "--mode=fixed",
                           "--max-len=24", "--batch-size=3", "--store-hidden=float16"]) == 0
    return out


@pytest.fixture(scope="module")
def self_dir(model_dir, prompts_file, tmp_path_factory):
    """Self-distilled (sampled) responses with bfloat16 hidden states; the last batch is a partial one."""
    out = tmp_path_factory.mktemp("self")
    assert make_data.main([f"--base={model_dir}", f"--prompts={prompts_file}", f"--out={out}", "--mode=self",
                           f"--max-new-tokens={NEW}", "--batch-size=3", "--temperature=0.8", "--seed=5",
                           "--store-hidden=bfloat16"]) == 0
    return out


def _examples(path):
    tokens, offsets, mask = (np.load(path / f) for f in ("tokens.npy", "offsets.npy", "loss_mask.npy"))
    assert tokens.dtype == np.int32 and offsets.dtype == np.int64 and mask.dtype == np.uint8
    assert offsets[0] == 0 and offsets[-1] == len(tokens) == len(mask)
    return [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


def _assert_hidden(path, model, examples, dtype, atol):
    """Stored hidden states against one forward of every example, right-padded to the longest."""
    stored = np.load(path / "hidden.npy", mmap_mode="r").view(dtype)
    assert stored.shape == (sum(len(t) for t, _ in examples), model.cfg.hidden_size)
    e, t = len(examples), max(len(tokens) for tokens, _ in examples)
    batch = np.zeros((e, t), np.int32)
    for row, (tokens, _) in enumerate(examples):
        batch[row, : len(tokens)] = tokens
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (e, t))
    ref = np.asarray(nnx.jit(lambda m, x: m(x, positions, causal_self_mask(e, t), with_logits=False).hidden)(
        model, batch))
    start = 0
    for row, (tokens, _) in enumerate(examples):
        n = len(tokens)
        np.testing.assert_allclose(stored[start:start + n].astype(np.float32), ref[row, :n], atol=atol, rtol=atol)
        start += n


def test_fixed_mode_stores_prompt_response_mask_and_hidden(fixed_dir, hf_tok, model):
    examples = _examples(fixed_dir)
    assert len(examples) == len(RECORDS)
    prompts = [r.get("prompt") or r["conversations"][1]["value"] for r in RECORDS]
    responses = [r.get("response") or r["conversations"][2]["value"] for r in RECORDS]
    for (tokens, mask), prompt, response in zip(examples, prompts, responses):
        p = hf_tok(prompt)["input_ids"]
        r = hf_tok(response, add_special_tokens=False)["input_ids"]
        assert tokens == (p + r)[:24]
        assert mask == [0] * len(p) + [1] * (len(tokens) - len(p))
    assert len(examples[1][0]) == 24  # the long response was cut at --max-len
    _assert_hidden(fixed_dir, model, examples, np.float16, 2e-3)
    meta = json.loads((fixed_dir / "meta.json").read_text())
    from clover_jax.io.heads_dir import base_fingerprint

    assert meta == meta | {"base_fingerprint": base_fingerprint(model), "vocab_size": model.cfg.vocab_size,
                           "hidden_size": 32, "num_examples": 4, "num_tokens": sum(len(t) for t, _ in examples),
                           "num_response_tokens": sum(sum(m) for _, m in examples), "mode": "fixed",
                           "max_len": 24, "hidden_dtype": "float16", "created_by": "train.make_data"}
    assert meta["prompts_file"].endswith("prompts.jsonl")
    assert sorted(p.name for p in fixed_dir.iterdir()) == ["hidden.npy", "loss_mask.npy", "meta.json",
                                                          "offsets.npy", "tokens.npy"]


def test_a_short_last_batch_is_filled_to_the_next_power_of_two():
    """The last batch of a turn holds its longest prompts, often one: filled to --batch-size, each filler
    row would prefill and attend like a real one."""
    assert [make_data.batch_fill(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [make_data.batch_fill(n, 3) for n in range(1, 4)] == [1, 2, 3]


def test_long_examples_are_padded_to_the_next_256_tokens():
    """Powers of two up to 256 tokens, then steps of 256: a 1,100-token batch runs as 1,280, not 2,048."""
    assert make_data.data_buckets(2048) == (32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert make_data.data_buckets(300) == (32, 64, 128, 256, 300)
    assert make_data.data_buckets(24) == (24,)


def test_buckets_pad_every_batch_to_the_lengths_given(model_dir, prompts_file, fixed_dir, hf_tok, model,
                                                     tmp_path, capsys, monkeypatch):
    """--buckets: each batch padded up to the smallest given length that holds it, --max-len the last
    (fewer programs to compile on an accelerator); the hidden states at the real positions are the
    default buckets' (right padding changes nothing there)."""
    assert make_data.data_buckets(24, [16, 8, 64, 16]) == (8, 16, 24)
    assert make_data.data_buckets(300, [512]) == (300,)
    real, lengths = hidden_states._last_hidden, []

    def seen(graphdef, params, batch, **k):
        lengths.append(batch.shape[1])
        return real(graphdef, params, batch, **k)

    monkeypatch.setattr(hidden_states, "_last_hidden", seen)
    out = tmp_path / "d"
    code, _, _ = run(capsys, "--base", model_dir, "--prompts", prompts_file, "--out", out, "--mode", "fixed",
                     "--max-len", "24", "--batch-size", "1", "--store-hidden", "float16", "--buckets", "8,16")
    assert code == 0
    examples = _examples(out)
    assert examples == _examples(fixed_dir)
    assert lengths == [next(b for b in (8, 16, 24) if b >= len(t)) for t, _ in sorted(examples, key=lambda e: len(e[0]))]
    assert set(lengths) != {24} and 24 in lengths  # short batches took the short programs, the long one --max-len
    _assert_hidden(out, model, examples, np.float16, 2e-3)
    assert json.loads((out / "meta.json").read_text())["buckets"] == [8, 16, 24]


def test_self_mode_responses_are_the_generators(self_dir, hf_tok, model):
    examples = _examples(self_dir)
    prompts = [hf_tok(r.get("prompt") or r["conversations"][1]["value"])["input_ids"] for r in RECORDS]
    gen = Generator(model, buckets=make_data.data_buckets(64))  # as make_data batches at --max-len 64
    sampling = SamplingConfig(temperature=0.8)
    # Batched shortest first (batch k with seed 5 + k), each answer back in its record's place.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert order != list(range(len(prompts)))  # so the test sees the reordering
    replies = {}
    for k, rows in enumerate(cli.batches(order, 3)):
        out = gen.generate([prompts[i] for i in rows], NEW, sampling=sampling, seed=5 + k, eos_ids=(0,),
                           batch_size=make_data.batch_fill(len(rows), 3))
        replies.update(zip(rows, out.tokens))
    for (tokens, mask), p, r in zip(examples, prompts, [replies[i] for i in range(len(prompts))]):
        assert tokens == p + r
        assert mask == [0] * len(p) + [1] * len(r)
    _assert_hidden(self_dir, model, examples, ml_dtypes.bfloat16, 2e-2)
    meta = json.loads((self_dir / "meta.json").read_text())
    assert meta["mode"] == "self" and meta["hidden_dtype"] == "bfloat16" and meta["max_len"] == 64


def test_batches_are_a_function_of_seed_and_step(fixed_dir, self_dir):
    data = HeadDataset(fixed_dir)
    a, b = data.batch_at(7, 4, 10, seed=3), data.batch_at(7, 4, 10, seed=3)
    for key in ("tokens", "loss_mask", "lengths", "positions", "hidden"):
        np.testing.assert_array_equal(a[key], b[key])
    assert a["tokens"].shape == (4, 10) and a["tokens"].dtype == np.int32
    assert a["loss_mask"].dtype == np.float32 and a["lengths"].dtype == np.int32
    assert a["hidden"].shape == (4, 10, 32) and a["hidden"].dtype == np.float16
    assert not all(np.array_equal(a["tokens"], data.batch_at(s, 4, 10, seed=3)["tokens"]) for s in range(8))
    # One epoch of steps visits every example once; every window holds response tokens.
    seen = []
    for step in range(2):
        batch = data.batch_at(step, 2, 10, seed=3)
        assert (batch["loss_mask"].sum(1) > 0).all()
        for row in range(2):
            n = batch["lengths"][row]
            assert (batch["tokens"][row, n:] == 0).all() and (batch["loss_mask"][row, n:] == 0).all()
            start = batch["positions"][row, 0]
            seen.append(next(e for e in range(4) if np.array_equal(
                data.tokens[data.offsets[e] + start: data.offsets[e] + start + n], batch["tokens"][row, :n])))
            a0 = data.offsets[seen[-1]] + start
            np.testing.assert_array_equal(batch["hidden"][row, :n], data.hidden[a0: a0 + n])
    assert sorted(seen) == [0, 1, 2, 3]
    assert HeadDataset(self_dir).batch_at(0, 2, 64)["hidden"].dtype == ml_dtypes.bfloat16


def test_split_and_eval_batches(fixed_dir):
    data = HeadDataset(fixed_dir)
    train, val = data.split(0.25)
    assert len(val) >= 1 and sorted(np.concatenate([train, val]).tolist()) == [0, 1, 2, 3]
    t2, v2 = data.split(0.25)
    np.testing.assert_array_equal(train, t2)
    np.testing.assert_array_equal(val, v2)
    assert len(data.split(0.0)[1]) == 0
    batches = list(data.eval_batches(12, 3, train))
    assert len(batches) == -(-len(train) // 3)
    assert all(b["tokens"].shape == (3, 12) for b in batches)
    lengths = np.concatenate([b["lengths"] for b in batches])
    assert (lengths[: len(train)] == np.minimum(data.lengths[train], 12)).all() and (lengths[len(train):] == 0).all()
    # A long example's fixed window ends at its last response token (the end of the example).
    [long] = [b for b in data.eval_batches(12, 1, [1])]
    np.testing.assert_array_equal(long["tokens"][0], data.tokens[data.offsets[2] - 12: data.offsets[2]])
    assert list(data.eval_batches(12, 2, [])) == []


def test_dataset_checks_base_and_vocab(fixed_dir, model, tmp_path):
    data = HeadDataset(fixed_dir)
    data.check_base(model)
    data.check_vocab(model.cfg.vocab_size)
    with pytest.raises(CloverError, match="another base model"):
        data.check_base(load_pretrained(save_tiny_llama(tmp_path / "other", model.cfg.vocab_size + 1))[1])
    with pytest.raises(CloverError, match="vocabulary"):
        data.check_vocab(model.cfg.vocab_size - 1)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("case", ["no meta", "ids over vocab", "empty"])
def test_damaged_dataset_is_refused(case, fixed_dir, tmp_path):
    d = _copy(fixed_dir, tmp_path / "d")
    meta = json.loads((d / "meta.json").read_text())
    if case == "no meta":
        (d / "meta.json").unlink()
        needle = "not a dataset made by train.make_data (no meta.json)"
    elif case == "ids over vocab":
        tokens = np.load(d / "tokens.npy")
        tokens[3] = meta["vocab_size"]
        np.save(d / "tokens.npy", tokens)
        needle = f"token id {meta['vocab_size']} is outside the vocabulary"
    else:
        np.save(d / "offsets.npy", np.zeros(1, np.int64))
        needle = "empty dataset"
    with pytest.raises(CloverError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        HeadDataset(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["empty file", "no response", "prompt too long", "max-len over context",
                                  "ids over vocab", "foreign out", "out is a file",
                                  "no chunks at once", "bad buckets"])
def test_bad_input_is_one_error_line(case, model_dir, prompts_file, hf_tok, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--base", model_dir, "--out", out]
    if case == "empty file":
        (tmp_path / "e.jsonl").write_text("\n")
        argv, needle = args + ["--prompts", tmp_path / "e.jsonl"], "no prompts in the file"
    elif case == "no response":
        (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
        argv, needle = args + ["--prompts", tmp_path / "p.jsonl", "--mode", "fixed"], "p.jsonl:1: no response"
    elif case == "prompt too long":
        (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def add(a, b): " * 20}) + "\n")
        argv, needle = args + ["--prompts", tmp_path / "p.jsonl", "--max-len", 16], "leaving no room"
    elif case == "max-len over context":
        argv, needle = args + ["--prompts", prompts_file, "--max-len", 65], "--max-len 65 must be in [2, 64]"
    elif case == "ids over vocab":
        small = tmp_path / "small"
        small.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (small / name).write_bytes((model_dir / name).read_bytes())
        save_tiny_llama(small, 258)  # the tokenizer's merges have ids >= 258
        argv, needle = ["--base", small, "--out", out, "--prompts", prompts_file], "outside the model's vocabulary"
    elif case == "no chunks at once":
        argv, needle = args + ["--prompts", prompts_file, "--chunks-at-once", 0], "--chunks-at-once 0 must be >= 1"
    elif case == "bad buckets":
        argv, needle = args + ["--prompts", prompts_file, "--buckets", "512,0"], "--buckets '512,0': give one or more"
    elif case == "foreign out":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        argv, needle = args + ["--prompts", prompts_file], "notes.txt, which is not part of a dataset"
    else:
        out.write_text("mine")
        argv, needle = args + ["--prompts", prompts_file], f"--out: cannot create the folder {out}: {out} is a file"
    code, stdout, err = run(capsys, *argv)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    if case == "out is a file":
        assert out.read_text() == "mine"
    elif case != "foreign out":
        assert not (out / "meta.json").exists()


def test_rerun_replaces_an_old_dataset(model_dir, prompts_file, fixed_dir, tmp_path, capsys):
    d = _copy(fixed_dir, tmp_path / "d")
    code, _, _ = run(capsys, "--base", model_dir, "--prompts", prompts_file, "--out", d, "--mode", "fixed",
                     "--limit", 2)
    assert code == 0
    assert not (d / "hidden.npy").exists()  # the old dataset's hidden states do not outlive it
    assert len(HeadDataset(d)) == 2 and HeadDataset(d).hidden is None


def test_a_killed_hidden_state_pass_resumes_where_it_recorded(model_dir, prompts_file, tmp_path, capsys,
                                                               monkeypatch):
    """The hidden states fill *.partial files in place, recording the batches done; a run killed in that
    pass and run again goes on from the record, computing only the batches after it, and writes what an
    uninterrupted run writes. A changed setting starts over."""
    common = ["--base", model_dir, "--prompts", prompts_file, "--mode", "fixed", "--max-len", "24",
              "--batch-size", "1", "--store-hidden", "float16", "--store-features"]
    assert run(capsys, *common, "--out", tmp_path / "whole")[0] == 0
    real, calls = hidden_states._last_hidden, []

    def killed_at(n):
        def forward(*a, **k):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*a, **k)
        return forward

    monkeypatch.setattr(hidden_states, "SAVE_EVERY_S", 0.0)  # record after every batch
    monkeypatch.setattr(hidden_states, "_last_hidden", killed_at(3))
    out = tmp_path / "d"
    assert run(capsys, *common, "--out", out)[0] == cli.INTERRUPTED
    assert json.loads((out / "hidden-progress.json").read_text())["done"] == 2
    assert {"hidden.npy.partial", "features.npy.partial"} <= {p.name for p in out.iterdir()}
    assert not (out / "meta.json").exists() and not (out / "hidden.npy").exists()

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(hidden_states, "_last_hidden", counted)
    calls.clear()
    code, _, err = run(capsys, *common, "--out", out)
    assert code == 0 and "resuming the hidden states after batch 2" in err
    assert len(calls) == len(RECORDS) - 2  # the two recorded batches were not computed again
    assert sorted(p.name for p in out.iterdir()) == ["features.npy", "hidden.npy", "loss_mask.npy", "meta.json",
                                                    "offsets.npy", "tokens.npy"]
    for name in ("hidden.npy", "features.npy", "tokens.npy"):
        np.testing.assert_array_equal(np.load(out / name), np.load(tmp_path / "whole" / name))
    # A killed run with other settings (batch size 2) does not take that record's arrays.
    monkeypatch.setattr(hidden_states, "_last_hidden", killed_at(2))
    calls.clear()
    assert run(capsys, *common, "--batch-size", "2", "--out", out)[0] == cli.INTERRUPTED
    monkeypatch.setattr(hidden_states, "_last_hidden", counted)
    calls.clear()
    code, _, err = run(capsys, *common, "--out", out)
    assert code == 0 and "resuming" not in err and len(calls) == len(RECORDS)
    np.testing.assert_array_equal(np.load(out / "hidden.npy"), np.load(tmp_path / "whole" / "hidden.npy"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_partial_hidden_arrays_reopen_as_written(dtype, tmp_path):
    """A recorded pass's arrays come back with their dtype and values (bfloat16 is stored as raw 2-byte
    records, and must be viewed as bfloat16 again), and the batches it recorded; another key gets new ones."""
    dt = make_data.HIDDEN_DTYPES[dtype]
    (hidden, features), done = hidden_states.open_partial(tmp_path, "k", [(5, 4), (5, 3, 4)], dt)
    assert done == 0
    hidden[:2], features[:2] = 1.5, -2.0
    hidden.flush(), features.flush()
    (tmp_path / "hidden-progress.json").write_text(json.dumps({"key": "k", "done": 1}))
    del hidden, features
    (hidden, features), done = hidden_states.open_partial(tmp_path, "k", [(5, 4), (5, 3, 4)], dt)
    assert done == 1 and hidden.dtype == features.dtype == dt
    assert np.all(hidden[:2].astype(np.float32) == 1.5) and np.all(features[:2].astype(np.float32) == -2.0)
    del hidden, features
    (hidden, _), done = hidden_states.open_partial(tmp_path, "other", [(5, 4), (5, 3, 4)], dt)
    assert done == 0 and not (tmp_path / "hidden-progress.json").exists() and np.all(hidden.astype(np.float32) == 0)


def test_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit):
        make_data.main(["--help"])
    assert "--store-hidden" in capsys.readouterr().out
    assert all(a.help for a in make_data.build_parser()._actions)


def test_answers_are_kept_per_chunk_and_a_rerun_resumes(model_dir, prompts_file, tmp_path, capsys):
    """--answers: each chunk's examples land in a shard as it finishes; a rerun answers only the chunks
    whose shard is missing (as after a kill) and makes the same dataset; greedy, it is the dataset a run
    without --answers makes, with chunks answered one or three at a time."""
    common = ["--base", model_dir, "--prompts", prompts_file, f"--max-new-tokens={NEW}", "--batch-size=2", "--chat"]
    assert run(capsys, *common, "--out", tmp_path / "plain")[0] == 0
    answers = tmp_path / "answers"
    code, _, err = run(capsys, *common, "--out", tmp_path / "d1", "--answers", answers, "--chunk=3")
    assert code == 0 and "chunk 2/2" in err
    assert sorted(p.name for p in answers.iterdir()) == ["answers-000000.jsonl.gz", "answers-000003.jsonl.gz",
                                                         "answers.json"]
    assert _examples(tmp_path / "d1") == _examples(tmp_path / "plain")
    (answers / "answers-000003.jsonl.gz").unlink()
    code, _, err = run(capsys, *common, "--out", tmp_path / "d2", "--answers", answers, "--chunk=3")
    assert code == 0 and "1 of 2 chunks answered already" in err and "chunk 1/1: records 3..5" in err
    assert _examples(tmp_path / "d2") == _examples(tmp_path / "d1")
    code, _, err = run(capsys, *common, "--out", tmp_path / "d3", "--answers", answers, "--chunk=3",
                       "--temperature=0.5")
    assert code == 2 and "made with temperature=0.0, this run asks temperature=0.5" in err
    # Chunks answered three at a time: one shard each, the same greedy answers.
    together = tmp_path / "together"
    code, _, err = run(capsys, *common, "--out", tmp_path / "d5", "--answers", together, "--chunk=1",
                       "--chunks-at-once=3")
    assert code == 0 and "chunk 1-3/4: records 0..0, 1..1, 2..2" in err and "chunk 4/4: records 3..3" in err
    assert sorted(p.name for p in together.iterdir()) == [f"answers-00000{i}.jsonl.gz" for i in range(4)] + [
        "answers.json"]
    assert _examples(tmp_path / "d5") == _examples(tmp_path / "plain")
    (answers / "answers-000000.jsonl.gz").write_bytes(b"\x1f\x8b damaged")
    code, _, err = run(capsys, *common, "--out", tmp_path / "d4", "--answers", answers, "--chunk=3")
    assert code == 2 and "a damaged answer shard" in err and err.count("\n") == 1


def test_skip_leaves_out_unusable_records_and_counts_them(model_dir, tmp_path, capsys):
    records = RECORDS[:2] + [{"conversations": []}, {"prompt": "x = 1 " * 200}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["--base", model_dir, "--prompts", path, "--max-new-tokens=2", "--max-len=64"]
    code, _, err = run(capsys, *common, "--out", tmp_path / "refused")
    assert code == 2 and "no prompt found" in err
    code, _, err = run(capsys, *common, "--out", tmp_path / "d", "--skip")
    assert code == 0 and "skipped 2 records" in err
    assert len(_examples(tmp_path / "d")) == 2


def test_merged_datasets_keep_their_examples_and_the_first_ones_held_out_split(model_dir, prompts_file,
                                                                               fixed_dir, self_dir, tmp_path, capsys):
    """`--first` and `--limit` cut the file in two; merge_data joins the parts back into the whole (hidden
    states included), the first part's examples keeping their indices and so their held-out split."""
    parts = []
    for name, cut in (("a", ["--limit", 2]), ("b", ["--first", 2])):
        parts.append(tmp_path / name)
        code, _, err = run(capsys, "--base", model_dir, "--prompts", prompts_file, "--out", parts[-1], "--mode", "fixed",
                           "--max-len", 24, "--store-hidden", "float16", *cut)
        assert code == 0, err
    joined = tmp_path / "joined"
    assert merge_data.main([str(p) for p in parts] + ["--out", str(joined)]) == 0
    whole, merged, first = HeadDataset(fixed_dir), HeadDataset(joined), HeadDataset(parts[0])
    assert len(first) == 2 and len(merged) == len(whole) == 4
    for name in ("tokens", "offsets", "loss_mask"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(whole, name))
    # The join copies each part's hidden states; the parts' own prefills ran in other batch shapes than
    # the whole file's, which may move a float16 value by its last bit on some CPUs.
    np.testing.assert_array_equal(merged.hidden, np.concatenate([HeadDataset(p).hidden for p in parts]))
    np.testing.assert_allclose(merged.hidden.astype(np.float32), whole.hidden.astype(np.float32), rtol=2e-3, atol=1e-5)
    assert merged.meta["mode"] == "merged" and [p["first"] for p in merged.meta["parts"]] == [0, 2]
    held = set(first.split(0.6)[1].tolist())
    assert held and held == {i for i in merged.split(0.6)[1].tolist() if i < len(first)}
    # Parts stored differently, or --out one of the parts: one line, nothing written.
    capsys.readouterr()
    for argv, needle in (([fixed_dir, self_dir], "differ in hidden_dtype"), ([fixed_dir, parts[0]], "")):
        out = parts[0] if not needle else tmp_path / "bad"
        code = merge_data.main([str(p) for p in argv] + ["--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and (needle or "is one of the datasets") in err, err
    assert not (tmp_path / "bad").exists() and HeadDataset(parts[0]).num_examples == 2
