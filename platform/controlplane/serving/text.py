"""Text in, text out for a deployment: the model's tokenizer, chat prompts, and input limits.

Pure decisions plus a small tokenizer cache; nothing here talks to the cluster. The tokenizer
is ``TextTokenizer`` (``tokenizer.py``): the model's ``tokenizer.json`` and chat template read as
Transformers reads them, without importing Transformers or torch into the web process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from jinja2 import TemplateError

from .tokenizer import TextTokenizer, TokenizerFilesError, load_text_tokenizer

# Without a chat template in the tokenizer, conversations are laid out like this.
FALLBACK_TEMPLATE = "{role}: {content}\n"
FALLBACK_ASSISTANT = "assistant:"


class InputError(ValueError):
    """A request the model cannot take; ``param`` names the field, ``code`` the kind of error."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; a seed makes sampling repeatable; ``knobs``, the request's other
    sampling knobs by ``Generate``'s names (``knobs.check_knobs``), each left out asking for nothing."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    knobs: Mapping[str, object] = field(default_factory=dict)

    def request_fields(self) -> dict:
        greedy = self.temperature == 0
        return {
            "do_sample": not greedy,
            "temperature": 1.0 if greedy else self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            **self.knobs,
        }


@functools.lru_cache(maxsize=8)
def tokenizer_for(model_path: str) -> TextTokenizer:
    try:
        tokenizer = load_text_tokenizer(model_path)
    except TokenizerFilesError as exc:
        raise InputError(f"the model at {model_path} cannot take text: {exc}", code="no_tokenizer") from None
    if tokenizer is None:
        raise InputError(
            f"the model at {model_path} ships no tokenizer.json, so it cannot take text", code="no_tokenizer"
        )
    return tokenizer


def check_prompt(prompt: object) -> None:
    if not isinstance(prompt, str) or not prompt:
        raise InputError("prompt must be a non-empty string", param="prompt")


def encode_prompt(tokenizer: TextTokenizer, prompt: str) -> list[int]:
    check_prompt(prompt)
    return tokenizer.encode(prompt)


PROMPT_FORMS = "a non-empty string, a list of strings, a list of token ids or a list of lists of token ids"


def prompt_list(prompt: object) -> list[str] | list[list[int]]:
    """``/v1/completions``' ``prompt`` as a list of prompts, all text or all token ids.

    OpenAI's (and vLLM's) four forms: a string, a list of strings, a list of token ids (one
    prompt) and a list of lists of token ids; a list that mixes them is refused. Strings are
    checked where they are encoded (``check_prompt``), ids against the model (``check_token_ids``).
    """
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_token_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return prompt
    raise InputError(f"prompt must be {PROMPT_FORMS}", param="prompt")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(prompts: list[list[int]], vocab: int) -> None:
    """Refuse, naming it, the first id that is no token of the model (ids ``0`` to ``vocab - 1``)."""
    for i, ids in enumerate(prompts):
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                where = f"prompt {i}, position {position}" if len(prompts) > 1 else f"position {position}"
                raise InputError(
                    f"token id {token_id} ({where}) is not in this model's vocabulary: ids 0 to {vocab - 1}",
                    param="prompt",
                )


