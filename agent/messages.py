"""What travels on the agent link: events up (agent to control plane), commands down.

One module that both sides import. Every message is a frozen dataclass with a ``TYPE``;
on the wire it is a JSON object ``{"type": TYPE, ...fields}``. ``parse`` validates an
arriving object against the declared field types and raises ``MessageError`` with the
reason, so a receiver never acts on a malformed message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from inference.generation_fields import GenerationFields
from inference.typecheck import checker

LINK_PATH = "/ws/agent"
# The version of what travels here: an agent reports it in its inventory, and the control plane
# turns away, with the command that upgrades it, an agent whose protocol is not its own.
# 2: GenerationFailed.too_many_generations, and main enforces Settings.max_per_user (the control
# plane no longer caps a user's generations itself, so it takes no agent whose main does not).
# 3: a key pair per role seat (``StartRole.client_keys``, and the spec's keys per role).
AGENT_PROTOCOL = 3
FIRST_AGENT_PROTOCOL = 1  # what an agent that sends no protocol header speaks
PROTOCOL_HEADER = "X-Odmoe-Agent-Protocol"  # how the agent says it when it connects
VERSION_HEADER = "X-Odmoe-Agent-Version"
CLOSE_PROTOCOL_MISMATCH = 4426  # the websocket close code for "upgrade the agent"


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


@dataclass(frozen=True, kw_only=True)
class LinkMessage:
    TYPE: ClassVar[str] = ""

    def to_json(self) -> dict:
        return {"type": self.TYPE, **dataclasses.asdict(self)}


_REGISTRY: dict[str, type[LinkMessage]] = {}


def _register(cls: type[LinkMessage]) -> type[LinkMessage]:
    assert cls.TYPE and cls.TYPE not in _REGISTRY, cls
    _REGISTRY[cls.TYPE] = cls
    return cls


# --- events: agent -> control plane ---------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class Heartbeat(LinkMessage):
    """Sent on connect and every few seconds: the box's inventory and the state of every role it
    runs (``RoleState`` as JSON; a box with several GPUs can run a role on each)."""

    TYPE = "heartbeat"
    inventory: dict
    roles: list[dict] = field(default_factory=list)


@_register
@dataclass(frozen=True, kw_only=True)
class Pong(LinkMessage):
    TYPE = "pong"
    nonce: str


@_register
@dataclass(frozen=True, kw_only=True)
class CredentialSaved(LinkMessage):
    """The node credential of a ``RotateCredential`` is on disk: the control plane may forget the old one."""

    TYPE = "credential_saved"


@_register
@dataclass(frozen=True, kw_only=True)
class TaskProgress(LinkMessage):
    """How far a command's work has come (e.g. bytes of a shard downloaded)."""

    TYPE = "task_progress"
    task_id: str
    done: int
    total: int


@_register
@dataclass(frozen=True, kw_only=True)
class TaskDone(LinkMessage):
    """A command's work ended: ``ok`` or not, with the reason."""

    TYPE = "task_done"
    task_id: str
    ok: bool
    detail: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class RoleState(LinkMessage):
    """A runtime role this box runs changed state (also sent in every heartbeat).

    ``role_name`` says which of the deployment's roles (main, shadow, worker-N); ``state`` is
    one of ``ROLE_STATES``; ``detail`` says why for ``failed``, and what is being waited for
    otherwise.
    """

    TYPE = "role_state"
    deployment: str
    role: str
    state: str
    role_name: str = ""
    detail: str = ""
    metrics: dict = field(default_factory=dict)  # main: figures of its last generation (RUNTIME_METRICS)
    memory: dict[str, int] = field(default_factory=dict)  # MEMORY_FIGURES when the role last answered; {} before


@_register
@dataclass(frozen=True, kw_only=True)
class GenerationToken(LinkMessage):
    TYPE = "generation_token"
    request_id: str
    index: int
    token_id: int
    step: dict | None = None  # what the step did per layer (inference.metrics.step_report)


@_register
@dataclass(frozen=True, kw_only=True)
class GenerationDone(LinkMessage):
    TYPE = "generation_done"
    request_id: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict


@_register
@dataclass(frozen=True, kw_only=True)
class GenerationFailed(LinkMessage):
    """A generation ended without a result; ``retryable``: the same request can succeed shortly
    (main died and is being restarted), as opposed to one that cannot (a bad request);
    ``busy``: main's batch and queue were full, so it never started (ask again later);
    ``too_many_generations``: its user already had the most generations one user may have in
    main (``Settings.max_per_user``), so it never started (send it when one of theirs ends)."""

    TYPE = "generation_failed"
    request_id: str
    error: str
    retryable: bool = False
    busy: bool = False
    too_many_generations: bool = False


