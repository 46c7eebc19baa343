"""One generation, at every hop: the request and its events.

The control plane sends a ``Generate`` down the agent link; the agent hands it as it is to
main over ZeroMQ; main answers with ``Token`` events and one ``Done``, or one ``Failed``, which
the agent forwards as they are up the link, and the control plane hands on through its
channel layer to the OpenAI API's SSE and the chat's websocket. A new sampling option is
one new field here.

Each class has two tags, the ones its frames had before it was declared once: the agent
link's ``"type"`` (the msgspec tag, e.g. ``"generation_token"``) and the ZeroMQ header's
``"t"`` (``TYPE``, e.g. ``"token"``).
"""

from __future__ import annotations

from typing import ClassVar

from inference.wire.base import Message, declared


class Generate(Message, kw_only=True, tag="generate"):
    """A generation for main to run; ``deployment`` is the deployment's runtime key.

    Greedy unless ``do_sample``. ``user`` says who asked (an opaque id, e.g. the control
    plane's user id): main shares its batch fairly between users, so that one user's many
    requests do not keep another's waiting, and caps what one user has in it.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    user: str = ""


class Token(Message, kw_only=True, tag="generation_token"):
    """A generated token, with what the step that made it did per layer (``metrics.step_report``)."""

    TYPE: ClassVar[str] = "token"
    request_id: str
    index: int
    token_id: int
    step: dict | None = None


class Done(Message, kw_only=True, tag="generation_done"):
    """The generation ended: every token, why it ended (``stop``, ``length``, ``cancelled``), its figures."""

    TYPE: ClassVar[str] = "done"
    request_id: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict


class Failed(Message, kw_only=True, tag="generation_failed"):
    """A generation ended without a result.

    ``retryable``: the same request can succeed shortly (main died and is being restarted),
    as opposed to one that cannot (a bad request); ``busy``: main's batch and queue were full,
    so it never started (ask again later); ``too_many_generations``: its user already had the
    most generations one user may have in main (``Settings.max_per_user``), so it never started
    (send it when one of theirs ends).
    """

    TYPE: ClassVar[str] = "error"
    request_id: str
    error: str
    retryable: bool = False
    busy: bool = False
    too_many_generations: bool = False


declared(Generate)
GENERATION_EVENTS = declared(Token, Done, Failed)
GenerationEvent = Token | Done | Failed
