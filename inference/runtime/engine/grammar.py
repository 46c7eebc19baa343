"""Constrained decoding: a request's grammar as a mask over the vocabulary, step by step.

A ``Generate`` may carry a grammar (``Generate.grammar``): llguidance's serialized form, which
the control plane builds from a JSON schema (``response_format``) or a Lark grammar (tool
calls). Main compiles it for the model's own tokenizer (``tokenizer.json`` in its shard
directory), under the grammar limits (``inference.wire.grammar``), once per distinct grammar and
off its step loop (``compiles``); each sequence's ``Constraint`` holds its own copy of the
compiled matcher. Before each sampling the constraint says which
tokens may come next (``allowed``, a boolean mask); the sampler sets every other logit to
``-inf`` before any logits processor, so greedy decoding is the argmax over the allowed tokens
and sampling draws only from them; the token taken then advances the matcher
(``advance``). End-of-sequence is allowed only where the grammar is complete, so a generation
that ends by itself ends with a whole document.

The shadow keeps to the same grammar for its guesses of main's tokens (``Guessing``): its tokens
are taken back where main's differ, so its matcher rolls back to the tokens it shares with them.

Why llguidance: benchmarks/grammars.py compares it with xgrammar and outlines-core on the demo
tokenizer (docs/benchmarks/grammars.md): it enforces every feature a
strict JSON schema needs, compiles in under a millisecond, computes a mask in tens of
microseconds, and depends on nothing (the web process validates grammars with it too).
"""

from __future__ import annotations

import functools
from pathlib import Path

import llguidance
import torch

from inference.wire.grammar import over_limit


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it refuses (the message says why)."""


@functools.cache
def grammar_tokenizer(model_dir: str, vocab: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance sees it (built once per model: tens of milliseconds).

    ``vocab``: the model's vocabulary (its logits' width, which may pass the tokenizer's);
    ``eos``: the ids that end a generation, allowed only where the grammar is complete.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise GrammarError(f"constrained decoding needs the model's tokenizer.json, which {model_dir} lacks")
    return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab, eos_token=list(eos) or None)


def walked(matcher: llguidance.LLMatcher, tokens: list[int]) -> llguidance.LLMatcher:
    """``matcher`` past ``tokens``: an answer's tokens sent before main's restart, which its
    continuation re-reads as prompt (``Generate.answered``), so the grammar stands where the
    undisturbed answer's did at its next token. ``GrammarError`` if the grammar refuses them."""
    if tokens and not matcher.consume_tokens(tokens):
        raise GrammarError(f"the grammar refuses the answer's tokens from before its restart: {_why(matcher)}")
    return matcher


class Constraint:
    """One sequence's grammar: which tokens may come next, and the matcher that follows its tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        """``matcher``: the sequence's own, at its first token (``compiles.Compiles.take``)."""
        self.matcher = matcher
        self.vocab = vocab

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The tokens that may come next, as a [V] bool mask on ``device`` (end-of-sequence only
        where the grammar is complete)."""
        bias = self.matcher.compute_logit_bias()  # [V] bytes: nonzero where allowed
        if self.matcher.is_error():  # a step limit met computing this mask, or an earlier error
            raise GrammarError(f"the grammar stopped the generation: {_why(self.matcher)}")
        mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: self.vocab] != 0  # [V]
        return mask.to(device)

    def advance(self, token: int) -> None:
        """The sequence took ``token``: the matcher follows (it must be one ``allowed`` allowed)."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {_why(self.matcher)}")

    @property
    def complete(self) -> bool:
        """Whether the tokens so far make a whole document."""
        return self.matcher.is_accepting()


class Guessing:
    """The shadow's copy of a sequence's grammar, for its guesses of main's tokens: it follows
    whatever tokens the sequence has at each guess, rolling back the ones main replaced."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self.start = matcher  # at the first token: where it begins again after a refusal
        self.vocab = vocab
        self.constraint = Constraint(matcher.deep_copy(), vocab)
        self.taken: list[int] = []  # the tokens the matcher has consumed, in order

    def allowed_after(self, tokens: list[int], device: torch.device) -> torch.Tensor | None:
        """The tokens the grammar allows after the sequence's generated ``tokens``, as a [V] bool
        mask on ``device``; None where it refuses them (guesses made before the grammar was
        compiled here, which main's tokens replace: the next call begins again from the start)."""
        shared = 0
        for taken, token in zip(self.taken, tokens, strict=False):
            if taken != token:
                break
            shared += 1
        try:
            if shared < len(self.taken):
                if not self.constraint.matcher.rollback(len(self.taken) - shared):
                    raise GrammarError(f"the grammar could not roll back {len(self.taken) - shared} tokens")
                del self.taken[shared:]
            for token in tokens[shared:]:
                self.constraint.advance(token)
                self.taken.append(token)
            return self.constraint.allowed(device)
        except GrammarError:
            self.constraint, self.taken = Constraint(self.start.deep_copy(), self.vocab), []
            return None


def _why(matcher: llguidance.LLMatcher) -> str:
    """Why ``matcher`` stopped: the grammar limit it met, in the limits' words, or llguidance's own."""
    error = matcher.get_error()
    return over_limit(error) or error
