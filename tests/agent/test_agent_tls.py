"""The agent's TLS: pins as curl writes them, join tokens that carry one, plain http refused off
the box, and a pinned trust against a real TLS server on loopback (renewed certificate, other key)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import secrets
import socket
import ssl
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent import credentials
from agent.http import ControlPlaneError, request_json
from agent.inventory import peer_address
from agent.tls import (
    ServerTrust,
    TrustError,
    check_pin,
    check_server_url,
    install_command,
    join_token,
    pin_of_der,
    probe_certificate,
    split_join_token,
)
from tests.certificates import ServerIdentity, server_identity
from tests.paths import REPO


def test_a_pin_is_what_curl_pins_the_servers_key_by(tmp_path: Path) -> None:
    """curl's recipe for --pinnedpubkey, run with the openssl command line, gives the same pin."""
    identity = server_identity(tmp_path, "a")
    recipe = (
        f"openssl x509 -in {identity.cert_path} -pubkey -noout | openssl pkey -pubin -outform der"
        " | openssl dgst -sha256 -binary | base64"
    )
    by_openssl = subprocess.run(["sh", "-c", recipe], capture_output=True, text=True, check=True).stdout.strip()
    assert identity.pin == f"sha256//{by_openssl}" == check_pin(f" sha256//{by_openssl} ")
    der = ssl.PEM_cert_to_DER_cert(identity.pem)
    assert pin_of_der(der) == identity.pin
    renewed = server_identity(tmp_path, "renewed", identity.key, common_name="odmoe renewed")
    assert renewed.pem != identity.pem and renewed.pin == identity.pin  # the pin is the key's, not the certificate's
    assert server_identity(tmp_path, "b").pin != identity.pin
    for bad in ("", "sha256//", "sha256//abc", "md5//" + by_openssl, "sha256//" + "A" * 43 + "!", by_openssl):
        with pytest.raises(ValueError, match="is not a pin"):
            check_pin(bad)


def test_a_join_token_carries_the_pin_and_one_without_a_pin_still_reads(tmp_path: Path) -> None:
    pin = server_identity(tmp_path, "a").pin
    secret = "odmoe-join-" + secrets.token_urlsafe(32)
    assert "." not in secret  # the separator is outside the secret's alphabet
    token = join_token(secret, pin)
    assert token.startswith(secret + ".") and len(token) <= 200  # what the enroll API accepts
    assert split_join_token(token) == (secret, pin)
    assert split_join_token(secret) == (secret, "") and join_token(secret, "") == secret
    for damaged in (token[:-1], token + "A", token[:-2] + "!!", secret + "."):
        with pytest.raises(ValueError, match="copy the token whole"):
            split_join_token(damaged)


@pytest.mark.parametrize(
    "server",
    ["http://127.0.0.1:8000", "http://127.9.8.7", "http://localhost:8000/", "http://[::1]:8000", "https://10.0.0.1"],
)
def test_plain_http_is_allowed_on_loopback_and_https_anywhere(server: str) -> None:
    assert check_server_url(server) == server.rstrip("/")


@pytest.mark.parametrize("server", ["http://10.0.0.1:8000", "http://127.example.com", "http://cp.example"])
def test_plain_http_off_the_box_is_refused_unless_insecure(server: str) -> None:
    with pytest.raises(ValueError, match="refusing plain http") as refused:
        check_server_url(server)
    assert "--insecure" in str(refused.value) and "node's credential" in str(refused.value)
    assert check_server_url(server, insecure=True) == server


@pytest.mark.parametrize("server", ["ftp://x", "10.0.0.1:8000", "https://", "https://h:port", "https://u:p@h"])
def test_a_server_url_that_is_not_one_is_refused(server: str) -> None:
    with pytest.raises(ValueError, match="--server"):
        check_server_url(server, insecure=True)


