"""Who may say what to whom on the data plane: principals, the sender rule, the permission table.

A *principal* is whoever holds one of a deployment's data-plane key pairs (``inference.runtime.curve``):
"main", "shadow" and "worker-<i>", one per role seat, and "client": whoever talks to a role
from outside the data plane (the agent on that role's box, the local launcher, the CLI). Every
seat has a client pair of its own, so at main "client" is main's client and nobody else: the
client secret on a worker's box admits nothing at main.

**The sender rule.** Every message names its sender in its envelope. A role believes it only
when it is the principal whose key delivered the message: on the role's inbox, the key its
CURVE handshake proved (the ZAP handler reports it with every message); on the role's link to
peer P, P itself, since the link holds P's public key as its server key and CURVE proves that
whoever answers holds P's secret. A role principal must say exactly its own name. The client's
holder runs several sockets at once (a probe, a generation each), which need distinct ROUTER
identities, so a client says "client" or "client:<suffix>".

**The permission table.** ``RULES`` says which message types a principal of one kind may send
to a role of another, and over which *channel*: ``INBOX`` (the sender connected to the
receiver's inbox) or ``LINK`` (the receiver linked to the sender, and this is the answer). It
is the traffic the roles exchange and nothing more (``inference/roles``: main links to its
workers and its shadow, the shadow to main and the workers, a client to its own role; workers
only answer). So a worker cannot shut down anyone, the shadow takes alignment only from main,
and main takes generations only from its own client. A role's inbox admits only the kinds
that may send on it (``admitted_kinds``); everything else fails the CURVE handshake.

Why a table of wire names: this module imports neither torch nor zmq (the control plane
derives who gets whose public keys from it, ``correspondents``), and a message type that is
added to ``inference.wire.runtime`` is refused everywhere until a rule says who may send it;
tests/inference/runtime/test_permissions.py checks that every name here is a real message type.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAIN, SHADOW, WORKER, CLIENT = "main", "shadow", "worker", "client"
KINDS = (MAIN, SHADOW, WORKER, CLIENT)
INBOX, LINK = "inbox", "link"
CLIENT_SEPARATOR = ":"

_WORKER = re.compile(r"worker-(0|[1-9][0-9]{0,3})")  # worker-0 .. worker-9999, no leading zeros
_CLIENT_SUFFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")

# (receiver kind, sender kind, channel) -> the message types (``Message.TYPE``) it may send.
RULES: dict[tuple[str, str, str], frozenset[str]] = {
    # Main: generations and their control from its client; predictions and statistics from
    # the shadow, on main's inbox; results, statistics and health from the roles it links to.
    (MAIN, CLIENT, INBOX): frozenset({"ping", "generate", "cancel", "set_alignment", "shutdown"}),
    (MAIN, SHADOW, INBOX): frozenset({"prediction", "predictions", "drafts", "shadow_stats"}),
    (MAIN, WORKER, LINK): frozenset({"pong", "expert_result", "worker_stats"}),
    (MAIN, SHADOW, LINK): frozenset({"pong"}),
    # The shadow: a sequence's emulation, its alignment and the stop come from main only.
    (SHADOW, MAIN, INBOX): frozenset(
        {"ping", "shadow_begin", "align", "draft_ask", "end", "set_alignment", "shutdown"}
    ),
    (SHADOW, CLIENT, INBOX): frozenset({"ping"}),
    # A worker: the session and its requests from main (main's own predictions too, under
    # next-gate, lru-offload and the prerouter), the shadow's predictions, its client's pings.
    (WORKER, MAIN, INBOX): frozenset(
        {"ping", "begin", "sequence_join", "sequence_leave", "expert_request", "prediction", "end", "shutdown"}
    ),
    (WORKER, SHADOW, INBOX): frozenset({"prediction", "predictions"}),
    (WORKER, CLIENT, INBOX): frozenset({"ping"}),
    # A client hears its role's answers: main streams generations, every role answers pings.
    (CLIENT, MAIN, LINK): frozenset({"pong", "token", "done", "error"}),
    (CLIENT, SHADOW, LINK): frozenset({"pong"}),
    (CLIENT, WORKER, LINK): frozenset({"pong"}),
}
NOTHING: frozenset[str] = frozenset()


class PrincipalError(ValueError):
    """A name that is no principal of a deployment's data plane."""


