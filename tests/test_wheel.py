"""The project as a wheel: what `pip install .` (not editable) puts in site-packages. The shipped
reference model and heads travel as the package data clover_jax/shipped and `sources.shipped_root`
finds them there, away from any checkout; the core dependencies are what the library imports, the
extras what the tools import, and a missing extra is one error line naming it.
"""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from clover_jax._cli import extras as cli_extras
from clover_jax.io import sources
from infer import generate

from conftest import REFERENCE_SHIPS as BUILT_IN  # the methods the reference model ships heads for

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]
SHIPPED = "clover_jax/shipped"
MODELS = ("reference", "smollm2")  # what models/ ships heads for: the reference model and the named model


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the checkout (a build writes build/ and *.egg-info into the
    tree it builds, which is not this shared checkout's business), offline: no index, no isolation."""
    src = tmp_path_factory.mktemp("src")
    for name in ["pyproject.toml", "README.md", "models", *sorted({p.split(".")[0] for p in PACKAGES} - {"clover_jax"}),
                 "clover_jax"]:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, src / name)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "--disable-pip-version-check", "-w", str(out)],
                          capture_output=True, text=True, cwd=out)
    assert done.returncode == 0, done.stderr
    [built] = out.glob("clover_jax-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_models_and_heads_and_not_the_distillation_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "prompts.jsonl", "MODEL_CARD.md"]:
        assert f"{SHIPPED}/reference/{f}" in names, f
    for model in MODELS:
        for method in BUILT_IN:
            for f in ["heads.json", "heads.safetensors", "token_counts.safetensors"]:
                assert f"{SHIPPED}/{model}/heads/{method}/{f}" in names, (model, method, f)
    # Every file of the checkout's shipped folders, and nothing of either model's distillation data.
    repo_models = REPO / "models"
    shipped = [*(repo_models / "reference").rglob("*"), *(repo_models / "smollm2" / "heads").rglob("*"),
               repo_models / "smollm2" / "README.md", *(repo_models / "gemma3").glob("*"),
               *(repo_models / "gemma3" / "heads").rglob("*")]
    for f in shipped:
        if f.is_file():
            assert f"{SHIPPED}/{f.relative_to(repo_models).as_posix()}" in names, f
    assert (repo_models / "smollm2" / "distill").is_dir() and (repo_models / "gemma3" / "distill").is_dir()  # left out
    assert not [n for n in names if "distill" in n or n.startswith("models/")]


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_every_package(wheel):
    """pyproject.toml names its packages one by one (the shipped folder is mapped in among them): a new
    subpackage missing from that list would install without its modules."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for top in {p.split(".")[0] for p in PACKAGES}:
        for module in (REPO / top).rglob("*.py"):
            assert module.relative_to(REPO).as_posix() in names, module


@pytest.mark.slow
def test_an_unpacked_wheel_finds_its_shipped_files_from_any_folder(wheel, tmp_path):
    site = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = ("import clover_jax\n"
              "from clover_jax.io import sources\n"
              "print(clover_jax.__file__)\n"
              "print(sources.shipped_root())\n"
              "print(sources.model_dir(None) / 'model.safetensors')\n"
              "print(sources.heads_root(None, sources.model_dir(None)) / 'clover2' / 'heads.safetensors')\n"
              "print(sources.heads_root('smollm2', None) / 'eagle3' / 'heads.safetensors')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert done.returncode == 0, done.stderr
    package, root, *files = map(Path, done.stdout.split())
    assert package == site / "clover_jax" / "__init__.py"  # the unpacked wheel's, not this checkout's
    assert root == site / "clover_jax" / "shipped"
    for f in files:
        assert f.is_file() and f.is_relative_to(root), f


def test_a_checkout_finds_its_own_models_folder():
    assert sources.shipped_root() == REPO / "models"
    assert sources.DEFAULT_MODEL_DIR == REPO / "models" / "reference"
    assert sources.shipped_dir("smollm2") == REPO / "models" / "smollm2"


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(reqs: list[str]) -> set[str]:
    """Distribution names of pyproject requirements, this project's own extras expanded."""
    names = set()
    for req in reqs:
        name, extras = re.match(r"([A-Za-z0-9._-]+)(?:\[([^\]]+)\])?", req).groups()
        if _dist(name) == "clover-jax":
            for extra in extras.split(","):
                names |= _requirements(PYPROJECT["project"]["optional-dependencies"][extra.strip()])
        else:
            names.add(_dist(name))
    return names


CORE = _requirements(PYPROJECT["project"]["dependencies"])
EXTRA = {extra: CORE | _requirements(reqs) for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()}
_INSTALLED = importlib.metadata.packages_distributions()


def dists_of(module: str) -> set[str]:
    """The distributions that install the top-level `module` (its own name, where none is installed)."""
    return {_dist(d) for d in _INSTALLED.get(module.split(".")[0], [module.split(".")[0]])}


def third_party_imports(top: str) -> list[tuple[str, str, str | None]]:
    """(module imported, file, the function it is imported in or None at module level) for every import
    of a module outside the standard library and this project, anywhere in package `top`."""
    ours = {p.split(".")[0] for p in PACKAGES}
    found = []
    for path in sorted((REPO / top).rglob("*.py")):
        tree = ast.parse(path.read_text())
        scopes = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    scopes.setdefault(id(inner), node.name)  # the outermost function holding it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                first = module.split(".")[0]
                if first not in sys.stdlib_module_names and first not in ours:
                    found.append((module, path.relative_to(REPO).as_posix(), scopes.get(id(node))))
    return found


def test_the_library_imports_only_its_core_dependencies_and_gguf_behind_one_error_line():
    # clover_jax/_cli is the tools' shared code, private to them: the tools' extra covers it (below).
    beyond = [(m, f, fn) for m, f, fn in third_party_imports("clover_jax")
              if not dists_of(m) & CORE and not f.startswith("clover_jax/_cli/")]
    assert {(m.split(".")[0], f, fn) for m, f, fn in beyond} == {("gguf", "clover_jax/io/gguf.py", "_gguf")}, beyond
    assert dists_of("gguf") <= EXTRA["tools"]


@pytest.mark.parametrize("top,extra", [("clover_jax/_cli", "tools"), ("infer", "tools"), ("train", "train")])
def test_each_tool_package_imports_what_its_extra_installs(top, extra):
    # torch is only --hf's reference in infer.benchmark, which names it when it is missing.
    allowed = EXTRA[extra] | {"torch"}
    imported = {m.split(".")[0] for m, _, _ in third_party_imports(top)}
    assert {m for m in imported if not dists_of(m) & allowed} == set()
    # What a tool package checks at import is its extra, all of it and nothing else.
    if top != "clover_jax/_cli":
        checked = set().union(*map(dists_of, cli_extras.EXTRAS[extra]))
        assert checked == EXTRA[extra] - CORE, (checked, EXTRA[extra] - CORE)


def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(cli_extras.EXTRAS, "tools", ("tqdm", "no_such_package_xyz"))
    with pytest.raises(SystemExit) as exit_:
        cli_extras.require("tools", "infer")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "no_such_package_xyz" in err and 'pip install "clover-jax[tools]"' in err and "tqdm" not in err


def test_a_gguf_file_without_the_gguf_package_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` meets where it is not installed
    (tmp_path / "model.gguf").write_bytes(b"GGUF not really")
    code = generate.main(["--model", str(tmp_path / "model.gguf"), "--prompt", "x"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: ") and 'pip install "clover-jax[tools]"' in err, err