def test_the_one_liner_gives_curl_the_pin_over_https_only() -> None:
    pin = "sha256//" + "A" * 43 + "="
    assert install_command("https://cp:8443/", pin, token="odmoe-join-x.y") == (
        f"curl -fsSL --pinnedpubkey '{pin}' -k https://cp:8443/agent/install.sh"
        " | ODMOE_JOIN_TOKEN=odmoe-join-x.y sh -s -- --server https://cp:8443"
    )
    assert install_command("https://cp", "") == "curl -fsSL https://cp/agent/install.sh | sh"  # a public certificate
    assert install_command("http://127.0.0.1:8000", pin) == "curl -fsSL http://127.0.0.1:8000/agent/install.sh | sh"


# --- a pinned trust against a real TLS server ------------------------------------------------------


class _Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Authorization")))  # type: ignore[attr-defined]
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class TLSServer(ThreadingHTTPServer):
    """An https server on loopback whose certificate a test swaps; it records every request it reads
    and counts the connections it accepts."""

    def __init__(self, identity: ServerIdentity) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.requests: list[tuple[str, str | None]] = []
        self.handshakes = 0  # connections accepted: a request's own, or a probe's
        self.present(identity)

    def present(self, identity: ServerIdentity) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(identity.cert_path, identity.key_path)
        self.context = context

    def get_request(self):
        sock, address = super().get_request()
        self.handshakes += 1
        return self.context.wrap_socket(sock, server_side=True), address  # a failed handshake is dropped

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"


@contextlib.contextmanager
def tls_server(identity: ServerIdentity) -> Iterator[TLSServer]:
    server = TLSServer(identity)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_pinned_server_is_trusted_followed_through_a_renewal_and_refused_with_another_key(tmp_path: Path) -> None:
    a = server_identity(tmp_path / "certs", "a")
    renewed = server_identity(tmp_path / "certs", "a-renewed", a.key, common_name="odmoe renewed")
    other = server_identity(tmp_path / "certs", "b")
    state = tmp_path / "state"
    with tls_server(a) as server:
        assert ssl.DER_cert_to_PEM_cert(probe_certificate(server.url)) == a.pem
        assert server.requests == []  # a probe is a handshake, no request
        trust = ServerTrust(server.url, a.pin, state)
        assert request_json("GET", f"{server.url}/x", trust=trust) == {"path": "/x"}
        kept = state / credentials.CERTIFICATE_FILE
        assert kept.read_text() == a.pem and stat.S_IMODE(kept.stat().st_mode) == 0o600
        # The proxy renews its certificate with the same key: the stored one no longer verifies it.
        server.present(renewed)
        assert request_json("GET", f"{server.url}/y", trust=trust) == {"path": "/y"}
        assert kept.read_text() == renewed.pem + a.pem  # the newest first, both with the pinned key
        # Two proxies that share the key, each with its own certificate, answer in turn: both are
        # trusted, so no connection needs to look again (the agent does not flap between them).
        server.present(a)
        probes = server.handshakes
        assert request_json("GET", f"{server.url}/again", trust=trust) == {"path": "/again"}
        assert server.handshakes == probes + 1  # the request's own handshake, no probe
        # A new agent process reads the kept certificate: no probe needed, same answer.
        assert request_json("GET", f"{server.url}/z", trust=ServerTrust(server.url, a.pin, state)) == {"path": "/z"}
        # Another key: refused during the handshake, before the request (and its credential) is sent.
        server.present(other)
        seen = len(server.requests)
        expected = re.escape(f"whose key has pin {other.pin}, not the pinned")
        with pytest.raises(ControlPlaneError, match=expected) as refused:
            request_json("GET", f"{server.url}/secret", authorization="Node n:s", trust=trust)
        assert "run the install one-liner from its console again" in str(refused.value)
        assert len(server.requests) == seen and kept.read_text() == renewed.pem + a.pem


