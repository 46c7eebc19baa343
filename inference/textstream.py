"""Turn generated token ids into text as they arrive, for a terminal or a log."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when it ships none."""
    directory = Path(model_dir)
    if not any((directory / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(directory)


class TextStream:
    """Prints only the new part of the decoded text after each token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, out: TextIO | None) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = ""

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        if self.out is None or self.tokenizer is None:
            return
        text = self.text(self.ids)
        # A token can end inside a multi-byte character: wait until it decodes cleanly.
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.printed) :])
            self.out.flush()
            self.printed = text

    def finish(self) -> None:
        if self.out is not None and self.tokenizer is not None:
            self.out.write("\n")
            self.out.flush()
