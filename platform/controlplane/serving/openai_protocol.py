"""The OpenAI API's chat and completions requests, read and checked: ``parse_ask`` turns a body into
an ``Ask`` (where it goes, what it asks), or refuses it with an ``InputError`` that names the field.

Every body parameter is honoured or refused (``parameters``: one declaration per endpoint), each
field's size is bounded before anything is built from it (``bounds``), and a prompt that cannot fit
the deployment's context is refused from its length before it is tokenized. ``openai_api`` serves
what it asks; ``responses_api`` reads its own requests into the same ``Ask``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from controlplane.accounts.usage import Caller

from .bounds import CHOICES, STOPS, check_max_tokens, check_openai_request
from .completions import (
    Target,
    find_target,
)
from .knobs import check_knobs
from .logprobs import chat_top_logprobs, completion_logprobs
from .parameters import CHAT, COMPLETIONS, check_parameters
from .structured import Structure, conversation, read_structure
from .text import (
    MAX_SEED,
    InputError,
    Sampling,
    chat_text,
    check_lengths,
    check_prompt,
    check_sampling,
    check_text_fits,
    check_token_ids,
    decode_with_starts,
    encode_chat_text,
    encode_prompt,
    prompt_list,
)
from .tokenizer import TextTokenizer

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Ask:
    """A validated request: where it goes, what it asks."""

    target: Target
    prompts: list[list[int]]  # token ids of each prompt (chat: the one conversation)
    n: int  # choices per prompt
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    stream: bool
    include_usage: bool
    caller: Caller | None = None  # who asks: main shares its batch fairly between users; usage counts to them
    logprobs: int | None = None  # each token's logprob and this many alternatives (None: no logprobs)
    echo: bool = False  # the prompt first (``texts``)
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is left out
    texts: list[str] = dataclasses.field(default_factory=list)  # each prompt's text (completions)
    structure: Structure = dataclasses.field(default_factory=Structure)  # chat: its grammar, the tools it may call
    # Token-id prompts: where each token starts in its text (text prompts: the tokenizer's offsets, for echo).
    starts: list[list[int]] = dataclasses.field(default_factory=list)

    def choices(self) -> list[tuple[int, list[int], Sampling]]:
        """(index, prompt ids, sampling) of every choice, prompt after prompt, ``n`` each (choice
        ``i`` is of prompt ``i // n``)."""
        out = []
        for p, prompt_ids in enumerate(self.prompts):
            for j in range(self.n):
                seed = self.sampling.seed
                if seed is None or j == 0:
                    sampling = self.sampling
                else:
                    sampling = dataclasses.replace(self.sampling, seed=(seed + j) % (MAX_SEED + 1))
                out.append((p * self.n + j, prompt_ids, sampling))
        return out


def parse_ask(body: dict, chat: bool) -> Ask:
    check_parameters(body, CHAT if chat else COMPLETIONS, "chat completions" if chat else "completions")
    check_openai_request(body, chat=chat)  # every field's size, before anything is built from it
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("model is required (a deployment name; GET /v1/models lists them)", param="model")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError("n must be an integer of at least 1", param="n")
    CHOICES.check(n, "n")
    max_tokens = _max_tokens(body)
    sampling = check_sampling(body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("seed"))
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InputError(f"stop must be a string or a list of at most {STOPS.limit} strings", param="stop")
    stream = _stream(body)
    include_usage = _include_usage(body.get("stream_options"), stream)
    if chat:
        logprobs, echo = chat_top_logprobs(body.get("logprobs"), body.get("top_logprobs")), False
    else:
        logprobs, echo = completion_logprobs(body.get("logprobs")), body.get("echo") or False
        if not isinstance(echo, bool):
            raise InputError("echo must be true or false", param="echo")
    # echo with max_tokens 0 (log-likelihood of the prompt alone): main generates one token, left out.
    prompt_only = echo and max_tokens == 0
    if prompt_only:
        max_tokens = 1
    elif max_tokens == 0:
        message = "max_tokens must be at least 1 (0 only with echo: the prompt alone, for its logprobs)"
        raise InputError(message, param="max_tokens")
    check_max_tokens(max_tokens)
    target = find_target(model)
    # More choices than one user may have in main at once could never all run: refused now.
    limit = target.max_per_user
    if n > limit:
        raise InputError(
            f"n must be from 1 to {limit}, the generations one user may have on this deployment at once",
            param="n",
        )
    tokenizer = target.tokenizer
    vocab = tokenizer.vocab_size if target.vocab is None else min(target.vocab, tokenizer.vocab_size)
    sampling = dataclasses.replace(sampling, knobs=check_knobs(body, vocab))
    texts: list[str] = []
    starts: list[list[int]] = []
    # Text that cannot fit the context is refused from its length before it is tokenized: a
    # conversation's as the chat template writes it, with its tools and past calls.
    structure = Structure()
    if chat:
        structure, prompts = _chat_prompt(body, target, tokenizer, max_tokens)
    else:
        prompts, texts, starts = _completion_prompts(body, target, tokenizer, vocab, n, max_tokens)
    for prompt_ids in prompts:
        check_lengths(len(prompt_ids), max_tokens, target.context)
    return Ask(
        target,
        prompts,
        n,
        max_tokens,
        sampling,
        stops,
        stream,
        include_usage,
        "",
        logprobs,
        echo,
        prompt_only,
        texts,
        structure,
        starts,
    )


def _max_tokens(body: dict) -> int:
    """``max_completion_tokens``, else ``max_tokens``, else the default: an integer, its range checked later."""
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise InputError("max_tokens must be an integer", param="max_tokens")
    return max_tokens


def _stream(body: dict) -> bool:
    """``stream``: true or false, null or absent for false."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InputError("stream must be true or false", param="stream")
    return stream


def _chat_prompt(
    body: dict, target: Target, tokenizer: TextTokenizer, max_tokens: int
) -> tuple[Structure, list[list[int]]]:
    """The structure a chat asks for and its conversation's token ids, refused if its text cannot fit."""
    structure = read_structure(body)
    messages, tools = conversation(body.get("messages"), structure.tools, tokenizer.template_reads_tools)
    text = chat_text(tokenizer, messages, tools)
    check_text_fits(tokenizer, [text], max_tokens, target.context, param="messages")
    return structure, [encode_chat_text(tokenizer, text)]


def _completion_prompts(
    body: dict, target: Target, tokenizer: TextTokenizer, vocab: int, n: int, max_tokens: int
) -> tuple[list[list[int]], list[str], list[list[int]]]:
    """A completion's prompts: (token ids, texts, token-id prompts' starts), each checked before it is converted."""
    limit = target.max_per_user
    given = prompt_list(body.get("prompt"))
    if len(given) * n > limit:
        raise InputError(
            f"{len(given)} prompts × n={n} are more than the {limit} generations one user may have "
            "on this deployment at once",
            param="prompt",
        )
    starts: list[list[int]] = []
    if isinstance(given[0], list):  # token ids: main gets them as they are
        check_token_ids(given, vocab)
        prompts = [list(ids) for ids in given]
        for prompt_ids in prompts:  # a prompt that cannot fit is refused before it is decoded
            check_lengths(len(prompt_ids), max_tokens, target.context)
        decoded = [decode_with_starts(tokenizer, ids) for ids in prompts]
        texts, starts = [text for text, _ in decoded], [where for _, where in decoded]
    else:
        texts, prompts = given, []
        for text in texts:
            check_prompt(text)
            check_text_fits(tokenizer, [text], max_tokens, target.context, param="prompt")
            prompts.append(encode_prompt(tokenizer, text))
    return prompts, texts, starts


def _include_usage(options: object, stream: bool) -> bool:
    """``stream_options``: ``include_usage`` alone, and only with ``stream``."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InputError('stream_options must be an object, e.g. {"include_usage": true}', param="stream_options")
    if not stream:
        raise InputError("stream_options is only taken with stream: true", param="stream_options")
    for name in options:
        if name != "include_usage":
            raise InputError(
                f"stream_options.{name:.60} is not supported (include_usage is)",
                param=f"stream_options.{name:.60}",
                code="unsupported_parameter",
            )
    include_usage = options.get("include_usage", False)
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InputError("stream_options.include_usage must be true or false", param="stream_options.include_usage")
    return bool(include_usage)
