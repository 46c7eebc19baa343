"""Logprobs for the OpenAI-compatible API: what a request asks for, and OpenAI's two answer shapes.

Main computes them (``inference.wire.generation``: the log-softmax of the model's raw logits in
float32, before temperature, top-p or top-k touch them, as vLLM reports them); here they are
checked on the way in and written out:

- the chat's (``choices[i].logprobs.content``): per token ``{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}``, the ``top_logprobs`` most likely first;
- the legacy completions' (``choices[i].logprobs``): ``{tokens, token_logprobs, top_logprobs,
  text_offset}``, each ``top_logprobs`` entry a mapping of the ``logprobs`` most likely tokens
  and the chosen one (so up to ``logprobs + 1`` entries, as OpenAI says); with ``echo`` the
  prompt's tokens come first, the first one's logprob and alternatives null (nothing predicts
  it), as OpenAI and vLLM answer.

A token's text is its own bytes (``TextTokenizer.token_bytes``) as UTF-8; a token that holds
part of a character is written ``bytes:\\xNN...``, as OpenAI writes one, so that no two tokens
share a text. ``text_offset`` counts characters of the prompt and then the answer as returned,
from the prompt's start, with or without ``echo``.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.wire.generation import TokenLogprob

from .bounds import COMPLETION_LOGPROBS, TOP_LOGPROBS
from .text import InputError
from .tokenizer import TextTokenizer


@dataclass(frozen=True)
class Scored:
    """One token of an answer's logprobs: its id, its logprob and alternatives (None for the
    prompt's first token, which nothing predicts), and where its text starts (``text_offset``)."""

    token_id: int
    logprob: TokenLogprob | None
    offset: int


def chat_top_logprobs(logprobs: object, top_logprobs: object) -> int | None:
    """How many alternatives a chat request asks for per token; None: no logprobs at all."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InputError("logprobs must be true or false", param="logprobs")
    if top_logprobs is not None and (
        not isinstance(top_logprobs, int)
        or isinstance(top_logprobs, bool)
        or not 0 <= top_logprobs <= TOP_LOGPROBS.limit
    ):
        raise InputError(f"top_logprobs must be an integer from 0 to {TOP_LOGPROBS.limit}", param="top_logprobs")
    if not logprobs:
        if top_logprobs:
            raise InputError("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top_logprobs or 0


def completion_logprobs(logprobs: object) -> int | None:
    """How many alternatives a legacy completion asks for per token; None: no logprobs at all."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= COMPLETION_LOGPROBS.limit:
        raise InputError(
            f"logprobs must be an integer from 0 to {COMPLETION_LOGPROBS.limit} (the alternatives listed per token)",
            param="logprobs",
        )
    return logprobs


def token_text(tokenizer: TextTokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and its bytes (OpenAI's ``token`` and ``bytes``)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:  # part of a character
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def chat_content(tokenizer: TextTokenizer, tokens: list[Scored]) -> list[dict]:
    """``logprobs.content`` of a chat answer (or of one streamed chunk)."""
    content = []
    for scored in tokens:
        entry = scored.logprob
        if entry is None:
            continue
        text, raw = token_text(tokenizer, entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_raw = token_text(tokenizer, token_id)
            top.append({"token": top_text, "logprob": logprob, "bytes": top_raw})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return content


def chat_logprobs(tokenizer: TextTokenizer, tokens: list[Scored]) -> dict:
    """A chat choice's ``logprobs`` object."""
    return {"content": chat_content(tokenizer, tokens), "refusal": None}


def legacy_logprobs(tokenizer: TextTokenizer, tokens: list[Scored], alternatives: int) -> dict:
    """A legacy completion's ``logprobs`` object (of a whole answer or of one streamed chunk)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for scored in tokens:
        out["tokens"].append(token_text(tokenizer, scored.token_id)[0])
        out["text_offset"].append(scored.offset)
        entry = scored.logprob
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top = {token_text(tokenizer, t)[0]: lp for t, lp in entry.top[:alternatives]}
        top.setdefault(token_text(tokenizer, entry.token_id)[0], entry.logprob)  # the chosen one, always
        out["top_logprobs"].append(top)
    return out


def prompt_tokens(ids: list[int], starts: list[int], entries: list[TokenLogprob]) -> list[Scored]:
    """An echoed prompt's tokens: the first without a logprob, the rest with main's ``entries``.

    ``starts``: where each token starts in the prompt's text (a text prompt's tokenizer offsets,
    or ``text.decode_with_starts``' for a token-id prompt).
    """
    logprobs: list[TokenLogprob | None] = [None, *entries]
    if len(logprobs) != len(ids):
        raise ValueError(f"main sent {len(entries)} prompt logprobs for a prompt of {len(ids)} tokens")
    return [Scored(t, lp, start) for t, lp, start in zip(ids, logprobs, starts, strict=True)]