# --- commands: control plane -> agent ---------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class Ping(LinkMessage):
    TYPE = "ping"
    nonce: str


@_register
@dataclass(frozen=True, kw_only=True)
class RotateCredential(LinkMessage):
    """Store ``node_secret`` as this node's credential from now on and answer ``CredentialSaved``."""

    TYPE = "rotate_credential"
    node_secret: str


@_register
@dataclass(frozen=True, kw_only=True)
class FetchShard(LinkMessage):
    """Download (or resume) role ``role`` of model ``model_id``; idempotent per ``task_id``."""

    TYPE = "fetch_shard"
    task_id: str
    model_id: int
    role: str


@_register
@dataclass(frozen=True, kw_only=True)
class StartRole(LinkMessage):
    """Fetch shard ``shard`` of model ``model_id`` (progress under ``task_id``), then run the role.

    ``spec`` is the role's ``inference.spec.RoleSpec`` as JSON, without ``shard_dir``: the
    agent fills in where it keeps the shard. ``client_keys`` (``{"public", "secret"}``) is the
    role seat's client pair (``inference.curve``), which the agent talks to its role with: its
    health probes, and on main's box the generations. Idempotent: a box already running (or
    starting) this role of this deployment ignores the repeat.
    """

    TYPE = "start_role"
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


@_register
@dataclass(frozen=True, kw_only=True)
class StopRole(LinkMessage):
    """Stop role ``role_name`` of ``deployment`` (every role of it: "") if this box runs it; idempotent."""

    TYPE = "stop_role"
    deployment: str
    role_name: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class ApplyAlignment(LinkMessage):
    """New alignment periods for the running main of ``deployment``: no restart."""

    TYPE = "apply_alignment"
    deployment: str
    token_period: int
    kv_period: int


@_register
@dataclass(frozen=True, kw_only=True)
class Generate(LinkMessage, GenerationFields):
    """Run a generation on this box's main role (its fields: ``inference.generation_fields``);
    tokens come back as GenerationToken events."""

    TYPE = "generate"
    request_id: str
    deployment: str


@_register
@dataclass(frozen=True, kw_only=True)
class CancelGeneration(LinkMessage):
    TYPE = "cancel_generation"
    request_id: str


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
)
# The memory a running role reports with its state, in bytes (``inference.protocol.Pong``):
# its process's resident set now and at its peak, and what it holds on its GPU (0 on a CPU).
MEMORY_FIGURES = ("host_bytes", "peak_host_bytes", "device_bytes")
ROLE_STATES = ("fetching", "starting", "ready", "failed", "stopped")
GENERATION_EVENTS = (GenerationToken, GenerationDone, GenerationFailed)
EVENTS = (Heartbeat, Pong, CredentialSaved, TaskProgress, TaskDone, RoleState, *GENERATION_EVENTS)
COMMANDS = (Ping, RotateCredential, FetchShard, StartRole, StopRole, ApplyAlignment, Generate, CancelGeneration)


def parse(obj: Any, *, allowed: tuple[type[LinkMessage], ...]) -> LinkMessage:
    """The message ``obj`` encodes, if it is one of ``allowed``; else MessageError."""
    if not isinstance(obj, dict):
        raise MessageError("a message must be a JSON object")
    cls = _REGISTRY.get(obj.get("type")) if isinstance(obj.get("type"), str) else None
    if cls is None or cls not in allowed:
        raise MessageError(f"unexpected message type {obj.get('type')!r:.40}")
    values = {}
    for name, (check, required) in _fields(cls).items():
        if name not in obj:
            if required:
                raise MessageError(f"{cls.TYPE}: field {name!r} missing")
            continue
        if not check(obj[name]):
            raise MessageError(f"{cls.TYPE}: field {name!r} has a bad value {obj[name]!r:.60}")
        values[name] = obj[name]
    unknown = set(obj) - set(values) - {"type"} - set(_fields(cls))
    if unknown:
        raise MessageError(f"{cls.TYPE}: unknown field {sorted(unknown)[0]!r:.40}")
    return cls(**values)


@functools.cache
def _fields(cls: type[LinkMessage]) -> dict[str, tuple]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: (
            _checker(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    }


def _checker(hint: Any):
    """``inference.typecheck.checker``, and for ``dict[str, int]`` each key and value too
    (figures such as a role's memory: counts, never negative)."""
    if typing.get_origin(hint) is dict and typing.get_args(hint) == (str, int):
        return lambda v: type(v) is dict and all(type(k) is str and type(x) is int and x >= 0 for k, x in v.items())
    return checker(hint)
