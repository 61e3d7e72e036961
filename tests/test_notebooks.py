"""The notebooks run top to bottom on CPU (nbclient, a fresh Python kernel), as a user would run them."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["01_quickstart.ipynb"])
def test_notebook_runs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "tokens per base-model pass" in outputs
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
