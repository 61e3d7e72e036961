"""Text shown as it is written: what `--stream` and `--interactive` print, step by step."""

from __future__ import annotations

import sys


class StreamPrinter:
    """Prints one sequence's text as its tokens arrive (`Generator.generate`'s on_tokens): the whole
    decoded so far less what is already shown, since decoding token by token could split a character
    that spans tokens, or drop a space a tokenizer adds only between tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.shown = ""

    def __call__(self, tokens, counts) -> None:
        """`on_tokens`' call: tokens [B, M] so far and their counts [B]; the first sequence is shown."""
        self.show(tokens[0, : counts[0]].tolist())

    def show(self, tokens: list[int], final: bool = False) -> None:
        """Print what `tokens` add to the text shown; `final` prints even a character still in the making."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not final and (text.endswith("\ufffd") or not text.startswith(self.shown)):
            return  # a character still in the making, or a decoding that may yet settle: wait
        # What a later decoding rewrote is printed again after a line break: nothing is ever lost.
        sys.stdout.write(text[len(self.shown):] if text.startswith(self.shown) else "\n" + text)
        sys.stdout.flush()
        self.shown = text
