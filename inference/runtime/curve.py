"""The data plane's keys: CurveZMQ, a key pair per role seat, so that a role knows who speaks.

Every role seat of a deployment (main, shadow, worker-<i>) has two CURVE key pairs
(``SeatKeys``): the role's own, and its *client*'s, held by whoever talks to that role from
outside the data plane (the agent on its box, the local launcher). Principals and who may
say what are ``inference.runtime.permissions``.

A role holds ``EndpointKeys``: its own pair, and by principal the public keys of those it
talks with (its deployment's roles that it sends to or hears from, and its own client). Its
inbox is a CURVE server with its pair; a ZAP handler in the role's process (``make_server``)
admits only the public keys of the principals that may send on that inbox, and reports with
every message the key that delivered it, so the transport checks the envelope's sender
against it. Each link is a CURVE client with the role's pair whose server key is the peer's
own public key, so CURVE itself proves who answers. A socket without an admitted secret key
cannot complete the handshake: a stranger on the network can neither read nor send anything,
however well formed, and a compromised box speaks only as the principals whose secrets it holds.

On the wire (a role's spec, ``inference.runtime.spec``) an ``EndpointKeys`` is
``{"pair": {"public": Z85, "secret": Z85}, "peers": {principal: Z85}}``;
``endpoint_keys_from_json`` checks every part of it (Z85 text of 40 characters, the pair's
halves belong together, principal names well formed, no public key twice).

Keys are made fresh for every start of a deployment (``new_seat_keys``): the control plane
keeps them per seat with the deployment's members, the local launcher per cluster.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from inference.runtime.permissions import CLIENT, PrincipalError, correspondents, principal_kind

log = logging.getLogger(__name__)

ZAP_DOMAIN = "odmoe"  # each inbox gets a domain of its own under it: "odmoe-<n>"
KEY_CHARS = 40  # a Z85-encoded 32-byte CURVE key
_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


class CurveError(ValueError):
    """Keys that cannot be used, with the reason."""


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, both halves Z85 text (40 characters)."""

    public: str
    secret: str

    def __repr__(self) -> str:  # the secret never reaches a log line or a traceback
        return f"CurveKeys(public={self.public!r}, secret=<hidden>)"


@dataclass(frozen=True)
class SeatKeys:
    """A role seat's two pairs: the role's own, and its client's."""

    role: CurveKeys
    client: CurveKeys


@dataclass(frozen=True)
class EndpointKeys:
    """What one endpoint holds: its own pair, and by principal the public keys of those it talks with."""

    pair: CurveKeys
    peers: dict[str, str]


def new_keys() -> CurveKeys:
    if not zmq.has("curve"):
        raise CurveError("this libzmq was built without CURVE; the data plane cannot be authenticated")
    public, secret = zmq.curve_keypair()
    return CurveKeys(public.decode("ascii"), secret.decode("ascii"))


def new_seat_keys(seats: Iterable[str]) -> dict[str, SeatKeys]:
    """Fresh pairs (the role's and its client's) for every role seat named in ``seats``."""
    made = {}
    for seat in seats:
        if principal_kind(seat) == CLIENT:
            raise CurveError("a client is no seat: every role seat has its own client pair")
        made[seat] = SeatKeys(role=new_keys(), client=new_keys())
    return made


def role_keys(seat: str, seats: Mapping[str, SeatKeys]) -> EndpointKeys:
    """The keys the role in ``seat`` holds: its pair, the public keys of the roles it talks with
    (``inference.runtime.permissions.correspondents``) and its own client's."""
    peers = {role: seats[role].role.public for role in correspondents(seat, seats)}
    peers[CLIENT] = seats[seat].client.public
    return EndpointKeys(seats[seat].role, peers)


def client_keys(seat: str, seats: Mapping[str, SeatKeys]) -> EndpointKeys:
    """The keys of ``seat``'s client: its client pair, and the public key of that role alone."""
    return EndpointKeys(seats[seat].client, {seat: seats[seat].role.public})


def check_public(value: object, what: str) -> str:
    """``value`` if it is a CURVE key as Z85 text, else ``CurveError`` naming ``what``."""
    if not isinstance(value, str) or len(value) != KEY_CHARS or not set(value) <= _Z85:
        raise CurveError(f"the CURVE {what} key must be {KEY_CHARS} characters of Z85 text")
    return value


def check_keys(keys: CurveKeys) -> CurveKeys:
    """Raise ``CurveError`` unless ``keys`` is a well-formed pair whose halves belong together."""
    for name in ("public", "secret"):
        check_public(getattr(keys, name), name)
    if zmq.curve_public(keys.secret.encode("ascii")).decode("ascii") != keys.public:
        raise CurveError("the CURVE public key does not belong to the secret key")
    return keys


