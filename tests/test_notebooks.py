"""The notebooks run top to bottom on CPU (nbclient, a fresh Python kernel), as a user would run them.

The kernel inherits this process's environment, which is how the tests shorten the notebooks'
settings (`CLOVER_NB_*`) and how 03 gets a tiny local Llama checkpoint and ShareGPT sample in place
of the Hub's, and two virtual CPU devices to shard over.
"""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import tiny_llama_checkpoint

pytestmark = [pytest.mark.optimized,  # its time goes into running programs, not compiling them
              pytest.mark.slow]  # each notebook runs end to end

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def execute(name: str, monkeypatch, **env) -> tuple[nbformat.NotebookNode, str]:
    """Run a notebook with `env` set (and no other CLOVER_NB_* variable); (the executed notebook, everything
    its cells printed)."""
    for key in [k for k in os.environ if k.startswith("CLOVER_NB_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    return nb, "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")


def images(nb) -> int:
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return sum("image/png" in o.get("data", {}) for o in outputs)


def test_quickstart_runs(monkeypatch):
    _, printed = execute("01_quickstart.ipynb", monkeypatch)
    assert "tokens per base-model pass" in printed
    assert re.search(r"\[64 tokens streamed over \d+ base-model passes\]", printed)


def test_training_notebook_trains_heads_that_beat_fresh_ones(monkeypatch, tmp_path):
    nb, printed = execute("02_train_clover2.ipynb", monkeypatch, CLOVER_NB_WORK=tmp_path, CLOVER_NB_PROMPTS=16,
                          CLOVER_NB_NEW_TOKENS=32, CLOVER_NB_STEPS=20, CLOVER_NB_EVAL_PROMPTS=4)
    assert "wrote 16 examples" in printed
    first, last = map(float, re.search(r"loss ([\d.]+) at step 10 -> ([\d.]+) at step 20", printed).groups())
    assert last < first
    tau = {k: float(v) for k, v in re.findall(r"(fresh|trained here|shipped) ([\d.]+)", printed.split("tau: ")[-1])}
    assert tau["fresh"] < 1.2  # untrained heads: almost every draft rejected
    assert tau["trained here"] > tau["fresh"] + 0.3
    assert tau["shipped"] > tau["trained here"]  # 2,400 steps on 6,000 prompts
    assert images(nb) == 2  # loss and accuracy; tau and acceptance per depth


def _table_rows(markdown: str) -> list[str]:
    """The rows of the per-device memory table (header and separator excluded)."""
    return [line for line in markdown.splitlines() if re.match(r"\| (TPU|8 x)", line)]


def authors_eagle3(model, out):
    """A random EAGLE-3 drafter for `model` laid out as the EAGLE authors publish theirs: config.json with
    architectures LlamaForCausalLM and draft_vocab_size, the weights a pickle (pytorch_model.bin). Its
    feature layers are the first layer's (a two-layer model has no authors' middle and high ones)."""
    import torch
    from safetensors.torch import load_file

    from clover_jax.drafters.heads import make_heads
    from clover_jax.drafters.registry import drafter_config
    from clover_jax.io import formats
    from clover_jax.io.hf import load_pretrained

    base = load_pretrained(model)[1]
    drafter = make_heads(drafter_config("eagle3", 3, draft_vocab=64, aux_layer_ids=(0, 0, 0)), base, seed=1)
    formats.exporter("sglang").export(drafter, base, out)
    torch.save(load_file(str(out / "model.safetensors")), out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    return out


def test_llama3_notebook_on_a_tiny_local_checkpoint(monkeypatch, tmp_path):
    model = tiny_llama_checkpoint(tmp_path / "tiny-chat-llama", max_position_embeddings=128)
    eagle3 = authors_eagle3(model, tmp_path / "eagle3")
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path / "cache"))  # the converted pickle lands there
    turn = lambda who, text: {"from": who, "value": text}
    prompts = ["def add(a, b):", "class Point:", "import os", "for i in range(10):", "print(i)",
               "def add(x, y):", "class Line:", "import sys", "return a + b", "os.getcwd()"]
    records = [{"id": str(i), "conversations": [turn("human", p), turn("gpt", "fine")]} for i, p in enumerate(prompts)]
    records[3:3] = [{"id": "gpt first", "conversations": [turn("gpt", "hello")]},  # no human turn: left out
                    {"id": "long", "conversations": [turn("human", "x = 1; " * 60), turn("gpt", "ok")]}]  # too long
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(records))
    work = tmp_path / "work"
    work.mkdir()
    nb, printed = execute(
        "03_llama3_8b_tpu.ipynb", monkeypatch, XLA_FLAGS="--xla_force_host_platform_device_count=2",
        CLOVER_NB_MODEL=model, CLOVER_NB_SHAREGPT=sharegpt, CLOVER_NB_WORK=work, CLOVER_NB_SAMPLE=8, CLOVER_NB_EVAL=2,
        CLOVER_NB_PROMPT_TOKENS=48, CLOVER_NB_NEW_TOKENS=16, CLOVER_NB_STEPS=4, CLOVER_NB_BATCH=4,
        CLOVER_NB_SEQ_LEN=64, CLOVER_NB_DTYPE="float32",
        CLOVER_NB_QUESTION="print(i)",  # as short as the held-out prompts: one length bucket, compiled once
        CLOVER_NB_EAGLE3=eagle3, CLOVER_NB_EAGLE3_BASE=model, CLOVER_NB_EAGLE3_TREE="eagle2:12,3,3")

    # The paper figures printed from the parameter shapes are docs/generate.md's and the notebook's own table.
    generate_doc = (REPO / "docs" / "generate.md").read_text()
    tables = _table_rows(generate_doc.split("### Llama-3-8B-Instruct with Clover-2")[1]) + \
        _table_rows("\n".join(c.source for c in nb.cells if c.cell_type == "markdown"))
    assert len(tables) == 10 and all(row in printed for row in tables), printed
    assert "skipped:" not in printed  # every cell did its work on the local model
    assert "no accelerator" in printed and f"local checkpoint {model}" in printed
    assert "8 prompts for training, 2 held out, 2 left out" in printed
    assert "wrote 8 examples" in printed
    first, last = map(float, re.search(r"held-out loss ([\d.]+) at step 1 -> ([\d.]+) at step 4", printed).groups())
    assert last < first
    assert (work / "heads" / "heads.json").is_file() and (work / "heads" / "token_counts.safetensors").is_file()
    assert re.search(r"drafting from (\d+|all) tokens", printed)
    assert re.search(r"parameters loaded in \d+s over mesh model=2: .* on each device, as worked out on paper", printed)
    assert printed.count("same text as plain decoding: True") == 2  # Clover-2, then the EAGLE-3 drafter
    assert "2/2 answers identical to plain decoding" in printed
    assert "pytorch_model.bin: converted into" in printed and f"EAGLE-3 {eagle3} (tree eagle2:12,3,3)" in printed
    assert images(nb) == 2  # training curves; acceptance per depth


def test_llama3_notebook_without_hub_model_or_accelerator_skips_each_cell_in_one_line(monkeypatch, tmp_path):
    nb, printed = execute("03_llama3_8b_tpu.ipynb", monkeypatch, CLOVER_NB_WORK=tmp_path)
    skips = [line for line in printed.splitlines() if line.startswith("skipped:")]
    # download, sample, data, training, load and plain chat, Clover-2 chat, speedup: one line each, same
    # reason; then the published EAGLE-3 drafter and its base model, one line of their own
    assert len(skips) == 8 and len(set(skips[:7])) == 1, skips
    assert "Llama-3-8B-Instruct is to come from the Hugging Face Hub and this runtime has no TPU or GPU" in skips[0]
    assert "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and meta-llama/Llama-3.1-8B-Instruct are to come from" in skips[7]
    assert "| TPU v5e-8 | `model=8` | 2.01 + 0.41 GB |" in printed  # the paper arithmetic needs neither
    assert not any(tmp_path.iterdir())
