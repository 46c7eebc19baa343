"""The agent obeys nothing a server sends before checking it: shard and file names stay inside
its state directory, manifests are well formed, and no file grows past its listed size.

A hostile control plane here is a real HTTP server on 127.0.0.1 that answers with whatever
manifest and bytes the test gives it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.credentials import NodeCredential
from agent.download import fetch_shard
from agent.http import ControlPlaneError
from agent.runtime import shard_dir
from inference.modelio.shards import ShardError


class HostileServer:
    """Serves ``files`` (name -> bytes) under any shard URL; ``manifest`` is served as manifest.json."""

    def __init__(self, manifest: object, files: dict[str, bytes]) -> None:
        body = json.dumps(manifest).encode()
        served = {"manifest.json": body, **files}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.rsplit("/", 1)[-1]
                data = served.get(name)
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> NodeCredential:
        self.thread.start()
        host, port = self.server.server_address
        return NodeCredential(server=f"http://{host}:{port}", node_id="n", node_secret="s", name="box")

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _entry(name: str, data: bytes, **changes) -> dict:
    return {"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()} | changes


@pytest.mark.parametrize(
    "entry",
    [
        _entry("../escaped.safetensors", b"x"),
        _entry("/tmp/absolute.safetensors", b"x"),
        _entry("sub/dir.safetensors", b"x"),
        _entry(".hidden", b"x"),
        _entry("manifest.json", b"x"),
        _entry("part-00001.safetensors.part", b"x"),
        _entry("part-00001.safetensors", b"x", size=True),
        _entry("part-00001.safetensors", b"x", size=-1),
        _entry("part-00001.safetensors", b"x", sha256="not-a-digest"),
        "just a string",
    ],
)
def test_a_bad_manifest_entry_is_refused_before_anything_is_written(tmp_path: Path, entry) -> None:
    dest = tmp_path / "state" / "shards" / "1" / "main"
    with HostileServer({"role": "main", "files": [entry]}, {}) as credential, pytest.raises(ShardError):
        fetch_shard(credential, 1, "main", dest)
    assert not dest.exists() and not (tmp_path / "escaped.safetensors").exists()
    assert not (tmp_path / "state" / "shards" / "1" / "escaped.safetensors").exists()


def test_a_file_longer_than_its_manifest_says_is_cut_off(tmp_path: Path) -> None:
    data = b"y" * 4096
    manifest = {"role": "main", "files": [_entry("part-00001.safetensors", data[:100])]}
    server = HostileServer(manifest, {"part-00001.safetensors": data})
    with server as credential, pytest.raises(ControlPlaneError, match="more than the manifest's 100 bytes"):
        fetch_shard(credential, 1, "main", tmp_path / "main")
    assert all(p.stat().st_size <= 100 for p in (tmp_path / "main").iterdir())


@pytest.mark.parametrize("shard", ["../../etc", "/abs", "main/../../x", "", "worker-1/..", "shadow-int4"])
def test_shard_and_model_names_from_the_server_never_become_paths(tmp_path: Path, shard: str) -> None:
    with pytest.raises(ValueError, match="refused"):
        shard_dir(tmp_path, 1, shard)
    with pytest.raises(ValueError, match="refused"):
        shard_dir(tmp_path, "1/../..", "main")  # type: ignore[arg-type]
    assert shard_dir(tmp_path, 3, "shadow-nf4") == tmp_path / "shards" / "3" / "shadow-nf4"
    with pytest.raises(ShardError, match="not a shard name"):
        fetch_shard(NodeCredential("http://127.0.0.1:9", "n", "s", "box"), 1, shard, tmp_path / "x")
