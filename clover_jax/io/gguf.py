"""GGUF files (llama.cpp's format) turned into Hugging Face checkpoint directories.

A `.gguf` file holds a model's weights, often quantized, with its config and tokenizer as metadata.
`gguf_checkpoint` converts one once into a directory the ordinary loader reads (config.json,
float32 model.safetensors, tokenizer files with the chat template), kept in a cache keyed by the
file's sha256, so a second run only loads. Weights are dequantized by the `gguf` package's own numpy
code (every type it knows: F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants and more); the tokenizer is
rebuilt from the metadata by `transformers`' GGUF tokenizer converter. Neither needs torch.

llama.cpp stores a Llama's q and k projection rows permuted for its rotary kernel (pairs of
interleaved dimensions instead of two halves); that permutation is undone here, as `transformers`
does, or the model's attention would be silently wrong. Qwen2 files are stored unpermuted. Gemma 3
files (`gemma3_text` checkpoints: their norms stored as 1 + w, and what their metadata leaves out)
are read by `gguf_gemma3`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import numpy as np

from clover_jax.model.config import ModelConfig
from clover_jax.errors import CloverError
from clover_jax.io import gguf_gemma3
from clover_jax.io.files import sha256, write_text

# GGUF architecture -> Hugging Face model_type. Mistral files say "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": gguf_gemma3.MODEL_TYPE}
# Our (HF) tensor names per GGUF tensor name, with {i} the layer.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
# Llama 3.1/3.2 files keep their rope scaling as a tensor of per-frequency divisors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"
_LLAMA3_ROPE = (1.0, 4.0, 8192)  # low_freq_factor, high_freq_factor, original context of every Llama-3 release


def _gguf():
    """The `gguf` package, which only converting a GGUF file needs (a converted one is read from the
    cache without it), so the core install leaves it to the tools extra: its absence is one error line."""
    try:
        import gguf
        import gguf.quants
    except ImportError:
        raise CloverError('reading a .gguf file (or a named model: smollm2, gemma3) needs the gguf package: '
                          'pip install "clover-jax[tools]" (in a checkout: pip install -e ".[tools]")') from None
    return gguf


def _reader(path: Path):
    """A `gguf.GGUFReader` over the file, or one error line for a file that is not a whole GGUF."""
    reader = _gguf().GGUFReader
    try:
        return reader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, struct.error, IndexError, ... on bad files
        if "GGMLQuantizationType" in str(e):
            raise CloverError(f"{path}: holds a tensor of a type the installed gguf package does not know ({e}); "
                              "upgrade it (pip install -U gguf) or convert the file to F16 or Q8_0") from None
        raise CloverError(f"{path}: not a readable GGUF file ({e.__class__.__name__}: {e}); it may be truncated: "
                          "download it again") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _required(reader, path: Path, key: str):
    value = _field(reader, key)
    if value is None:
        raise CloverError(f"{path}: GGUF metadata {key} is missing; the file is not a complete model")
    return value


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (0, 1), (2, 3), ... are rotary pairs there; HF's
    rotate-half layout keeps a pair's two halves H/2 rows apart. w [heads * H, ...] (weight or bias)."""
    h2 = w.shape[0] // heads // 2
    return w.reshape(heads, h2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(reader, path: Path) -> dict:
    """A Hugging Face config.json for the model the GGUF metadata describes; anything our Llama-family
    decoder cannot run is refused in one line. A Gemma 3 file's is complete (`gguf_gemma3.config`)."""
    arch = str(_required(reader, path, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise CloverError(f"{path}: GGUF architecture {arch!r} is not supported; clover-jax runs "
                          f"{', '.join(ARCHITECTURES)} files (Llama, Mistral, Qwen2, Gemma 3)")
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)
    need = lambda key: _required(reader, path, f"{arch}.{key}")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none") and arch != "gemma3":
        raise CloverError(f"{path}: GGUF rope scaling {scaling!r} is not supported (supported: none, and Llama 3's)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    cfg = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": int(get("vocab_size") or (len(tokens) if tokens is not None else need("vocab_size"))),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        return gguf_gemma3.config(get, cfg, _field(reader, "tokenizer.ggml.padding_token_id"), path)
    if _ROPE_FREQS in names:
        cfg["rope_scaling"] = _llama3_rope(reader, path, cfg)
    return cfg


def _llama3_rope(reader, path: Path, cfg: dict) -> dict:
    """Llama 3's rope scaling, recovered from a file's `rope_freqs` divisors: its factor is their
    largest, and the divisors must then be exactly what that scaling gives, or the file is refused."""
    from clover_jax.model.config import rope_inv_freq

    tensor = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
    divisors = np.asarray(tensor.data, np.float32).reshape(-1)
    low, high, orig = _LLAMA3_ROPE
    rope = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}
    scaled = ModelConfig.from_hf_dict({**cfg, "rope_scaling": rope})
    plain = ModelConfig.from_hf_dict(cfg)
    if not np.allclose(rope_inv_freq(plain) / rope_inv_freq(scaled), divisors, rtol=1e-4):
        raise CloverError(f"{path}: its rope_freqs tensor is not Llama 3's rope scaling; this rope is not supported")
    return rope


def hf_tensors(reader, path: Path, cfg: dict) -> dict[str, np.ndarray]:
    """Every weight as a float32 array under its Hugging Face name, dequantized and in HF's layout."""
    gguf = _gguf()
    GGMLQuantizationType, dequantize = gguf.GGMLQuantizationType, gguf.quants.dequantize

    layered = cfg["model_type"] == "llama"  # llama.cpp permutes q/k rows for llama files only
    gemma = cfg["model_type"] == gguf_gemma3.MODEL_TYPE
    layer_tensors = gguf_gemma3.LAYER_TENSORS if gemma else _LAYER_TENSORS
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        if t.name in _GLOBAL_TENSORS:
            name = _GLOBAL_TENSORS[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in layer_tensors:
                raise CloverError(f"{path}: unexpected tensor {t.name}; this is not a plain "
                                  f"{'Gemma 3' if gemma else 'Llama-family'} model")
            name = f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}"
        try:
            qtype = GGMLQuantizationType(t.tensor_type)
            w = np.asarray(dequantize(t.data, qtype), np.float32)
        except (ValueError, NotImplementedError, KeyError) as e:
            raise CloverError(f"{path}: tensor {t.name} has a type the gguf package cannot dequantize "
                              f"({t.tensor_type}: {e}); convert the file to F16 or a common quantization") from None
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists dims innermost first
        if gemma and gguf_gemma3.is_norm(t.name):
            w = w - np.float32(1)  # stored as the scale 1 + w
        if layered and ".q_proj." in name:
            w = unpermute_rope_rows(w, cfg["num_attention_heads"])
        elif layered and ".k_proj." in name:
            w = unpermute_rope_rows(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    if gemma:
        gguf_gemma3.check_complete(set(out), cfg, path)
    return out


def save_tokenizer(reader, path: Path, out: Path) -> None:
    """The file's tokenizer, chat template and special tokens as tokenizer.json + tokenizer_config.json."""
    try:  # transformers >= 5
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers import PreTrainedTokenizerFast

    groups = {group: {name: _field(reader, f"tokenizer.{key}") for key, name in renames.items()
                      if f"tokenizer.{key}" in reader.fields}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    spec, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in spec:
        raise CloverError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens); it cannot be run alone")
    arch = str(_field(reader, "general.architecture"))
    try:
        backend, extra = convert_gguf_tokenizer(arch, spec)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise CloverError(f"{path}: cannot rebuild its tokenizer ({e})") from None
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unk_token_id"),
                      ("pad_token", "pad_token_id")):
        if spec.get(key) is not None:
            config[name] = spec["tokens"][int(spec[key])]
    # transformers releases differ in which special tokens `extra` already names (5.17 gives bos_token
    # there too); the GGUF's own fields win.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **config})
    tokenizer.save_pretrained(str(out))


def convert_gguf(path: str | Path, out_dir: str | Path) -> None:
    """Write the GGUF file `path` as a Hugging Face checkpoint directory `out_dir` (float32 weights)."""
    from clover_jax.io.hf import write_safetensors

    path, out = Path(path), Path(out_dir)
    reader = _reader(path)
    cfg = hf_config(reader, path)
    if cfg["model_type"] == gguf_gemma3.MODEL_TYPE:
        # Written as the file describes it, so transformers' Gemma 3 reads it whatever our decoder
        # makes of it (loading it is where that is checked).
        hf = cfg
    else:
        hf = ModelConfig.from_hf_dict(cfg).to_hf_dict()  # refuses what our decoder cannot run, before any weight is read
        hf["torch_dtype"] = "float32"
    tensors = hf_tensors(reader, path, cfg)
    if hf["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(hf, indent=2))
    eos = cfg["eos_token_id"]
    write_text(out / "generation_config.json",
               json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos}, indent=2))
    save_tokenizer(reader, path, out)


def _hash_index(cache: Path) -> tuple[Path, dict]:
    path = cache / "gguf-hashes.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return path, json.loads(path.read_text())
    return path, {}


def _hash_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def file_sha256(path: Path, cache: Path) -> str:
    """The file's sha256; one already worked out for this (path, size, mtime) is read from the cache's
    index, so a multi-GB file is hashed once (`gguf_checkpoint` records it after a conversion)."""
    known = _hash_index(cache)[1].get(_hash_key(path))
    return known or sha256(path)


def _remember_hash(cache: Path, path: Path, digest: str) -> None:
    index_path, known = _hash_index(cache)
    if known.get(_hash_key(path)) != digest:
        known[_hash_key(path)] = digest
        with contextlib.suppress(OSError):
            write_text(index_path, json.dumps(known, indent=1) + "\n")


def _tmp_suffix() -> str:
    """What names a conversion's temporary folder as this process's: the host (a cache may be shared
    between machines, whose process ids mean nothing here) and the process id."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_conversions(folder: Path) -> None:
    """Remove the temporary folders (`gguf-*.tmp-HOST-PID`, or `.tmp-PID` as earlier runs named them) that
    conversions killed on this machine left in `folder`: a converted 8B model is tens of GB. A folder
    whose process still runs, or that another machine's process made, is left alone."""
    host = socket.gethostname()
    for tmp in folder.glob("gguf-*.tmp-*"):
        owner = tmp.name.rsplit(".tmp-", 1)[1]
        maker, _, pid = owner.rpartition("-")
        if pid.isdigit() and maker in ("", host) and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_checkpoint(path: str | Path, cache: Path) -> Path:
    """The checkpoint directory of a GGUF file, converted on first use into the cache (models/gguf-<sha256>)
    and reused after. The directory is written under a temporary name and renamed into place whole, so
    an interrupted or refused conversion leaves nothing behind; what a killed one left is removed by the
    next call (`remove_dead_conversions`)."""
    path = Path(path)
    if not path.is_file():
        raise CloverError(f"{path}: no such GGUF file")
    digest = file_sha256(path, cache)
    target = cache / "models" / f"gguf-{digest[:24]}"
    if target.parent.is_dir():
        remove_dead_conversions(target.parent)
    if (target / "config.json").is_file():
        _remember_hash(cache, path, digest)
        return target
    _gguf()  # a missing gguf package is the one line, before a word about converting
    tmp = target.with_name(target.name + _tmp_suffix())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        print(f"converting {path.name} to a checkpoint in {target} (once)", file=sys.stderr, flush=True)
        convert_gguf(path, tmp)
        write_text(tmp / "source.json", json.dumps({"gguf": str(path.resolve()), "sha256": digest}, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # a refused file leaves no empty folder behind either
            target.parent.rmdir()
    _remember_hash(cache, path, digest)
    return target
