"""What travels on the agent link: events up (agent to control plane), commands down.

One module that both sides import. Every message is a frozen ``msgspec.Struct``; on the wire
it is a JSON object ``{"type": tag, ...fields}``. ``parse`` validates an arriving object by
msgspec's strict conversion and raises ``MessageError`` with the reason, so a receiver never
acts on a malformed message. A generation's request and events are the runtime's own
(``inference.wire.generation``): the agent forwards them as main sent them.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

import msgspec

from inference.wire.base import WireStruct, declared
from inference.wire.generation import GENERATION_EVENTS, Generate

LINK_PATH = "/ws/agent"
# The version of what travels here: an agent reports it in its inventory, and the control plane
# turns away, with the command that upgrades it, an agent whose protocol it does not take (from
# ``OLDEST_AGENT_PROTOCOL`` to ``AGENT_PROTOCOL``).
# 2: GenerationFailed.too_many_generations, and main enforces DeploymentSettings.max_per_user (the control
# plane no longer caps a user's generations itself, so it takes no agent whose main does not).
# 3: a key pair per role seat (``StartRole.client_keys``, and the spec's keys per role).
# 4: a generation's request and events are the runtime's messages (``inference.wire.generation``),
# forwarded as they are: ``generate`` and the ``generation_*`` events carry the runtime's envelope
# (``deployment``, ``sender``, ``seq``, ``deliver_at``) too, which a control plane of 3 refuses.
# 5: logprobs (``Generate.logprobs``, ``top_logprobs``, ``prompt_logprobs``; ``Token.logprob``,
# ``prompt_logprobs``). Every message refuses unknown fields and msgspec writes every field, so
# an agent (and its main) of 4 would refuse the control plane's ``generate``, and a control plane
# of 4 a new main's tokens: not compatible, whatever the defaults.
# 6: ``Generate.step_reports`` (the control plane asks for step reports only while a console
# watches), which an agent of 5 refuses.
# 7: the agent announces the largest frame it takes (``FRAME_LIMIT_HEADER``), and the control
# plane sends no bigger one: a command that would not fit fails alone, never the link
# (``Failed.too_large`` for a generation). The control plane announces its own in its answer
# (``SERVER_FRAME_LIMIT_HEADER``), and the agent keeps what it sends up within it; an agent that
# announces nothing is held to websockets' default (``LEGACY_FRAME_LIMIT``). ``Generate`` carries
# ``prefix_namespace`` (main's prefix cache is keyed per tenant), which an agent of 6 refuses.
# 8: a dropped link loses no generation event. The agent keeps a generation's events until the
# control plane acknowledges them (``Acknowledge``, a command an agent of 7 refuses) and sends them
# again after reconnecting; ``Done`` and ``Failed`` carry their place (``index``) as tokens do.
AGENT_PROTOCOL = 8
OLDEST_AGENT_PROTOCOL = 8  # the oldest protocol whose agents the control plane still takes
FIRST_AGENT_PROTOCOL = 1  # what an agent that sends no protocol header speaks
PROTOCOL_HEADER = "X-Odmoe-Agent-Protocol"  # how the agent says it when it connects
VERSION_HEADER = "X-Odmoe-Agent-Version"
FRAME_LIMIT_HEADER = "X-Odmoe-Agent-Max-Frame"  # the most bytes one frame to the agent may hold (from 7)
SERVER_FRAME_LIMIT_HEADER = "X-Odmoe-Server-Max-Frame"  # the same for the control plane, in its answer (from 7)
LEGACY_FRAME_LIMIT = 2**20  # what an agent that announces no limit takes: websockets' default max_size
CLOSE_PROTOCOL_MISMATCH = 4426  # the websocket close code for "upgrade the agent"
CLOSE_UNAUTHENTICATED = 4401  # the websocket close code for "this node's credential is not (or no longer) valid"

# A figure a role reports (its memory, in bytes): a count, never negative.
Figure = Annotated[int, msgspec.Meta(ge=0)]


class MessageError(ValueError):
    """An object that is not a valid agent-link message."""


def loads(text: str | bytes) -> Any:
    """A frame's JSON. ``NaN`` and ``Infinity``, and numbers too large for a float (``1e999``,
    which Python reads as infinity), are refused (``ValueError``, as for any text that is not
    JSON): a database's JSON column refuses them, so an inventory holding one could never be
    recorded."""
    return json.loads(text, parse_constant=_not_a_json_number, parse_float=_finite_float)


def _not_a_json_number(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is past what a float holds")
    return value


def frame_bytes(text: str) -> int:
    """The bytes a text frame takes on the wire (UTF-8; JSON as both sides write it is ASCII)."""
    return len(text) if text.isascii() else len(text.encode(errors="surrogatepass"))


def frame_limit(announced: str | None) -> int:
    """The most bytes one frame to an agent may hold, from what it announced (``FRAME_LIMIT_HEADER``,
    a decimal number of bytes): ``LEGACY_FRAME_LIMIT`` when it announced nothing.
    The agent reads the control plane's (``SERVER_FRAME_LIMIT_HEADER``) the same way.
    ``MessageError`` for an announcement that is no such number: nothing is known to fit."""
    if announced is None:
        return LEGACY_FRAME_LIMIT
    if not announced.isascii() or not announced.isdigit() or len(announced) > 18 or int(announced) < 1:
        raise MessageError(f"{FRAME_LIMIT_HEADER} must be a number of bytes, not {announced!r:.24}")
    return int(announced)


class LinkMessage(WireStruct, kw_only=True):
    """Base of the messages that travel only on the agent link."""


# --- events: agent -> control plane ---------------------------------------------------


class Heartbeat(LinkMessage, kw_only=True, tag="heartbeat"):
    """Sent on connect and every few seconds: the box's inventory and the state of every role it
    runs (``RoleState`` as JSON; a box with several GPUs can run a role on each)."""

    inventory: dict
    roles: list[dict] = msgspec.field(default_factory=list)


class LinkPong(LinkMessage, kw_only=True, tag="pong"):
    """The agent's answer to a ``LinkPing`` (the link's own; a role's health answer is
    ``inference.wire.runtime.Pong``)."""

    nonce: str


class CredentialSaved(LinkMessage, kw_only=True, tag="credential_saved"):
    """The node credential of a ``RotateCredential`` is on disk: the control plane may forget the old one."""


class TaskProgress(LinkMessage, kw_only=True, tag="task_progress"):
    """How far a command's work has come (e.g. bytes of a shard downloaded)."""

    task_id: str
    done: int
    total: int


