"""The tools and the notebooks come in by the front door: every import of the library in infer/*.py,
train/*.py and the code cells of notebooks/*.ipynb (inside function bodies too) reaches `clover_jax` itself,
whose re-exported names are the public API, `clover_jax.training` (what training a drafter needs besides), or
a module listed below with the reason it may be reached."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Modules anyone may import, and why.
PUBLIC = {
    "clover_jax": "the front door: `load`, `Model.generator` and the names it re-exports (its docstring lists them)",
    "clover_jax.api": "where the front door's names are defined",
    "clover_jax.training": "the training interface: drafters, losses, heads on disk, what a step needs",
    "clover_jax.errors": "CloverError, importable without JAX (the tools' argument parsing raises it)",
    "clover_jax.io.sources": "where a model or drafter argument's files are: a directory, a Hub id, a named model",
    "clover_jax.io.tokenization": "text in and out: the tokenizer, the chat template, the EOS ids",
    "clover_jax.model.sharding": "the mesh and the one rule table placing every array on it",
}

# The public namespaces: each re-exports its names lazily, in an `_EXPORTS` table.
NAMESPACES = ("clover_jax", "clover_jax.training")

# The command-line tools' own helper package: flags, prompt files, exit codes (private to the tools).
TOOLS_ONLY = {"clover_jax._cli"}
TOOLS = ("infer/", "train/")

# Internals a file reaches on purpose, where it measures or writes what the public names hide.
REACHES = {
    "infer/bandwidth.py": {"clover_jax.engine.decode": "times a plain step's prefill and loop apart (start_plain)"},
    "infer/benchmark.py": {"clover_jax.model.divergence": "finds where a row's text parted from plain decoding's",
                           "clover_jax.drafters.vocab": "checks each --draft-vocab value before anything loads",
                           "clover_jax.engine.decode": "measures per prompt-length bucket (bucket_for)"},
    "infer/convert_pickle.py": {"clover_jax.io.files": "writes the converted weights atomically, space checked",
                                "clover_jax.io.formats.weights": "the cache path the loader finds a conversion at",
                                "clover_jax.io.hf": "writes safetensors as the loader reads them"},
    "infer/generate.py": {"clover_jax.drafters": "--num-heads' help lists the draft heads (HEADS)...",
                          "clover_jax.drafters.registry": "... and each one's default depth"},
    "infer/fitting.py": {"clover_jax.trees.fit": "fits a tree to a run's accepted paths"},
    "infer/pacing_cost.py": {"clover_jax.engine.pacing": "times a paced loop's flush (Paced.flush) on its own",
                             "clover_jax.io.files": "writes the JSON atomically"},
    "infer/loop_flags.py": {"clover_jax.engine.chunks": "checks --loop-chunk as the engine will"},
    "infer/report.py": {"clover_jax.io.files": "writes the JSON and the plot atomically",
                        "clover_jax.plan.step_cost": "names the CPU the step costs were timed on"},
    "infer/results.py": {"clover_jax.io.files": "rewrites docs/results.md atomically"},
    "infer/shapes.py": {"clover_jax.drafters.vocab": "a draft vocabulary of N tokens for random heads"},
    "notebooks/03_llama3_8b_tpu.ipynb": {"clover_jax.model.cache": "the KV cache's axes, for per-device memory"},
    # The training tools write their outputs as infer/'s do, whole or not at all, with a full disk said in one
    # line: `clover_jax.io.files` is that machinery, not the training interface.
    "train/answers.py": {"clover_jax.io.files": "writes each answer shard and the store's settings atomically"},
    "train/corpus.py": {"clover_jax.io.files": "writes split.json and the token cache atomically"},
    "train/curves.py": {"clover_jax.io.files": "writes the table and the plot atomically"},
    "train/data.py": {"clover_jax.io.files": "builds a dataset folder aside and swaps it in whole, space checked"},
    "train/evaluate.py": {"clover_jax.io.files": "rewrites heads.json (--record) and the --json file atomically",
                          "clover_jax.trees.fit": "fits a tree to the heads' accepted paths (--fit-tree)"},
    "train/export.py": {"clover_jax.io.formats": "writes the heads in a published drafter's format (--format)"},
    "train/hidden_states.py": {"clover_jax.io.files": "preallocates the hidden states, records progress",
                               "clover_jax.engine.decode": "pads each batch to a prompt bucket (bucket_for)"},
    "train/make_data.py": {"clover_jax.io.files": "says a full disk in one line while the dataset is written",
                           "clover_jax.drafters.eagle3": "stores the base layers EAGLE-3 drafts from (eagle3_layers)"},
    "train/make_prompts.py": {"clover_jax.io.files": "writes the prompt file atomically"},
    "train/merge_data.py": {"clover_jax.io.files": "says a full disk in one line while the datasets are joined"},
    "train/pretrain.py": {"clover_jax.io.files": "copies the tokenizer and writes the run's files atomically"},
    "train/runs.py": {"clover_jax.io.files": "writes the run's pinned settings atomically"},
    "train/tokenizer.py": {"clover_jax.io.files": "writes the tokenizer's files atomically"},
    "train/train.py": {"clover_jax.io.files": "checks the heads' room first, hashes --init-from"},
}


def library_modules() -> set[str]:
    names = set()
    for path in (REPO / "clover_jax").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def sources() -> dict[str, str]:
    """{file, relative to the repository: its Python source} of infer/*.py, train/*.py and the notebooks'
    code cells (IPython's `!` and `%` lines left out)."""
    tools = [p for tool in TOOLS for p in sorted((REPO / tool).glob("*.py"))]
    out = {str(p.relative_to(REPO)): p.read_text() for p in tools}
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        lines = [line for cell in cells for line in cell.splitlines() if not line.lstrip().startswith(("!", "%"))]
        out[str(nb.relative_to(REPO))] = "\n".join(lines)
    return out


def library_imports(source: str, modules: set[str]) -> set[str]:
    """The library modules `source` imports anywhere in it (`from pkg import mod` is pkg.mod where that is a
    module, else pkg)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
    return {m for m in found if m == "clover_jax" or m.startswith("clover_jax.")}


def allowed(file: str, module: str) -> bool:
    if module in PUBLIC or module in REACHES.get(file, {}):
        return True
    return file.startswith(TOOLS) and any(module == m or module.startswith(m + ".") for m in TOOLS_ONLY)


def test_the_parser_sees_imports_inside_functions_and_submodules():
    modules = library_modules()
    code = "from clover_jax import _cli as cli, load\ndef f():\n    from clover_jax.io import sources\n"
    assert library_imports(code, modules) == {"clover_jax._cli", "clover_jax", "clover_jax.io.sources"}
    assert not allowed("notebooks/01_quickstart.ipynb", "clover_jax._cli.prompts")
    assert allowed("infer/generate.py", "clover_jax._cli.stream")
    assert allowed("train/make_data.py", "clover_jax._cli.conversation")
    assert not allowed("train/train.py", "clover_jax.drafters.registry")  # clover_jax.training names it
    assert not allowed("train/losses.py", "clover_jax.io.files")  # listed for other files, not this one


@pytest.mark.parametrize("file", sorted(sources()))
def test_the_file_comes_in_by_the_front_door(file):
    modules = library_modules()
    reached = sorted(m for m in library_imports(sources()[file], modules) if not allowed(file, m))
    assert not reached, f"{file} imports {', '.join(reached)}: use a name `clover_jax` re-exports, or list it here"


def test_every_listed_reach_is_still_used():
    """A reason left behind once a file no longer needs the module would widen the door for nothing."""
    modules = library_modules()
    found = sources()
    for file, reaches in REACHES.items():
        assert set(reaches) <= library_imports(found[file], modules), file
    assert set(PUBLIC) <= modules


def test_the_training_tools_are_checked():
    assert {"train/train.py", "train/make_data.py", "train/evaluate.py"} <= set(sources())


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_exported_name_resolves_to_where_the_table_says(namespace):
    module = importlib.import_module(namespace)
    assert namespace in PUBLIC and module.__all__ == list(module._EXPORTS)
    for name, source in module._EXPORTS.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), f"{namespace}.{name}"
    assert not hasattr(module, "not_a_name")  # an unknown name is an AttributeError, not a KeyError


def test_the_training_interface_adds_to_the_front_door_and_imports_no_jax():
    """A name `clover_jax` has is imported from there, not twice; like `clover_jax`, importing the training
    namespace imports nothing heavy until a name is used."""
    import clover_jax
    import clover_jax.training

    assert not set(clover_jax.training.__all__) & set(clover_jax.__all__)
    code = "import sys, clover_jax.training; assert 'jax' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