def decode_with_starts(tokenizer: TextTokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text of a token-id prompt and where each token starts in it (``text_offset``).

    The text reads as an answer of those ids would (special tokens left out, as
    ``IncrementalDecoder`` writes answers). Each token's text is what decoding it after the
    tokens just before it adds, as vLLM's incremental detokenizer does: a SentencePiece word
    keeps its leading space, the bytes of one character start where the character does, and
    the prompt costs a few short decodes per token, not one decode of the whole prefix per token
    (quadratic in the prompt's length).
    """
    text, starts = "", []
    prefix = read = 0  # ids[prefix:read]: tokens already in text, decoded again as context for the next
    for i in range(len(ids)):
        starts.append(len(text))
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[prefix : i + 1], skip_special_tokens=True)
        if after.endswith("\ufffd") or not after.startswith(before):
            continue  # inside a character: its text comes with the token that completes it
        text += after[len(before) :]
        prefix, read = read, i + 1
    if read < len(ids):  # a last incomplete character (decoded as U+FFFD)
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        text += after[len(before) :] if after.startswith(before) else ""
    return text, starts


def encode_chat(tokenizer: TextTokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of a conversation, with the tokenizer's chat template when it has one
    (``chat_text``, then ``encode_chat_text``)."""
    return encode_chat_text(tokenizer, chat_text(tokenizer, messages, tools))


def chat_text(tokenizer: TextTokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation: what ``encode_chat_text`` tokenizes, and what the
    prompt's length is checked on before tokenizing (``check_text_fits``), tools and past calls
    included.

    ``tools`` (OpenAI's form) go to the template, for one that reads them
    (``TextTokenizer.template_reads_tools``; ``structured.with_tools`` puts them in the
    conversation for one that does not).

    The one place where messages become a prompt: the chat UI and ``/v1/chat/completions``
    both call it. Without a template, the messages are laid out as plain ``role: content`` lines.
    """
    check_messages(messages, tool_turns=tokenizer.template_reads_tools)
    if tokenizer.chat_template:
        return render_chat(tokenizer, messages, tools)
    return (
        "".join(FALLBACK_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + FALLBACK_ASSISTANT
    )


def encode_chat_text(tokenizer: TextTokenizer, text: str) -> list[int]:
    """The ids of a conversation's prompt text (``chat_text``). A template writes its own special
    tokens (Mixtral-Instruct's starts with ``{{ bos_token }}``), so its text is encoded without the
    tokenizer adding a second BOS; the plain layout without one gets the tokenizer's."""
    return tokenizer.encode(text, add_special_tokens=not tokenizer.chat_template)


def render_chat(tokenizer: TextTokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The conversation as the model's chat template writes it, ready for the answer to follow.

    A template may refuse a conversation (Mixtral-Instruct's raises on a system message or
    on two user turns in a row) or be broken: either is the request's problem, not a crash.
    """
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
    except (TemplateError, TypeError, ValueError) as exc:
        raise InputError(
            f"this model's chat template cannot render these messages: {exc}",
            param="messages",
            code="chat_template_error",
        ) from None


def check_messages(messages: object, *, tool_turns: bool = False) -> None:
    """Refuse a conversation that is not a list of messages with a role and string content.

    ``tool_turns``: a template that reads tools takes a tool loop's turns as they are: a ``tool``
    message (the result of a call) and an ``assistant`` one with ``tool_calls`` and no content
    (``structured.conversation`` checks their calls).
    """
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list", param="messages")
    roles = ("system", "user", "assistant", "tool") if tool_turns else ("system", "user", "assistant")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in roles:
            raise InputError(f"messages[{i}] needs a role of {', '.join(roles)}", param=f"messages[{i}]")
        calls = tool_turns and message["role"] == "assistant" and message.get("tool_calls")
        if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
            raise InputError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")


def check_lengths(prompt_tokens: int, max_new_tokens: int, context: int | None) -> None:
    """Refuse a request that cannot fit the model's context, with the numbers (``max_new_tokens``
    already held to its bound, ``bounds.check_max_tokens``)."""
    if context and prompt_tokens + max_new_tokens > context:
        raise InputError(
            f"this model's context is {context} tokens; the prompt has {prompt_tokens} and "
            f"max_tokens asks for {max_new_tokens} more",
            param="messages",
            code="context_length_exceeded",
        )


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer: TextTokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` stands for.

    A vocabulary entry is written in at least as many characters as the text it encodes: a
    byte-level BPE (GPT-2, Qwen, Llama 3) writes one character per byte, SentencePiece (Mixtral)
    writes the text itself with ``▁`` for a space, and a special token is its own text.
    """
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1) or 1


def check_text_fits(
    tokenizer: TextTokenizer, texts: list[str], max_new_tokens: int, context: int | None, *, param: str
) -> None:
    """Refuse, before tokenizing it, text that cannot fit the model's context whatever its tokens.

    A model's tokenizer keeps every character of the text (decoding gives it back), so text
    of N characters is at least N / L tokens, L being ``longest_token_chars``: past
    ``(context - max_new_tokens) * L`` characters no prompt can fit, and none that could is
    refused. A tokenizer whose normalizer may shorten text (Unicode composition: NFC, NFKC)
    is given the normalized text's length, worked out only for text past the bound. Text
    that passes is tokenized and held to the exact count (``check_lengths``).
    """
    if not context:
        return
    longest = longest_token_chars(tokenizer)
    bound = max(0, context - max_new_tokens) * longest
    chars = sum(len(text) for text in texts)
    if chars <= bound:
        return
    normalizer = tokenizer.normalizer
    if normalizer is not None:
        chars = sum(len(normalizer.normalize_str(text)) for text in texts)
    if chars > bound:
        raise InputError(
            f"this model's context is {context} tokens; the prompt has {chars} characters, so at least "
            f"{math.ceil(chars / longest)} tokens (one of this model's tokens is at most {longest} characters), "
            f"and max_tokens asks for {max_new_tokens} more",
            param=param,
            code="context_length_exceeded",
        )


# Seeds are stored (a 64-bit signed column) and reach torch.manual_seed: both take up to 2**63 - 1.
MAX_SEED = 2**63 - 1


def check_sampling(temperature: object, top_p: object, seed: object) -> Sampling:
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise InputError("temperature must be a number between 0 and 2", param="temperature")
    if not isinstance(top_p, int | float) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise InputError("top_p must be a number in (0, 1]", param="top_p")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise InputError(f"seed must be an integer from 0 to {MAX_SEED}", param="seed")
    return Sampling(float(temperature), float(top_p), seed)
