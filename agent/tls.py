"""How an agent reaches its control plane: https off the box, and a self-signed server trusted by its pin.

Off the box everything goes over TLS: the join token, the node credential, role specs (which
hold the data plane's secret keys), prompts and shards. Plain ``http://`` is for loopback
(``manage.py up``); anywhere else the agent refuses it before any traffic, unless ``--insecure``
says this is a lab network, and then it says loudly what travels in clear.

**Pins.** A control plane behind a self-signed certificate is trusted by a pin: the SHA-256 of
its certificate's SubjectPublicKeyInfo, written as curl's ``--pinnedpubkey`` takes it
(``sha256//<base64>``), so one pin serves the install one-liner and the agent. The join token
carries it (``odmoe-join-<secret>.<pin in base64url>``). On first contact the agent does a TLS
handshake only, compares the certificate's pin with the token's and keeps the certificate
beside its credential (``server.pem``, mode 0600; the pin goes into ``node.json``). From then on
every connection (requests, shard downloads, the link's websocket, the doctor) trusts the
server's own certificates alone, so OpenSSL refuses any other server during the handshake,
before the credential is sent. When the server's certificate stops verifying (the proxy renewed
it, or another proxy sharing the key answered) the agent looks again: a certificate with the
same key not seen before is kept beside the others (the newest ``KEPT_CERTIFICATES``); another
key is refused, with what to do. Without a pin, https uses the system's certificate authorities.

Why the pin replaces the host name check: a self-signed certificate names whatever its maker
typed, and the boxes reach the server by whatever address they were given; the key is what
identifies the server. Pure decisions (URL policy, pin and token formats, the commands a person
runs) come first; ``ServerTrust`` holds the effects.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import logging
import socket
import ssl
import threading
import urllib.error
import urllib.request
from http.client import HTTPResponse
from pathlib import Path
from urllib.parse import urlparse

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent import credentials

log = logging.getLogger(__name__)

PIN_PREFIX = "sha256//"
TOKEN_PIN_SEPARATOR = "."  # not in a token secret's alphabet (secrets.token_urlsafe)
PROBE_TIMEOUT_S = 10.0
KEPT_CERTIFICATES = 4  # certificates with the pinned key trusted at once, the newest kept
CLEAR_TEXT = "the join token, this node's credential, role specs with the data plane's secret keys, prompts and shards"


class TrustError(RuntimeError):
    """The server is not the one this agent trusts (another key), or cannot be trusted; the message says what to do."""


# --- pure decisions -------------------------------------------------------------------------------


def pin_of_der(certificate: bytes) -> str:
    """The pin of a DER certificate: SHA-256 of its SubjectPublicKeyInfo, as ``curl --pinnedpubkey`` takes it."""
    spki = (
        x509.load_der_x509_certificate(certificate)
        .public_key()
        .public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    )
    return PIN_PREFIX + base64.b64encode(hashlib.sha256(spki).digest()).decode()


def pin_of_pem(certificate: str | bytes) -> str:
    """The pin of the first certificate of a PEM text (a proxy's file may hold its chain after it)."""
    data = certificate.encode() if isinstance(certificate, str) else certificate
    return pin_of_der(x509.load_pem_x509_certificate(data).public_bytes(Encoding.DER))


def pin_digest(pin: str) -> bytes:
    """The 32 bytes a pin names; ValueError, saying what a pin looks like, for anything else."""
    error = ValueError(f"{pin!r:.80} is not a pin: expected sha256// and the base64 of a SHA-256 digest")
    if not pin.startswith(PIN_PREFIX):
        raise error
    try:
        digest = base64.b64decode(pin[len(PIN_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise error from None
    if len(digest) != 32:
        raise error
    return digest


def check_pin(pin: str) -> str:
    """``pin`` in its one spelling (``sha256//`` and 44 base64 characters), or ValueError."""
    return PIN_PREFIX + base64.b64encode(pin_digest(pin.strip())).decode()


def join_token(secret: str, pin: str) -> str:
    """The join token a person copies: the secret, and the server's pin when it has one."""
    if not pin:
        return secret
    encoded = base64.urlsafe_b64encode(pin_digest(pin)).rstrip(b"=").decode()
    return f"{secret}{TOKEN_PIN_SEPARATOR}{encoded}"


def split_join_token(token: str) -> tuple[str, str]:
    """(secret, pin or "") of a join token; a token from before pins carries none. ValueError
    when the part after the separator is not a pin (the token was cut or mistyped)."""
    secret, separator, encoded = token.partition(TOKEN_PIN_SEPARATOR)
    if not separator:
        return token, ""
    bad = ValueError("the join token's pin part is damaged: copy the token whole from the console")
    if len(encoded) != 43:
        raise bad
    try:
        digest = base64.urlsafe_b64decode(encoded + "=")
    except (binascii.Error, ValueError):
        raise bad from None
    if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != encoded:
        raise bad  # characters outside base64url, which the decoder skips
    return secret, PIN_PREFIX + base64.b64encode(digest).decode()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this box: ``localhost``, 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def in_clear_off_the_box(server: str) -> bool:
    """Whether talking to ``server`` sends everything in clear over a network (http, not loopback)."""
    parsed = urlparse(server)
    return parsed.scheme == "http" and not is_loopback(parsed.hostname or "")


def check_server_url(server: str, *, insecure: bool = False) -> str:
    """``server`` without a trailing slash, or ValueError: it must be an http(s) URL with a host,
    and plain http only on loopback unless ``insecure``."""
    parsed = urlparse(server.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--server must be an http(s) URL with a host, e.g. https://10.0.0.1, got {server!r}")
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"--server {server!r} has a port that is not a number") from None
    if parsed.query or parsed.fragment or parsed.username or parsed.password:
        raise ValueError(f"--server must be the control plane's base URL, without a query or user, got {server!r}")
    if in_clear_off_the_box(server) and not insecure:
        host = parsed.hostname
        raise ValueError(
            f"refusing plain http to {host}: off this box the control plane is reached over https, "
            f"since {CLEAR_TEXT} would travel in clear. Use https://{parsed.netloc}{parsed.path.rstrip('/')} "
            "(behind the TLS proxy), or add --insecure on a lab network you trust"
        )
    return server.strip().rstrip("/")


def clear_text_warning(server: str) -> str:
    """What an agent logs at start and at each connection when it talks plain http off the box."""
    return f"--insecure: plain http to {server}: {CLEAR_TEXT} travel in clear over the network"


def install_command(server: str, pin: str = "", *, token: str = "") -> str:
    """The command that installs (``token``: and enrolls) the agent from ``server``; with a pin,
    curl checks the server's key itself (``-k`` only drops the CA check the pin replaces). The
    token goes in the environment, not on sh's command line (kept out of the process list)."""
    server = server.rstrip("/")
    pinned = pin and urlparse(server).scheme == "https"
    curl = f"curl -fsSL --pinnedpubkey '{pin}' -k" if pinned else "curl -fsSL"
    fetch = f"{curl} {server}/agent/install.sh"
    if not token:
        return f"{fetch} | sh"
    return f"{fetch} | ODMOE_JOIN_TOKEN={token} sh -s -- --server {server}"


# --- effects --------------------------------------------------------------------------------------


def probe_certificate(server: str, timeout_s: float = PROBE_TIMEOUT_S) -> bytes:
    """The DER certificate ``server`` presents: a TLS handshake and nothing else (no request is
    sent, so nothing reaches a server that turns out to be the wrong one). Not verified here:
    its pin is what the caller checks."""
    parsed = urlparse(server)
    host, port = parsed.hostname or "", parsed.port or 443
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection((host, port), timeout=timeout_s) as raw,
        context.wrap_socket(raw, server_hostname=None if _is_address(host) else host) as tls,
    ):
        certificate = tls.getpeercert(binary_form=True)
    if not certificate:
        raise TrustError(f"{server} presented no certificate")
    return certificate


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def certificates_of(pem: str) -> list[str]:
    """Each certificate of a PEM text, written again from what was parsed (nothing else of the text
    is kept); ValueError for a text that holds none or one that cannot be read."""
    try:
        parsed = x509.load_pem_x509_certificates(pem.encode())
    except ValueError as exc:
        raise ValueError(f"not PEM certificates: {exc}") from None
    return [certificate.public_bytes(Encoding.PEM).decode() for certificate in parsed]


def pinned_context(certificates_pem: str) -> ssl.SSLContext:
    """A client context that trusts these certificates (the server's own, all with the pinned key)
    and nothing else, whatever names they hold: OpenSSL refuses any other server during the handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # the pin replaces the name check; the chain is still verified
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the server's own certificate is the anchor
    context.load_verify_locations(cadata=certificates_pem)
    return context


class ServerTrust:
    """How this agent trusts one control plane, shared by every connection to it.

    Plain http: nothing to trust (``context()`` is None). https without a pin: the system's
    certificate authorities. https with a pin: the pinned certificate alone, read from
    ``state_dir`` if the one kept there has the pin, else learned by a handshake (and kept there).
    Thread-safe: downloads run in threads while the link runs in the event loop.
    """

    def __init__(self, server: str, pin: str = "", state_dir: Path | None = None) -> None:
        self.server = server.rstrip("/")
        self.https = urlparse(self.server).scheme == "https"
        self.pin = check_pin(pin) if pin and self.https else ""
        self.state_dir = state_dir  # where the pinned certificate is kept; None: in memory only
        self._lock = threading.Lock()
        # The certificates with the pinned key this agent has seen (PEM, newest first): several
        # proxies may share the key with certificates of their own, or a renewal be half rolled out.
        self._certificates: list[str] = []
        self._context: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext | None:
        """The context every connection to the server uses; learning the pinned certificate first if
        none is known (a handshake: raises TrustError for another key, OSError if unreachable)."""
        if not self.https:
            return None
        with self._lock:
            if self._context is None:
                self._context = self._build()
            return self._context

    def _build(self) -> ssl.SSLContext:
        if not self.pin:
            return ssl.create_default_context()
        self._certificates = self._kept() or self._keep([self._learn()])
        return pinned_context("".join(self._certificates))

    def _kept(self) -> list[str]:
        """The certificates kept in ``state_dir`` that have the pin; anything else there (a stale
        certificate, another key's, a line that is not a certificate) is not trusted."""
        if self.state_dir is None:
            return []
        try:
            kept = certificates_of(credentials.load_certificate(self.state_dir))
        except ValueError:
            return []  # unreadable, or no certificate: learn it again
        return [pem for pem in kept if pin_of_pem(pem) == self.pin][:KEPT_CERTIFICATES]

    def _learn(self) -> str:
        """Handshake, compare the certificate's pin with ours: the certificate (PEM) on a match."""
        certificate = probe_certificate(self.server)
        found = self._pin_presented(certificate)
        if found != self.pin:
            raise TrustError(self._other_key(found))
        return ssl.DER_cert_to_PEM_cert(certificate)

    def _keep(self, certificates: list[str]) -> list[str]:
        if self.state_dir is not None:
            credentials.save_certificate(self.state_dir, "".join(certificates))
        return certificates

    def _pin_presented(self, certificate: bytes) -> str:
        """The pin of what the server presented; TrustError for what is not a certificate we can read."""
        try:
            return pin_of_der(certificate)
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise TrustError(f"{self.server} presented a certificate this agent cannot read ({exc}): refused") from None

    def _other_key(self, found: str) -> str:
        return (
            f"{self.server} presents a certificate whose key has pin {found}, not the pinned {self.pin}: "
            "refused before anything was sent. If the control plane's key was changed on purpose, run the "
            "install one-liner from its console again on this box (it pins the new key), or "
            "'python -m agent --pin NEW_PIN ...'; otherwise something stands between this box and the server"
        )

    def renew(self, failed: ssl.SSLContext | None, reason: object) -> None:
        """A connection made with ``failed`` did not verify: look at the server's certificate again.

        The same key in a certificate not seen before (the proxy renewed it, or another proxy
        sharing the key answered): kept beside the others, and the caller retries. Another key:
        TrustError. A certificate already trusted that failed (expired, say): TrustError too, since
        looking again cannot help. Without a pin there is nothing to renew.
        """
        if not self.pin:
            raise TrustError(
                f"{self.server}'s certificate is not trusted by this system ({reason}); a self-signed control "
                "plane is pinned by its join token: enroll with a token from its console, or pass --pin"
            )
        with self._lock:
            if failed is not None and self._context is not failed:
                return  # another connection renewed it meanwhile
            pem = certificates_of(self._learn())[0]
            if pem in self._certificates:
                raise TrustError(
                    f"{self.server}'s certificate has the pinned key but does not verify ({reason}): "
                    "renew it on the server (same key: agents follow by themselves)"
                )
            self._certificates = self._keep([pem, *self._certificates][:KEPT_CERTIFICATES])
            self._context = pinned_context("".join(self._certificates))
        log.warning("%s presents a new certificate with the pinned key: kept it", self.server)

    def open(self, request: urllib.request.Request, *, timeout_s: float) -> HTTPResponse:
        """``urlopen`` through this trust, renewing a certificate that stopped verifying once."""
        context = self.context()
        try:
            return urllib.request.urlopen(request, timeout=timeout_s, context=context)
        except urllib.error.URLError as exc:
            if not (self.pin and isinstance(exc.reason, ssl.SSLCertVerificationError)):
                raise
            self.renew(context, exc.reason.verify_message)
        return urllib.request.urlopen(request, timeout=timeout_s, context=self.context())
