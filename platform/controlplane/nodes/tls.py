"""The control plane's own TLS certificate, as the boxes pin it, and the commands that enroll a box.

The reverse proxy presents a certificate; ``ODMOE_TLS_CERT_FILE`` (``settings.TLS_CERT_FILE``)
names the same PEM file, from which the control plane learns its pin (``agent.tls``: the
SHA-256 of the key, in curl's ``sha256//`` form). Join tokens carry that pin and the install
one-liner gives it to curl, so a box trusts a self-signed control plane from its first byte.
Unset, there is no pin: a publicly trusted certificate (the system's CAs check it) or plain
http on loopback. The pin is read again only when the file changes (a renewal keeps the key
and so the pin; a new key gives a new pin without a restart).
"""

from __future__ import annotations

import functools
from pathlib import Path
from urllib.parse import urlparse

from cryptography.exceptions import UnsupportedAlgorithm
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from agent.tls import in_clear_off_the_box, install_command, pin_of_pem


def server_pin() -> str:
    """The pin of ``settings.TLS_CERT_FILE``'s certificate, or "" when none is set."""
    path = getattr(settings, "TLS_CERT_FILE", "")
    if not path:
        return ""
    try:
        stat = Path(path).stat()
    except OSError as exc:
        raise ImproperlyConfigured(f"ODMOE_TLS_CERT_FILE={path}: {exc.strerror or exc}") from None
    return _pin_of_file(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _pin_of_file(path: str, mtime_ns: int, size: int) -> str:
    """Read once per version of the file (``mtime_ns`` and ``size`` tell a changed one)."""
    try:
        return pin_of_pem(Path(path).read_bytes())
    except (OSError, ValueError, UnsupportedAlgorithm) as exc:
        raise ImproperlyConfigured(
            f"ODMOE_TLS_CERT_FILE={path} is not a PEM certificate ({exc}): name the certificate file the "
            "reverse proxy presents, or unset it for a publicly trusted certificate"
        ) from None


def pin_for(server: str) -> str:
    """The pin a box reaching ``server`` should use: the server's over https, none over http."""
    return server_pin() if urlparse(server).scheme == "https" else ""


def enroll_commands(server: str, token: str) -> dict[str, str]:
    """What a person runs on a box to enroll it with ``server`` (the URL the box reaches the
    control plane at) and ``token``: the install one-liner, the agent's own command, and a
    warning when the agent will refuse that URL (plain http off loopback) without ``--insecure``."""
    server = server.rstrip("/")
    warning = ""
    if in_clear_off_the_box(server):
        warning = (
            f"this page was reached over plain http at {urlparse(server).hostname}: agents refuse a plain http "
            "server off their own box unless run with --insecure (everything, the token included, would travel "
            "in clear). Reach the console over https, through the TLS proxy, and create the token there."
        )
    return {
        "install_command": install_command(server, pin_for(server), token=token),
        # The token in the environment, as the one-liner passes it: a --token would show in the process list.
        "agent_command": f"ODMOE_JOIN_TOKEN={token} python -m agent --server {server}",
        "warning": warning,
    }


def upgrade_command(server: str) -> str:
    """The one-liner that upgrades an enrolled box's agent in place (no token: it keeps its credential)."""
    return install_command(server, pin_for(server))


@checks.register(checks.Tags.security, deploy=False)
def check_tls_certificate(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """``manage.py check`` (and every management command) says at once when the certificate file is unusable."""
    try:
        server_pin()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="odmoe.E001")]
    return []
