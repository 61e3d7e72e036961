"""docs/adding-a-method.md's worked example runs as written: its Hydra heads, taken from the page's code
blocks into a module of their own, register themselves on import and then train (`train.train`),
measure (`train.evaluate`) and decode through `clover_jax.load(...).generator(...)` with no other edit,
greedy output equal to plain decoding's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import clover_jax
from clover_jax.drafters import registry
from test_train import _argv
from train import evaluate, train

PAGE = Path(__file__).parent.parent / "docs" / "adding-a-method.md"
PROMPT = "def add(a, b):"


def heads_section_code() -> str:
    """The Python blocks of the page's heads section (the Hydra example), in page order."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Heads:"):text.index("## A draft model:")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 2, "the heads section lost its worked example"
    return "\n".join(blocks)


@pytest.fixture
def hydra(tmp_path):
    """The example's module imported (so registered as "hydra"); unregistered afterwards, so the other
    tests of this worker see the built-in methods only."""
    path = tmp_path / "hydra.py"
    path.write_text(heads_section_code(), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("hydra_example", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    yield registry.get("hydra")
    registry._REGISTRY.pop("hydra", None)


def test_the_worked_example_trains_evaluates_and_decodes_with_no_other_edit(hydra, model_dir, datasets,
                                                                            tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    assert train.main(_argv(model_dir, datasets["plain"], out, work, "hydra")) == 0, capsys.readouterr().err
    assert evaluate.main(["--heads", str(out), "--base", str(model_dir), "--data", str(datasets["plain"]), "--split", "all"]) == 0
    assert "chain tau" in capsys.readouterr().out
    model = clover_jax.load(model_dir)
    plain = model.generator().generate([PROMPT], 12).texts
    for tree in ("chain:2", "default"):
        drafted = model.generator("hydra", heads=out, tree=tree)
        assert drafted.speculative
        assert drafted.generate([PROMPT], 12).texts == plain