def test_only_certificates_with_the_pin_are_trusted_from_the_kept_file(tmp_path: Path) -> None:
    """Anything else written into the kept file (another server's certificate, a CA appended) is
    not trusted: the agent keeps only what has the pin, re-written from what it parsed."""
    a, other = server_identity(tmp_path / "certs", "a"), server_identity(tmp_path / "certs", "b")
    state = tmp_path / "state"
    credentials.save_certificate(state, a.pem + other.pem + "# a note\n")
    with tls_server(other) as server:
        with pytest.raises(ControlPlaneError, match="not the pinned"):
            request_json("GET", f"{server.url}/secret", trust=ServerTrust(server.url, a.pin, state))
        assert server.requests == []


def test_first_contact_with_another_key_sends_nothing_and_keeps_nothing(tmp_path: Path) -> None:
    a, b = server_identity(tmp_path / "certs", "a"), server_identity(tmp_path / "certs", "b")
    with tls_server(b) as server:
        with pytest.raises(ControlPlaneError, match="not the pinned"):
            request_json("GET", f"{server.url}/enroll", trust=ServerTrust(server.url, a.pin, tmp_path / "state"))
        assert server.requests == [] and not (tmp_path / "state").exists()
        # Without a pin the system's certificate authorities decide: a self-signed server is not trusted.
        with pytest.raises(ControlPlaneError, match=r"not trusted .* enroll with a join token from its console"):
            request_json("GET", f"{server.url}/enroll")
        assert server.requests == []


# --- the agent's command line ----------------------------------------------------------------------


def run_agent(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO
    )


def test_a_certificate_the_agent_cannot_read_is_refused_with_a_reason_not_a_crash(tmp_path: Path) -> None:
    trust = ServerTrust("https://127.0.0.1:9", server_identity(tmp_path, "a").pin)
    with pytest.raises(TrustError, match="presented a certificate this agent cannot read"):
        trust._pin_presented(b"0\x03\x02\x01\x00")  # what a hostile server could send instead of one


@pytest.mark.slow
def test_the_agent_refuses_plain_http_off_the_box_before_any_traffic_and_warns_with_insecure(tmp_path: Path) -> None:
    """A listener on this box's own network address (not loopback) stands for a server off the box: the
    agent and its doctor refuse it without a connection; with --insecure the agent connects, warning."""
    address = peer_address("10.255.255.255")  # the address that routes off the box; no packet is sent
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this machine has no network address besides loopback")
    with socket.create_server((address, 0)) as listener:
        server = f"http://{address}:{listener.getsockname()[1]}"
        state = tmp_path / "state"
        for args in (
            ["--server", server, "--token", "odmoe-join-x", "--state-dir", str(state), "--enroll-only"],
            ["--server", "http://10.0.0.1:8000", "--token", "odmoe-join-x", "--state-dir", str(state)],
            ["doctor", "--server", server, "--state-dir", str(state)],
        ):
            refused = run_agent(*args)
            assert refused.returncode == 2, refused.stderr
            assert "refusing plain http" in refused.stderr and "--insecure" in refused.stderr
            assert "Traceback" not in refused.stderr
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody knocked
        assert not state.exists()

        listener.settimeout(60)
        accepted: list[str] = []

        def answer_one() -> None:
            connection, _ = listener.accept()
            with connection:
                accepted.append(connection.recv(4096).decode(errors="replace"))  # then close: no answer

        knock = threading.Thread(target=answer_one)
        knock.start()
        lab = run_agent("--server", server, "--token", "odmoe-join-x", "--state-dir", str(state), "--insecure")
        knock.join(timeout=60)
    assert lab.returncode == 1 and "cannot reach the control plane" in lab.stderr  # it tried: the flag let it
    assert re.search(
        rf"WARNING --insecure: plain http to {re.escape(server)}: the join token, .* travel in clear", lab.stderr
    )
    assert accepted and accepted[0].startswith("POST /api/agents/enroll")


def test_a_credential_the_agent_cannot_read_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """A state another user owns (moved from root's install) is a clear error, not a traceback."""
    (tmp_path / credentials.FILE_NAME).mkdir()  # unreadable as a file, whoever runs the test
    with pytest.raises(ValueError, match="must belong to the user the agent runs as"):
        credentials.load(tmp_path)
