"""Fetch a role shard from the control plane: resumable, verified, never half-trusted.

Each file listed by the role's manifest is downloaded to ``NAME.part`` and continued with
an HTTP Range request if a previous attempt stopped; a finished file is checked against
the manifest's sha256 before it takes its real name. A file that fails the check is
fetched once more from scratch; if it fails again the shard is refused. The runtime
verifies the whole shard again before it loads it. Every request goes through the server's
trust (``agent.tls``): a pinned server's certificate alone.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from agent.credentials import NodeCredential
from agent.http import ControlPlaneError, control_plane_errors
from agent.tls import ServerTrust
from inference.modelio.shards import (
    MANIFEST_FILE,
    ShardError,
    file_sha256,
    is_plain_file_name,
    is_role_dirname,
    verify_shard,
)

CHUNK = 1 << 20
Progress = Callable[[int, int], None]


def shard_url(credential: NodeCredential, model_id: int, role: str, name: str) -> str:
    return f"{credential.server}/api/models/{model_id}/shards/{role}/{name}"


def fetch_shard(
    credential: NodeCredential,
    model_id: int,
    role: str,
    dest: Path,
    *,
    progress: Progress | None = None,
    trust: ServerTrust | None = None,
) -> dict:
    """Download role ``role`` of model ``model_id`` into ``dest``; returns its manifest.

    Nothing the server sends is obeyed before it is checked: the shard's name and every file
    name must be plain names (no directories, no ``..``), so every write stays in ``dest``;
    sizes and digests must be well formed, and no file is read past its listed size. ``trust``:
    the agent's shared trust in the server (default: one of its own, from the credential's pin).
    """
    trust = trust or ServerTrust(credential.server, credential.pin)
    if not is_role_dirname(role):
        raise ShardError(f"refused to fetch shard {role!r}: not a shard name")
    manifest_bytes = _get(credential, trust, shard_url(credential, model_id, role, MANIFEST_FILE))
    files = _checked_files(manifest_bytes, role)
    manifest = json.loads(manifest_bytes)
    dest.mkdir(parents=True, exist_ok=True)
    total = sum(size for _, size, _ in files)
    done = 0
    for name, size, digest in files:
        target = dest / name
        already = target.exists() and target.stat().st_size == size and file_sha256(target) == digest

        def report(received: int, base: int = done) -> None:
            if progress is not None:
                progress(base + received, total)

        for attempt in range(0 if already else 2):
            _download(credential, trust, shard_url(credential, model_id, role, name), _part(target), size, report)
            if file_sha256(_part(target)) == digest:
                _part(target).replace(target)
                break
            _part(target).unlink()  # corrupted: fetch it whole once more
            if attempt == 1:
                raise ShardError(f"{name} of shard {role} failed its sha256 check twice; not using it")
        done += size
        if progress is not None:
            progress(done, total)
    (dest / MANIFEST_FILE).write_bytes(manifest_bytes)
    verify_shard(dest, expect_role=manifest["role"], expect_worker=manifest.get("worker"))
    return manifest


def _checked_files(manifest_bytes: bytes, role: str) -> list[tuple[str, int, str]]:
    """The manifest's (name, size, sha256) entries, or ShardError if any is not what a shard lists."""
    try:
        manifest = json.loads(manifest_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError(f"the manifest of shard {role} is not JSON: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list):
        raise ShardError(f"the manifest of shard {role} has no list of files")
    checked = []
    for entry in files:
        fields = entry if isinstance(entry, dict) else {}
        name, size, digest = fields.get("path"), fields.get("size"), fields.get("sha256")
        ok = (
            is_plain_file_name(name)
            and name != MANIFEST_FILE
            and not name.endswith(".part")
            and type(size) is int
            and size >= 0
            and isinstance(digest, str)
            and re.fullmatch(r"[0-9a-f]{64}", digest) is not None
        )
        if not ok:
            raise ShardError(f"refused shard {role}: its manifest lists a bad file entry {entry!r:.200}")
        checked.append((name, size, digest))
    return checked


def _part(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def _download(
    credential: NodeCredential, trust: ServerTrust, url: str, part: Path, size: int, progress: Callable[[int], None]
) -> None:
    """Continue the partial file ``part`` up to ``size`` bytes."""
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have == size:
        return
    request = _request(credential, url, offset=have)
    with (
        control_plane_errors("GET", url, _stopped),
        trust.open(request, timeout_s=60) as response,
        part.open("ab" if have else "wb") as out,
    ):
        if have and response.status != 206:  # the server ignored the range: start over
            out.truncate(0)
            have = 0
        while have < size and (chunk := response.read(min(CHUNK, size - have))):
            out.write(chunk)
            have += len(chunk)
            progress(have)
        if have == size and response.read(1):
            raise ControlPlaneError(f"GET {url} sent more than the manifest's {size} bytes")


def _stopped(url: str, exc: BaseException) -> str:
    return f"download of {url} stopped: {getattr(exc, 'reason', exc)}"


def _get(credential: NodeCredential, trust: ServerTrust, url: str) -> bytes:
    with control_plane_errors("GET", url), trust.open(_request(credential, url, offset=0), timeout_s=60) as response:
        return response.read()


def _request(credential: NodeCredential, url: str, *, offset: int) -> urllib.request.Request:
    headers = {"Authorization": credential.authorization}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return urllib.request.Request(url, headers=headers)
