"""What a box downloads to become a node: the install script and the agent's source package.

``/agent/install.sh`` is ``agent/install.sh`` with this control plane's URL and the agent
package's sha256 filled in (the script refuses a package that does not match it, so a
package swapped on the way, over plain HTTP say, is never installed);
``/agent/odmoe-agent.tar.gz`` is a source package of the agent and the runtime built from
this checkout (what the script pip-installs), so a box runs the code its control plane runs.
Both are public: they hold no secret, and a box has no credential before it enrolls.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import tarfile
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

SOURCE_PARTS = ("pyproject.toml", "README.md", "agent", "inference", "benchmarks")
SERVER_PLACEHOLDER = "@SERVER@"
SHA256_PLACEHOLDER = "@AGENT_SHA256@"


@require_GET
def install_script(request: HttpRequest) -> HttpResponse:
    script = (Path(settings.REPO_DIR) / "agent" / "install.sh").read_text()
    server = request.build_absolute_uri("/").rstrip("/")
    script = script.replace(SERVER_PLACEHOLDER, server).replace(SHA256_PLACEHOLDER, package_sha256())
    return HttpResponse(script, content_type="text/x-shellscript")


def package_sha256() -> str:
    """The sha256 of the agent package this control plane serves (what the script checks)."""
    return hashlib.sha256(_source_package()).hexdigest()


@require_GET
def agent_package(request: HttpRequest) -> HttpResponse:
    response = HttpResponse(_source_package(), content_type="application/gzip")
    response["Content-Disposition"] = 'attachment; filename="odmoe-agent.tar.gz"'
    return response


@functools.cache
def _source_package() -> bytes:
    repo = Path(settings.REPO_DIR)
    buffer = io.BytesIO()
    # gzip's header gets no timestamp, so every process of one checkout serves the same bytes
    # (and the same sha256 in the script).
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        for part in SOURCE_PARTS:
            tar.add(repo / part, arcname=f"odmoe-agent/{part}", filter=_skip_build_litter)
    return buffer.getvalue()


def _skip_build_litter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    name = Path(info.name).name
    if name in ("__pycache__", ".pytest_cache") or name.endswith((".pyc", ".egg-info")):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
