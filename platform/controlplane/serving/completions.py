"""A completion through the cluster, in text: find the deployment, stream text deltas, count usage.

``Assembler`` turns the cluster's token events into text deltas and a final result (pure);
``astream`` and ``complete`` drive it from the generation service, for async consumers
(chat, streamed OpenAI responses) and for sync code (jobs, plain OpenAI responses).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from channels.db import database_sync_to_async

from controlplane.accounts.usage import Caller
from controlplane.deployments import generation
from controlplane.deployments.generation import (
    ClusterBusy,
    ClusterGenerationError,
    ClusterUnavailable,
    RequestTooLarge,
    TooManyGenerations,
    can_serve,
)
from controlplane.deployments.models import Deployment, DeploymentStatus
from inference.runtime.textstream import IncrementalDecoder
from inference.wire.generation import Done, Generate, Token, TokenLogprob

from .text import Sampling, tokenizer_for

__all__ = [
    "ClusterBusy",
    "ClusterGenerationError",
    "ClusterUnavailable",
    "ModelNotFound",
    "RequestTooLarge",
    "Target",
    "TooManyGenerations",
    "find_target",
]


class ModelNotFound(LookupError):
    """No deployment by that name."""


@dataclass(frozen=True)
class Target:
    """A deployment that serves text: its id, name, checkpoint, context length, the generations
    one user may have in its main at once (``Deployment.max_per_user``), and the token ids its
    model takes (``vocab``: the config's ``vocab_size``, the rows of its embedding)."""

    deployment_id: int
    name: str
    model_path: str
    context: int | None
    max_per_user: int
    vocab: int | None = None

    @property
    def tokenizer(self):
        return tokenizer_for(self.model_path)


def find_target(name: str | None = None) -> Target:
    """The deployment called ``name``; without a name, the ready one (the newest if several)."""
    deployments = Deployment.objects.select_related("model")
    if name is not None:
        deployment = deployments.filter(name=name).first()
        if deployment is None:
            raise ModelNotFound(f"no deployment named {name!r}; GET /v1/models lists them")
    else:
        candidates = deployments.filter(status__in=(DeploymentStatus.READY, DeploymentStatus.DEGRADED))
        deployment = next((d for d in candidates.order_by("-updated_at") if can_serve(d)), None)
        if deployment is None:
            raise ClusterUnavailable("no deployment is ready: deploy a model in the console first")
    if not can_serve(deployment):
        reason = f" ({deployment.status_reason})" if deployment.status_reason else ""
        raise ClusterUnavailable(f"deployment {deployment.name} is {deployment.status}{reason}; try again when ready")
    summary = deployment.model.summary
    context, vocab = summary.get("max_position_embeddings"), summary.get("vocab_size")
    context = context if isinstance(context, int) else None
    vocab = vocab if isinstance(vocab, int) else None
    return Target(deployment.pk, deployment.name, deployment.model.path, context, deployment.max_per_user, vocab)


@dataclass(frozen=True)
class TextDelta:
    """The text a token adds ("" inside a character), and, where asked for, its logprobs.

    ``offset``: where its text starts in the answer; ``prompt_logprobs``: with the first token,
    the prompt's (``Generate.prompt_logprobs``).
    """

    text: str
    token_id: int
    logprob: TokenLogprob | None = None
    offset: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class CompletionResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop, length or cancelled (generation.FINISH_REASONS)
    prompt_tokens: int
    metrics: dict = field(default_factory=dict)


class Assembler:
    """Token events in; text deltas and, at the end, the whole result out."""

    def __init__(self, tokenizer, prompt_tokens: int) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.prompt_tokens = prompt_tokens

    def feed(self, event: Token | Done) -> list[TextDelta | CompletionResult]:
        if isinstance(event, Token):
            offset = len(self.decoder.emitted)
            delta = self.decoder.add(event.token_id)
            if not delta and event.logprob is None and event.prompt_logprobs is None:
                return []
            return [TextDelta(delta, event.token_id, event.logprob, offset, event.prompt_logprobs)]
        tail = self.decoder.flush()  # a last incomplete character, if any
        result = CompletionResult(
            text=self.decoder.emitted,
            token_ids=list(event.token_ids),
            finish_reason=event.finish_reason,
            prompt_tokens=self.prompt_tokens,
            metrics=event.metrics,
        )
        return [TextDelta(tail, -1), result] if tail else [result]


def new_request_id() -> str:
    return uuid.uuid4().hex


def build_request(
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    request_id: str | None,
    caller: Caller,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    grammar: str = "",
) -> Generate:
    """The request main is sent for ``caller`` (main shares its batch fairly between users and
    keeps each user's prefix cache apart); ``logprobs``: each token's logprob and this many
    alternatives (None: none); ``prompt_logprobs``: the prompt's too; ``grammar``: the answer
    keeps to it (``Generate.grammar``)."""
    return Generate(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        request_id=request_id or new_request_id(),
        user=str(caller.user_id),
        prefix_namespace=caller.prefix_namespace,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        **sampling.request_fields(),
    )


async def astream(target: Target, request: Generate, *, caller: Caller) -> AsyncIterator[TextDelta | CompletionResult]:
    """Text deltas as the cluster produces ``request``'s tokens (``build_request``), then the
    result (its text is the whole answer); the tokens are counted to ``caller`` and their key."""
    tokenizer = await database_sync_to_async(lambda: target.tokenizer, thread_sensitive=False)()
    assembler = Assembler(tokenizer, len(request.prompt_ids))
    async for event in generation.astream(target.deployment_id, request, caller=caller):
        for item in assembler.feed(event):
            yield item


def complete(target: Target, request: Generate, *, caller: Caller) -> CompletionResult:
    """The whole completion of ``request`` (synchronous), counted to ``caller``."""
    assembler = Assembler(target.tokenizer, len(request.prompt_ids))
    for event in generation.stream(target.deployment_id, request, caller=caller):
        for item in assembler.feed(event):
            if isinstance(item, CompletionResult):
                return item
    raise ClusterGenerationError("the cluster ended the generation without a result")
