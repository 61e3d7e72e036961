"""The evaluation prompt set: openings of real definitions from the corpus's held-out test split.

Each prompt is a `def`/`class` found with `ast` (top-level or nested): its header, its docstring and
its first few body lines, after a little of the code above it for context. The model never trained
on these files, and asking it to continue a definition it has just started is the kind of code
completion speculative decoding is measured on. Prompts end at the end of a line, without the
newline, so the model generates the newline-plus-indent token itself, as it did in training.

    python -m train.make_prompts --tokenizer models/reference --out models/reference/prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import json
import pathlib
import random
import sys

from tqdm import tqdm

from clover_jax.errors import CloverError
from clover_jax.io.files import write_text
from train import corpus

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _length_fn(tokenizer, max_tokens: int, max_chars: int):
    """(length of a text, budget): tokens by `tokenizer` when given, else characters."""
    if tokenizer is None:
        return len, max_chars
    tok = corpus.load_tokenizer(tokenizer)
    return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), max_tokens


def _lines(text: str) -> list[str]:
    """Source lines with their endings, split only where Python ends a line (not at \\f or \\x1c)."""
    return io.StringIO(text, newline="").readlines()


def _spans(text: str) -> list[tuple[int, int, int, int]]:
    """(first line, def line, header's last line, last line) per definition; 1-based, inclusive.

    The first line is the first decorator's; the header runs through the docstring if there is one.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, _DEFS):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        body = node.body[0]
        header_end = max(node.lineno, body.lineno - 1)
        if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) \
                and isinstance(body.value.value, str):
            header_end = body.end_lineno  # the docstring belongs with the header
        spans.append((first, node.lineno, header_end, node.end_lineno))
    return spans


def _prompt(lines: list[str], span: tuple[int, int, int, int], body_lines: int, context_lines: int,
            length, budget: int) -> str | None:
    """The longest prompt for one definition that fits `budget`, or None if its header alone does not."""
    first, _, header_end, last = span

    def text(top: int, bottom: int) -> str:
        return "".join(lines[top - 1:bottom]).rstrip()

    # Stop before the definition's last line so the model always has some of it left to write.
    bottom = max(header_end, min(header_end + body_lines, last - 1))
    while bottom > header_end and length(text(first, bottom)) > budget:
        bottom -= 1
    if length(text(first, bottom)) > budget:
        return None
    top = first
    while top > max(1, first - context_lines) and length(text(top - 1, bottom)) <= budget:
        top -= 1
    out = text(top, bottom)
    return out.lstrip("\n") or None


def make_prompts(tokenizer=None, count: int = 300, seed: int = 0, max_tokens: int = 200,
                 max_chars: int = 800, body_lines: int = 4, context_lines: int = 30,
                 files: list[str] | None = None, root: pathlib.Path | None = None,
                 split: str = "test") -> list[dict]:
    """Up to `count` prompts as {"prompt": str, "source": "relpath:lineno"}, sorted by source.

    `tokenizer` (object, tokenizer.json or its directory) sets the budget in tokens (`max_tokens`);
    without one it is `max_chars` characters. `files` defaults to the `split` (the held-out test split
for evaluation; head training takes its prompts from the train split). Which definitions
    are picked depends only on `seed` and the files, so the set is reproducible.
    """
    length, budget = _length_fn(tokenizer, max_tokens, max_chars)
    files = corpus.split_files(corpus.list_files(root))[split] if files is None else files
    texts = {rel: corpus.read_text(rel, root) for rel in files}
    lines = {rel: _lines(text) for rel, text in texts.items()}
    candidates = [(rel, span) for rel in sorted(texts) for span in _spans(texts[rel])]
    if not candidates:
        raise CloverError("no function or class definitions found in the prompt source files")
    random.Random(seed).shuffle(candidates)
    per_file = collections.Counter()
    max_per_file = max(1, count // 10)  # so one long module (aifc.py) cannot dominate the set
    picked, seen = [], set()
    with tqdm(total=count, desc="prompts", unit="prompt", leave=False) as bar:
        for rel, span in candidates:
            if len(picked) == count:
                break
            if per_file[rel] == max_per_file:
                continue
            prompt = _prompt(lines[rel], span, body_lines, context_lines, length, budget)
            if prompt is None or prompt in seen:
                continue
            seen.add(prompt)
            per_file[rel] += 1
            picked.append((rel, span[1], prompt))
            bar.update(1)
    return [{"prompt": prompt, "source": f"{rel}:{line}"} for rel, line, prompt in sorted(picked)]


def write_jsonl(prompts: list[dict], out) -> pathlib.Path:
    """One JSON object per line, UTF-8 kept as is (not \\u-escaped) so the file reads like the source."""
    path = pathlib.Path(out)
    write_text(path, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.make_prompts",
        description="Write the evaluation prompts (openings of function and class definitions from "
                    "the standard-library test split) as JSONL.")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or tokenizer.json that measures --max-tokens; "
                             "without it the budget is 4 characters per token")
    parser.add_argument("--out", required=True, help="JSONL file to write, one prompt per line")
    parser.add_argument("--count", type=int, default=300, help="number of prompts (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed that picks which definitions are used (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=200,
                        help="longest prompt, in tokens (default: %(default)s)")
    parser.add_argument("--split", choices=corpus.SPLITS, default="test",
                        help="corpus split the definitions come from: test for evaluation, train for "
                             "head-training data (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.count < 1 or args.max_tokens < 1:
            raise CloverError("--count and --max-tokens must be positive")
        prompts = make_prompts(args.tokenizer, args.count, args.seed, args.max_tokens,
                               max_chars=4 * args.max_tokens, split=args.split)
        path = write_jsonl(prompts, args.out)
    except CloverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(prompts)} prompts to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
