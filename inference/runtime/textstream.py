"""Turn generated token ids into text as they arrive, for a terminal or a log.

Transformers is imported only by ``load_tokenizer``: ``IncrementalDecoder`` works with any
tokenizer that has ``decode(ids, skip_special_tokens=...)``, such as the control plane's
torch-free one (``controlplane/serving/tokenizer.py``), whose web process must not import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when it ships none."""
    directory = Path(model_dir)
    if not any((directory / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


class IncrementalDecoder:
    """Text of a growing list of token ids, handed out as the new part after each token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The text this token adds ("" while it ends inside a multi-byte character)."""
        self.ids.append(token_id)
        text = self.text()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character decodes as U+FFFD)."""
        text = self.text()
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta


class TextStream:
    """Prints only the new part of the decoded text after each token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, out: TextIO | None) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        if self.out is None or self.decoder is None:
            return
        delta = self.decoder.add(token_id)
        if delta:
            self.out.write(delta)
            self.out.flush()

    def finish(self) -> None:
        if self.out is not None and self.decoder is not None:
            self.out.write(self.decoder.flush() + "\n")
            self.out.flush()
