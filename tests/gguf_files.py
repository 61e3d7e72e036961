"""Tiny GGUF files for the GGUF import's tests (tests/test_gguf*.py), written with gguf.GGUFWriter the way
llama.cpp's converter writes a Hugging Face model: the metadata every architecture carries, a tokenizer's
token list, and the model's tensors under llama.cpp's names, stored as the test asks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

# The tensors outside the layers, by their Hugging Face names.
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


@contextlib.contextmanager
def gguf_writer(path, arch: str, config, rope_theta: float, tokenizer_model: str, tokens: Sequence[str],
                token_types: Sequence[int], bos: int, eos: int) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter of `arch` at `path` holding what every architecture's file says: the model's shape
    from its Hugging Face `config`, its RoPE base and its tokenizer (`tokenizer_model`, the tokens with
    their llama.cpp types, scores 0). The caller adds its architecture's own metadata and the tensors
    (`add_tensor`); the file is written when the block ends."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(list(tokens))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(list(token_types))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    yield w
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_tensors(model, layer_tensors: dict[str, str]) -> Iterator[tuple[str, str, np.ndarray]]:
    """(Hugging Face name, GGUF name, float32 array) of each of `model`'s tensors, a tied lm_head left
    out; `layer_tensors` names a layer's tensors (`self_attn.q_proj.weight` -> `attn_q.weight`)."""
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{layer_tensors[rest]}"
        else:
            out = GLOBAL_TENSORS[name]
        yield name, out, tensor.detach().numpy().astype(np.float32)


def add_tensor(w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype: Q) -> None:
    """Tensor `a` stored as `qtype`: F32 as it is, F16 as float16, any other quantized."""
    if qtype == Q.F32:
        w.add_tensor(name, a)
    elif qtype == Q.F16:
        w.add_tensor(name, a.astype(np.float16))
    else:
        w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
