"""The notebooks run top to bottom on CPU (nbclient, a fresh Python kernel), as a user would run them.

The kernel inherits this process's environment, which is how the tests shorten the notebooks'
settings (`CLOVER_NB_*`).
"""

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def execute(name: str, monkeypatch, **env) -> tuple[nbformat.NotebookNode, str]:
    """Run a notebook with `env` set; (the executed notebook, everything its cells printed)."""
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    return nb, "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_quickstart_runs(monkeypatch):
    _, printed = execute("01_quickstart.ipynb", monkeypatch)
    assert "tokens per base-model pass" in printed


def test_training_notebook_trains_heads_that_beat_fresh_ones(monkeypatch):
    nb, printed = execute("02_train_clover2.ipynb", monkeypatch, CLOVER_NB_PROMPTS=16, CLOVER_NB_NEW_TOKENS=32,
                          CLOVER_NB_STEPS=20, CLOVER_NB_EVAL_PROMPTS=4)
    assert "wrote 16 examples" in printed
    first, last = map(float, re.search(r"loss ([\d.]+) at step 10 -> ([\d.]+) at step 20", printed).groups())
    assert last < first
    tau = {k: float(v) for k, v in re.findall(r"(fresh|trained here|shipped) ([\d.]+)", printed.split("tau: ")[-1])}
    assert tau["fresh"] < 1.2  # untrained heads: almost every draft rejected
    assert tau["trained here"] > tau["fresh"] + 0.3
    assert tau["shipped"] > tau["trained here"]  # 900 steps on 1,200 prompts
    assert images(nb) == 2  # loss and accuracy; tau and acceptance per depth
