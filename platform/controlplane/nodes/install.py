"""What a box downloads to become a node: the install script and the agent's package.

``/agent/install.sh`` is ``agent/install.sh`` with this control plane's URL, its certificate's
pin (``controlplane.nodes.tls``), the agent package's file name and its sha256 filled in: the
script downloads the package with curl pinned to that key and refuses one that does not match
the sha256. ``/agent/<wheel>`` is the agent's own wheel (``agent_wheel``: the agent and the
runtime, with only their dependencies) built from this checkout, so a box runs the code its
control plane runs; ``/agent/requirements.lock`` is the agent's dependencies, hash-locked
(``agent/requirements.lock``, written by ``deploy/lock.py``), whose sha256 the script pins too,
so pip checks every dependency against its sha256; ``/agent/facts`` is what the agent's doctor
compares its box with (the server's version and agent protocol, the largest shard it sends).
All are public: they hold no secret (a pin is not one), and a box has no credential before it
enrolls.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from controlplane.nodes.agent_wheel import served_wheel, version
from controlplane.nodes.tls import server_pin, upgrade_command
from inference.wire.link import AGENT_PROTOCOL, OLDEST_AGENT_PROTOCOL

SERVER_PLACEHOLDER = "@SERVER@"
SHA256_PLACEHOLDER = "@AGENT_SHA256@"
PIN_PLACEHOLDER = "@TLS_PIN@"
WHEEL_PLACEHOLDER = "@AGENT_WHEEL@"
LOCK_PLACEHOLDER = "@AGENT_LOCK@"
LOCK_SHA256_PLACEHOLDER = "@AGENT_LOCK_SHA256@"
LOCK_NAME = "requirements.lock"


def agent_wheel() -> tuple[str, bytes, str]:
    """(file name, bytes, sha256) of the agent package this control plane serves."""
    return served_wheel(Path(settings.REPO_DIR))


def agent_lock() -> tuple[str, bytes, str]:
    """(file name, bytes, sha256) of the agent's hash-locked dependencies."""
    data = (Path(settings.REPO_DIR) / "agent" / LOCK_NAME).read_bytes()
    return LOCK_NAME, data, hashlib.sha256(data).hexdigest()


def package_sha256() -> str:
    """The sha256 of the agent package this control plane serves (what the script checks)."""
    return agent_wheel()[2]


@require_GET
def install_script(request: HttpRequest) -> HttpResponse:
    script = (Path(settings.REPO_DIR) / "agent" / "install.sh").read_text()
    server = request.build_absolute_uri("/").rstrip("/")
    name, _, sha256 = agent_wheel()
    lock_name, _, lock_sha256 = agent_lock()
    filled = {
        SERVER_PLACEHOLDER: server,
        SHA256_PLACEHOLDER: sha256,
        WHEEL_PLACEHOLDER: name,
        PIN_PLACEHOLDER: server_pin(),  # the script uses it for https servers only
        LOCK_SHA256_PLACEHOLDER: lock_sha256,
        LOCK_PLACEHOLDER: lock_name,
    }
    for placeholder, value in filled.items():
        script = script.replace(placeholder, value)
    return HttpResponse(script, content_type="text/x-shellscript")


@require_GET
def agent_package(request: HttpRequest, filename: str) -> HttpResponse:
    lock_name, lock, _ = agent_lock()
    if filename == lock_name:
        return HttpResponse(lock, content_type="text/plain; charset=utf-8")
    name, data, _ = agent_wheel()
    if filename != name:
        raise Http404(f"this control plane serves the agent package {name} and its {lock_name}")
    response = HttpResponse(data, content_type="application/zip")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


@require_GET
def agent_facts(request: HttpRequest) -> JsonResponse:
    """The server's version and agent protocols, and the largest shard it would send a box."""
    from controlplane.artifacts.selectors import largest_shard_bytes

    return JsonResponse(
        {
            "version": version(Path(settings.REPO_DIR)),
            "protocol": AGENT_PROTOCOL,
            "oldest_protocol": OLDEST_AGENT_PROTOCOL,  # the oldest whose agents it still takes
            "largest_shard_bytes": largest_shard_bytes(),
            "install_command": upgrade_command(request.build_absolute_uri("/")),
        }
    )