class TaskDone(LinkMessage, kw_only=True, tag="task_done"):
    """A command's work ended: ``ok`` or not, with the reason."""

    task_id: str
    ok: bool
    detail: str = ""


class RoleState(LinkMessage, kw_only=True, tag="role_state"):
    """A runtime role this box runs changed state (also sent in every heartbeat).

    ``role_name`` says which of the deployment's roles (main, shadow, worker-N); ``state`` is
    one of ``ROLE_STATES``; ``detail`` says why for ``failed``, and what is being waited for
    otherwise.
    """

    deployment: str
    role: str
    state: str
    role_name: str = ""
    detail: str = ""
    metrics: dict = msgspec.field(default_factory=dict)  # main: figures of its last generation (RUNTIME_METRICS)
    memory: dict[str, Figure] = msgspec.field(
        default_factory=dict
    )  # MEMORY_FIGURES when the role last answered; {} before


class LinkPing(LinkMessage, kw_only=True, tag="ping"):
    """Is the agent there? It answers ``LinkPong`` with the same nonce."""

    nonce: str


class RotateCredential(LinkMessage, kw_only=True, tag="rotate_credential"):
    """Store ``node_secret`` as this node's credential from now on and answer ``CredentialSaved``."""

    node_secret: str


class FetchShard(LinkMessage, kw_only=True, tag="fetch_shard"):
    """Download (or resume) role ``role`` of model ``model_id``; idempotent per ``task_id``."""

    task_id: str
    model_id: int
    role: str