def principal_kind(principal: str) -> str:
    """main, shadow, worker or client: the kind of ``principal``; ``PrincipalError`` if it is none."""
    if principal in (MAIN, SHADOW, CLIENT):
        return principal
    if isinstance(principal, str) and _WORKER.fullmatch(principal):
        return WORKER
    raise PrincipalError(f"{principal!r:.60} is not a principal: main, shadow, worker-<i> or client")


def sender_kind(name: str) -> str:
    """The kind of an endpoint that sends as ``name``: a principal, or "client:<suffix>" (a client)."""
    if isinstance(name, str) and name.startswith(CLIENT + CLIENT_SEPARATOR):
        client_name(name.removeprefix(CLIENT + CLIENT_SEPARATOR))
        return CLIENT
    return principal_kind(name)


def client_name(suffix: str) -> str:
    """ "client:<suffix>": the name of one of a client holder's sockets (letters, digits, ``._-``)."""
    if not isinstance(suffix, str) or not _CLIENT_SUFFIX.fullmatch(suffix):
        raise PrincipalError(f"a client's name is client:<1 to 64 of A-Z a-z 0-9 . _ ->, not client:{suffix!r:.60}")
    return CLIENT + CLIENT_SEPARATOR + suffix


def sender_fits(principal: str | None, sender: str) -> bool:
    """Whether a message that says ``sender`` may come from ``principal`` (the sender rule)."""
    if principal is None:
        return False
    if sender == principal:
        return True
    return principal == CLIENT and sender.startswith("client:") and len(sender) > 7


def permitted(receiver_kind: str, sender_kind: str, channel: str) -> frozenset[str]:
    """The message types a ``sender_kind`` may send a ``receiver_kind`` over ``channel``."""
    return RULES.get((receiver_kind, sender_kind, channel), NOTHING)


def refusal(principal: str | None, sender: str, message_type: str, allowed: frozenset[str]) -> str:
    """Why a message is refused ("" when it is not): ``principal`` delivered it (None: no
    admitted key did), it says ``sender``, and ``allowed`` is what that principal may send here.

    The check every keyed endpoint runs on every message it receives, so it is two comparisons
    and a set lookup (``permitted`` is looked up once per principal, when it is admitted).
    """
    if not sender_fits(principal, sender):
        return f"it says it is from {sender!r:.40} but came with the key of {principal or 'no principal'}"
    if message_type not in allowed:
        return f"{principal} may not send it here"
    return ""


def admitted_kinds(receiver_kind: str) -> frozenset[str]:
    """The kinds of principal a ``receiver_kind``'s inbox admits: those that may send on it."""
    return frozenset(sender for (receiver, sender, channel) in RULES if receiver == receiver_kind and channel == INBOX)


def talks_with(kind: str, other: str) -> bool:
    """Whether principals of these kinds exchange any message, one way or the other."""
    return any({receiver, sender} == {kind, other} for receiver, sender, _ in RULES)


def correspondents(principal: str, roles: Iterable[str]) -> list[str]:
    """The role principals among ``roles`` that ``principal`` exchanges messages with (never
    itself), in the order given: whose public keys its role needs, besides its own client's."""
    kind = principal_kind(principal)
    return [role for role in roles if role != principal and talks_with(kind, principal_kind(role))]


def markdown_table() -> str:
    """``RULES`` as a Markdown table: receiver, sender, channel, message types."""
    lines = ["| to | from | over | message types |", "|---|---|---|---|"]
    for (receiver, sender, channel), types in RULES.items():
        lines.append(f"| {receiver} | {sender} | {channel} | {', '.join(sorted(types))} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m inference.runtime.permissions: the table for docs/data-plane-security.md
    print(markdown_table())
