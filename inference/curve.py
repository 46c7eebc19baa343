"""The data plane's keys: CurveZMQ, so that only a deployment's own roles can talk to them.

Every deployment has one CURVE key pair (``CurveKeys``), handed to each of its roles in the
role spec and to whoever must talk to main (the agent on main's box, the local launcher).
A role's inbox is a CURVE server with that pair; every link is a CURVE client with it.
Messages are encrypted and authenticated by libzmq, and a ZAP handler in each role process
(``allow``) admits only clients that present the deployment's public key: a socket without
the secret key cannot complete the handshake, so a stranger on the network can neither read
nor send anything, however well formed.

The control plane makes a new pair on every start of a deployment (``new_keys``) and keeps
it with the deployment; the local launcher makes an ephemeral pair per cluster.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

ZAP_DOMAIN = "odmoe"
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


def new_keys() -> CurveKeys:
    if not zmq.has("curve"):
        raise CurveError("this libzmq was built without CURVE; the data plane cannot be authenticated")
    public, secret = zmq.curve_keypair()
    return CurveKeys(public.decode("ascii"), secret.decode("ascii"))


def check_keys(keys: CurveKeys) -> CurveKeys:
    """Raise ``CurveError`` unless ``keys`` is a well-formed pair whose halves belong together."""
    for name in ("public", "secret"):
        value = getattr(keys, name)
        if not isinstance(value, str) or len(value) != KEY_CHARS or not set(value) <= _Z85:
            raise CurveError(f"the CURVE {name} key must be {KEY_CHARS} characters of Z85 text")
    if zmq.curve_public(keys.secret.encode("ascii")).decode("ascii") != keys.public:
        raise CurveError("the CURVE public key does not belong to the secret key")
    return keys


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server that the ZAP handler guards."""
    allow(sock.context, keys.public)
    sock.curve_server = True
    sock.curve_secretkey = keys.secret.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.zap_domain = ZAP_DOMAIN.encode("ascii")


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of a server holding ``keys``."""
    sock.curve_serverkey = keys.public.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.curve_secretkey = keys.secret.encode("ascii")


class _Allowed:
    """The ZAP decision of one process: a client is let in only with a public key allowed here."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()  # Z85, as pyzmq hands a client's key to the callback

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        log.warning("refused a data-plane connection: its CURVE key is not this deployment's")
        return False


_lock = threading.Lock()
_authenticators: dict[int, tuple[ThreadAuthenticator, _Allowed]] = {}


def allow(context: zmq.Context, public: str) -> None:
    """Admit clients presenting ``public`` to the CURVE servers of ``context`` (one ZAP thread each)."""
    with _lock:
        found = _authenticators.get(id(context))
        if found is None:
            authenticator, allowed = ThreadAuthenticator(context, log=log), _Allowed()
            authenticator.start()
            authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allowed)
            _authenticators[id(context)] = found = (authenticator, allowed)
        found[1].keys.add(public.encode("ascii"))