class StartRole(LinkMessage, kw_only=True, tag="start_role"):
    """Fetch shard ``shard`` of model ``model_id`` (progress under ``task_id``), then run the role.

    ``spec`` is the role's ``inference.runtime.spec.RoleSpec`` as JSON, without ``shard_dir``: the
    agent fills in where it keeps the shard. ``client_keys`` (``{"public", "secret"}``) is the
    role seat's client pair (``inference.runtime.curve``), which the agent talks to its role with: its
    health probes, and on main's box the generations. Idempotent: a box already running (or
    starting) this role of this deployment ignores the repeat.
    """

    task_id: str
    deployment: str
    model_id: int
    shard: str
    spec: dict
    client_keys: dict

    def __repr__(self) -> str:  # the spec and the client keys hold secrets: never in a log line
        return (
            f"StartRole(task_id={self.task_id!r}, deployment={self.deployment!r}, model_id={self.model_id!r}, "
            f"shard={self.shard!r}, spec=<hidden>, client_keys=<hidden>)"
        )


class StopRole(LinkMessage, kw_only=True, tag="stop_role"):
    """Stop role ``role_name`` of ``deployment`` (every role of it: "") if this box runs it; idempotent."""

    deployment: str
    role_name: str = ""


# msgspec messages, declarations one per line: alike TaskProgress's and TaskDone's by shape.
class ApplyAlignment(LinkMessage, kw_only=True, tag="apply_alignment"):
    """New alignment periods for the running main of ``deployment``: no restart."""

    deployment: str
    token_period: int
    kv_period: int


class CancelGeneration(LinkMessage, kw_only=True, tag="cancel_generation"):
    request_id: str


MAX_ACKS = 4096  # the most generations one ``Acknowledge`` names


class Acknowledge(LinkMessage, kw_only=True, tag="acknowledge"):
    """The control plane handed on each named generation's events up to and including
    ``(request_id, index)`` (``Token.index``, ``Done.index``, ``Failed.index``): the agent forgets
    them, and a generation whose end is acknowledged altogether. What is not acknowledged when the
    link drops is sent again on the next one."""

    acks: Annotated[list[tuple[str, Annotated[int, msgspec.Meta(ge=0)]]], msgspec.Meta(max_length=MAX_ACKS)]


# The figures of a generation that main's agent reports with its role state (the rest,
# per step and per layer, stays with the caller of that generation).
RUNTIME_METRICS = (
    "ttft_ms",
    "decode_tok_s",
    "e2e_tok_s",
    "recall",
    "prediction_in_time",
    "prompt_tokens",
    "generated_tokens",
    "token_period",
    "kv_period",
    "expert_bytes",
    "decode_layer_coordination_ms_median",
    "recall_per_layer",
    "groups",
    # What an approximate strategy did, and what a prediction missed (None where it does not apply).
    "late_experts_per_token",
    "cache_hit_rate",
    "substitutions_per_token",
    "router_agreement",
    "disk_reads",
    # What drafting did: passes, drafts verified and kept, tokens per pass, distinct experts per
    # layer per pass (absent without drafts).
    "drafts",
)
# The memory a running role reports with its state, in bytes (``inference.wire.runtime.Pong``):
# its process's resident set now and at its peak, and what it holds on its GPU (0 on a CPU).
MEMORY_FIGURES = ("host_bytes", "peak_host_bytes", "device_bytes")
ROLE_STATES = ("fetching", "starting", "ready", "failed", "stopped")
EVENTS = declared(Heartbeat, LinkPong, CredentialSaved, TaskProgress, TaskDone, RoleState, *GENERATION_EVENTS)
COMMANDS = declared(
    LinkPing, RotateCredential, FetchShard, StartRole, StopRole, ApplyAlignment, Generate, CancelGeneration, Acknowledge
)


LINK_MESSAGES = (*EVENTS, *COMMANDS)


def parse(obj: Any, *, allowed: tuple[type[WireStruct], ...]) -> WireStruct:
    """The message ``obj`` encodes, if it is one of ``allowed``; else MessageError."""
    if not isinstance(obj, dict):
        raise MessageError("a message must be a JSON object")
    tag = obj.get("type")
    if type(tag) is not str or tag not in _TAGS or _TAGS[tag] not in allowed:
        raise MessageError(f"unexpected message type {tag!r:.40}")
    try:
        return msgspec.convert(obj, _TAGS[tag], strict=True)
    except msgspec.ValidationError as exc:
        raise MessageError(f"{tag}: {exc}") from None


_TAGS = {cls.TAG: cls for cls in LINK_MESSAGES}
assert len(_TAGS) == len(LINK_MESSAGES), "two link messages share a tag"
