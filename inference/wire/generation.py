"""One generation, at every hop: the request and its events.

The control plane sends a ``Generate`` down the agent link; the agent hands it as it is to
main over ZeroMQ; main answers with ``Token`` events and one ``Done``, or one ``Failed``, which
the agent forwards as they are up the link, and the control plane hands on through its
channel layer to the OpenAI API's SSE and the chat's websocket. A new sampling option is
one new field here.

Each class has two tags, the ones its frames had before it was declared once: the agent
link's ``"type"`` (the msgspec tag, e.g. ``"generation_token"``) and the ZeroMQ header's
``"t"`` (``TYPE``, e.g. ``"token"``).

Log-probabilities, where a request asks for them, are main's: the log-softmax of the model's
raw logits for that step (the model's dtype promoted to float32), before any sampling
processor (temperature, top-p, top-k) changes them, as vLLM reports them. A value below
``LOGPROB_FLOOR`` (``-inf`` for a token the model rules out) is sent as the floor, as vLLM
does: JSON has no infinity, and the agent link refuses one.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from inference.wire.base import Message, declared, own_fields

MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's chat bound)
# OpenAI's bounds on its sampling knobs: a penalty in [-2, 2], a logit bias in [-100, 100]; at most
# MAX_LOGIT_BIAS biased tokens a request (what one request carries to main is bounded).
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS = 300
MAX_TOP_K = 2**31 - 1  # any top-k past the vocabulary keeps every token; this bounds what travels
LOGPROB_FLOOR = -9999.0


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One token's log-probability at its position, and the ``top`` most likely tokens there
    as ``(token id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Sampled(Message, kw_only=True):
    """What a request asks of the sampler: ``Generate``, and the ``ShadowBegin`` by which the shadow
    follows it, carry these fields alike (``inference.runtime.engine.sampling.request_sampler``).

    Greedy unless ``do_sample``; ``temperature``, ``top_p`` and ``seed`` as Transformers' ``generate``
    takes them. The knobs: ``top_k``, ``min_p`` and ``repetition_penalty`` as Transformers'
    ``generate`` takes them (None: the model's generation config's; top-k and min-p shape sampling
    only); ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` ((token id, bias) pairs:
    msgpack maps take no integer keys) as OpenAI documents them, greedy or sampled.

    ``grammar``: the answer must keep to it (constrained decoding; "" for none), in llguidance's
    serialized form. ``answered``: how many of the prompt's last tokens are the answer's own, sent
    before main's restart (0 for none); ``Generate`` says more of both.
    """

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = []
    grammar: str = ""
    answered: int = 0

    def sampling(self) -> dict[str, object]:
        """These fields, by name: what another ``Sampled`` carries on of this one."""
        return {name: getattr(self, name) for name in SAMPLED_FIELDS}


SAMPLED_FIELDS = own_fields(Sampled)


class Generate(Sampled, kw_only=True, tag="generate"):
    """A generation for main to run; ``deployment`` is the deployment's runtime key.

    Greedy unless ``do_sample``. ``user`` says who asked (an opaque id, e.g. the control
    plane's user id): main shares its batch fairly between users, so that one user's many
    requests do not keep another's waiting, and caps what one user has in it. It is also the
    tenant of main's and the shadow's prefix caches: a prompt reuses only blocks its own user's
    generations left, unless ``prefix_namespace`` names a namespace shared by every caller a
    staff user granted it (a common system prompt; whoever shares it can learn from
    ``cached_tokens`` what the others sent). Requests without either (the runtime's own client,
    the CLI, benchmarks) share one namespace of their own.

    ``logprobs``: each ``Token`` carries its logprob and its ``top_logprobs`` (0 to
    ``MAX_TOP_LOGPROBS``) most likely alternatives; ``prompt_logprobs``: the first ``Token``
    also carries every prompt token's (but the first's, which nothing predicts), gathered
    from every piece of the prefill.

    ``grammar``: the answer must keep to it (constrained decoding; "" for none), in
    llguidance's serialized form (``llguidance.LLMatcher.grammar_from_json_schema`` or
    ``grammar_from_lark``): main masks every token it does not allow before sampling, and
    allows the end of the sequence only where it is complete. One that does not compile for
    the model's tokenizer is refused (``Failed``).

    ``answered``: a continuation of an answer main's restart cut (``agent.migration``, under
    ``replay: prefill``): the last ``answered`` of ``prompt_ids`` are the answer's own tokens, sent
    before main's process exited and re-read now as prompt. The grammar walks them before the first
    new token, and OpenAI's frequency and presence penalties count them as generated, as the
    undisturbed answer would have; 0 (any other request) for none.

    ``step_reports``: each ``Token`` carries its step's report (``Token.step``). Only the
    console's live view reads them past the agent, so the control plane asks for them only
    while a console watches: a report is most of a token's bytes on every hop.

    Its sampling (``do_sample``, ``temperature``, ``top_p``, ``seed`` and the knobs) is ``Sampled``'s.
    """

    request_id: str
    prompt_ids: list[int]
    user: str = ""
    prefix_namespace: str = ""
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    step_reports: bool = True


class Token(Message, kw_only=True, tag="generation_token"):
    """A generated token, with what the step that made it did per layer (``metrics.step_report``)
    where its request asked (``Generate.step_reports``).

    ``logprob``: its logprob and alternatives, where the request asked (``Generate.logprobs``);
    ``prompt_logprobs``: on the first token of a request that asked, the prompt's tokens' from
    the second on.
    """

    TYPE: ClassVar[str] = "token"
    request_id: str
    index: int
    token_id: int
    step: dict | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


# An event's place among its generation's events (``Token.index`` for a token; for ``Done`` and
# ``Failed``, the tokens before it): what the agent link acknowledges and replays by.
EventIndex = Annotated[int, msgspec.Meta(ge=0)]


class Done(Message, kw_only=True, tag="generation_done"):
    """The generation ended: every token, why it ended (``stop``, ``length``, ``cancelled``), its figures.

    ``index``: how many tokens came before it (main leaves it None; main's agent numbers it).
    """

    TYPE: ClassVar[str] = "done"
    request_id: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict
    index: EventIndex | None = None


class Failed(Message, kw_only=True, tag="generation_failed"):
    """A generation ended without a result.

    ``retryable``: the same request can succeed shortly (main died and is being restarted),
    as opposed to one that cannot (a bad request); ``busy``: main's batch and queue were full,
    so it never started (ask again later); ``too_many_generations``: its user already had the
    most generations one user may have in main (``DeploymentSettings.max_per_user``), so it never started
    (send it when one of theirs ends); ``too_large``: the request is larger than a frame a hop on
    its way takes (the agent link's, ``inference.wire.link.frame_limit``), so it never went out
    and the same request fails again. ``index``: how many tokens came before it (as ``Done``'s).
    """

    TYPE: ClassVar[str] = "error"
    request_id: str
    error: str
    index: EventIndex | None = None
    retryable: bool = False
    busy: bool = False
    too_many_generations: bool = False
    too_large: bool = False


declared(Generate)
GENERATION_EVENTS = declared(Token, Done, Failed)
GenerationEvent = Token | Done | Failed