def check_endpoint_keys(keys: EndpointKeys) -> EndpointKeys:
    """Raise ``CurveError`` unless ``keys`` is a usable pair and a table of principals' public keys."""
    check_keys(keys.pair)
    if not isinstance(keys.peers, dict):
        raise CurveError("peers must map principals to their public keys")
    seen = {keys.pair.public: "this endpoint"}
    for principal, public in keys.peers.items():
        try:
            principal_kind(principal)
        except PrincipalError as exc:
            raise CurveError(f"peers: {exc}") from None
        check_public(public, f"public key of {principal}'s")
        if public in seen:
            raise CurveError(f"peers: {principal} has the public key of {seen[public]}: every principal has its own")
        seen[public] = principal
    return keys


def endpoint_keys_from_json(data: object) -> EndpointKeys:
    """``EndpointKeys`` from ``{"pair": {"public", "secret"}, "peers": {principal: public}}``, checked."""
    if not isinstance(data, dict) or set(data) != {"pair", "peers"}:
        raise CurveError('the keys must be an object with exactly "pair" and "peers"')
    pair, peers = data["pair"], data["peers"]
    if not isinstance(pair, dict) or set(pair) != {"public", "secret"}:
        raise CurveError('"pair" must be an object with exactly "public" and "secret"')
    if not isinstance(peers, dict):
        raise CurveError('"peers" must be an object of principals and their public keys')
    return check_endpoint_keys(EndpointKeys(CurveKeys(pair["public"], pair["secret"]), dict(peers)))


# --- sockets ---------------------------------------------------------------------------------


def make_server(sock: zmq.Socket, pair: CurveKeys, admitted: Iterable[str]) -> str:
    """Make ``sock`` (before it binds) a CURVE server with ``pair`` that admits only the public
    keys ``admitted``; returns its ZAP domain (for ``forget`` when the socket closes)."""
    domain = _guard(sock.context).admit(set(admitted))
    sock.curve_server = True
    sock.curve_secretkey = pair.secret.encode("ascii")
    sock.curve_publickey = pair.public.encode("ascii")
    sock.zap_domain = domain.encode("ascii")
    return domain


def make_client(sock: zmq.Socket, pair: CurveKeys, server_public: str) -> None:
    """Make ``sock`` (before it connects) a CURVE client presenting ``pair`` to the server whose
    public key is ``server_public``: only the holder of its secret can answer."""
    sock.curve_serverkey = server_public.encode("ascii")
    sock.curve_publickey = pair.public.encode("ascii")
    sock.curve_secretkey = pair.secret.encode("ascii")


def forget(context: zmq.Context, domain: str) -> None:
    """The inbox of ``domain`` is closed: its admitted keys go with it."""
    with _lock:
        found = _guards.get(id(context))
    if found is not None:
        found.forget(domain)


class _Guard:
    """The ZAP decisions of one context: per inbox (its own domain), the client keys it admits.

    pyzmq's ``ThreadAuthenticator`` runs the ZAP handshake in a thread of its own and asks
    ``callback`` for each connecting key; on success it reports the key (Z85) as the User-Id
    of every message that connection delivers, which is how the transport knows its principal.
    """

    def __init__(self, context: zmq.Context) -> None:
        self.authenticator = ThreadAuthenticator(context, log=log)
        self.authenticator.start()
        self.admitted: dict[str, frozenset[bytes]] = {}  # domain -> Z85 keys, as pyzmq hands them over
        self._domains = itertools.count(1)

    def admit(self, keys: set[str]) -> str:
        domain = f"{ZAP_DOMAIN}-{next(self._domains)}"
        self.admitted[domain] = frozenset(key.encode("ascii") for key in keys)
        self.authenticator.configure_curve_callback(domain=domain, credentials_provider=self)
        return domain

    def forget(self, domain: str) -> None:
        # The domain stays configured (the ZAP thread may be reading the providers right now);
        # with no keys left it admits nobody.
        self.admitted.pop(domain, None)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.admitted.get(domain, ()):
            return True
        log.warning("refused a data-plane connection: its CURVE key is not one this role admits")
        return False


_lock = threading.Lock()
_guards: dict[int, _Guard] = {}


def _guard(context: zmq.Context) -> _Guard:
    with _lock:
        found = _guards.get(id(context))
        if found is None:
            found = _guards[id(context)] = _Guard(context)
        return found
