"""Byte-level BPE tokenizer for the reference model, trained on the corpus's train split.

Byte-level (GPT-2 style) with no normalizer and no prefix space, so any Python source, with its
indentation, tabs, CRLF and non-ASCII text, decodes back to exactly the same bytes. Saved with the
Hugging Face side files so `transformers.AutoTokenizer.from_pretrained(DIR)` loads it as a fast
tokenizer, the same import path a Vicuna or Llama-3 checkpoint takes.

Special tokens: id 0 `<|endoftext|>` is EOS and PAD (the corpus stream puts it after every file);
id 1 `<|bos|>` exists because Llama configs name a BOS id, but nothing adds it: the post-processor
inserts no special tokens, so the raw tokenizer, AutoTokenizer and the training stream all agree
on the ids of a text. A prompt may begin with EOS to look like the start of a file.

    python -m train.tokenizer --out models/reference
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from clover_jax.errors import CloverError
from clover_jax.io.files import atomic_path, write_text
from train import corpus

EOS_TOKEN = corpus.EOS_TOKEN
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)  # ids 0, 1 in this order
MODEL_MAX_LENGTH = 2048

# A plain-text chat format so `--chat` works; the model is a code model, so it only sees this shape
# at inference time. The assistant turn ends with EOS, which is what generation stops on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n"
    "{% else %}### Assistant:\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def train_tokenizer(files_text_iter: Iterable[str], vocab_size: int = 8192,
                    show_progress: bool = False) -> Tokenizer:
    """Train byte-level BPE on an iterable of document texts; special tokens get ids 0 and 1."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise CloverError(f"--vocab-size {vocab_size} is too small; byte-level BPE needs at least 258")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Only fixes offsets; adds no tokens (see the module docstring for why no BOS).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=show_progress,
    )
    tok.train_from_iterator(files_text_iter, trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise CloverError(f"trained tokenizer put {name} at id {tok.token_to_id(name)}, expected {i}")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir, model_max_length: int = MODEL_MAX_LENGTH) -> pathlib.Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        # transformers' default cleanup rewrites " ," to "," on decode, breaking byte round-trips.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    write_text(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    write_text(out / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return out


def _texts(files: list[str]) -> Iterable[str]:
    for rel in tqdm(files, desc="tokenizer", unit="file"):
        yield corpus.read_text(rel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.tokenizer",
        description="Train the reference model's byte-level BPE tokenizer on the standard-library "
                    "train split and save it (with split.json) in a directory AutoTokenizer can load.")
    parser.add_argument("--out", required=True,
                        help="directory to write tokenizer.json, tokenizer_config.json, "
                             "special_tokens_map.json and split.json into (created if missing)")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="vocabulary size including the 256 byte tokens and 2 special tokens "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        files = corpus.split_files(corpus.list_files())["train"]
        start = time.perf_counter()
        tok = train_tokenizer(_texts(files), args.vocab_size)
        seconds = time.perf_counter() - start
        out = save_tokenizer(tok, args.out)
        corpus.write_split(out)
    except CloverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trained on {len(files)} files in {seconds:.1f}s; vocab {tok.get_vocab_size()}; "
          f"saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
