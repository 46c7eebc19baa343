"""Agents download shards over HTTP: authenticated, resumable with Range, verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from agent.credentials import NodeCredential
from agent.download import fetch_shard
from agent.http import ControlPlaneError
from controlplane.artifacts.ranges import RangeNotSatisfiable, parse_range
from controlplane.artifacts.services import build_model_shards, register_model
from controlplane.nodes.models import NodeTask
from controlplane.nodes.services import create_join_token, enroll_node
from inference.modelio.shards import MANIFEST_FILE, verify_shard


def test_range_headers() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=10-", 100) == (10, 99)
    assert parse_range("bytes=10-19", 100) == (10, 19)
    assert parse_range("bytes=90-200", 100) == (90, 99)
    assert parse_range("bytes=-5", 100) == (95, 99)
    assert parse_range("bytes=0-1,5-6", 100) is None  # several ranges: the whole file
    assert parse_range("items=0-1", 100) is None
    for bad in ("bytes=100-", "bytes=5-1", "bytes=-0"):
        with pytest.raises(RangeNotSatisfiable):
            parse_range(bad, 100)


@pytest.fixture
def shards(settings, tmp_path: Path, tiny_model: Path):
    settings.VAR_DIR = tmp_path / "var"
    artifact = register_model(name="tiny", path=str(tiny_model))
    return build_model_shards(artifact_id=artifact.pk, workers=2)


@pytest.fixture
def node_auth():
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="box", inventory={})
    return node, secret


def grant(node, model_id: int, *shards: str) -> None:
    """Tell ``node`` to fetch ``shards`` (what starting a role or a fetch request records)."""
    for shard in shards:
        NodeTask.objects.create(node=node, kind="fetch_shard", params={"model_id": model_id, "role": shard})


@pytest.mark.django_db
def test_only_enrolled_agents_get_listed_files_with_ranges(shards, node_auth) -> None:
    node, secret = node_auth
    url = f"/api/models/{shards.pk}/shards/worker-1"
    anonymous = APIClient()
    assert anonymous.get(f"{url}/{MANIFEST_FILE}").status_code == 401
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {node.pk}:{secret}")
    # A node's credential fetches only the shards its node was told to fetch.
    assert agent.get(f"{url}/{MANIFEST_FILE}").status_code == 403
    grant(node, shards.pk, "worker-1")
    assert agent.get(f"/api/models/{shards.pk}/shards/worker-0/{MANIFEST_FILE}").status_code == 403
    assert agent.get(f"/api/models/{shards.pk}/shards/main/{MANIFEST_FILE}").status_code == 403
    manifest = agent.get(f"{url}/{MANIFEST_FILE}")
    assert manifest.status_code == 200
    name = json.loads(b"".join(manifest.streaming_content))["files"][0]["path"]
    whole = b"".join(agent.get(f"{url}/{name}").streaming_content)
    assert whole == (Path(shards.shard_dir) / "worker-1" / name).read_bytes()
    part = agent.get(f"{url}/{name}", HTTP_RANGE="bytes=10-29")
    assert part.status_code == 206 and part["Content-Range"] == f"bytes 10-29/{len(whole)}"
    assert b"".join(part.streaming_content) == whole[10:30]
    assert agent.get(f"{url}/{name}", HTTP_RANGE=f"bytes={len(whole)}-").status_code == 416
    for sneaky in ("..%2F..%2Fdb.sqlite3", "config.json.bak", "nope.safetensors"):
        assert agent.get(f"{url}/{sneaky}").status_code == 404
    assert agent.get(f"/api/models/{shards.pk}/shards/../{name}").status_code == 404


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_an_agent_resumes_an_interrupted_download_and_refetches_a_corrupt_one(
    live_server, shards, node_auth, tmp_path: Path
) -> None:
    node, secret = node_auth
    grant(node, shards.pk, "worker-0")
    credential = NodeCredential(live_server.url, str(node.pk), secret, node.name)
    source = Path(shards.shard_dir) / "worker-0"
    dest = tmp_path / "fetched"
    dest.mkdir()
    names = [p.name for p in sorted(source.glob("*.safetensors"))]
    # A first attempt stopped half way through the first file ...
    first = (source / names[0]).read_bytes()
    (dest / f"{names[0]}.part").write_bytes(first[: len(first) // 2])
    seen: list[tuple[int, int]] = []
    manifest = fetch_shard(credential, shards.pk, "worker-0", dest, progress=lambda d, t: seen.append((d, t)))
    assert manifest["role"] == "worker" and manifest["worker"] == 0
    verify_shard(dest, expect_role="worker", expect_worker=0)
    assert seen[-1][0] == seen[-1][1] > 0
    # ... and a partial file that is corrupt is detected, thrown away and fetched again.
    shutil.rmtree(dest)
    dest.mkdir()
    (dest / f"{names[0]}.part").write_bytes(b"\0" * (len(first) // 2))
    fetch_shard(credential, shards.pk, "worker-0", dest)
    verify_shard(dest, expect_role="worker", expect_worker=0)
    assert not list(dest.glob("*.part"))


@pytest.mark.django_db(transaction=True)
def test_a_forged_agent_cannot_download(live_server, shards, node_auth, tmp_path: Path) -> None:
    node, _ = node_auth
    forged = NodeCredential(live_server.url, str(node.pk), "odmoe-node-forged", node.name)
    with pytest.raises(ControlPlaneError, match="401"):
        fetch_shard(forged, shards.pk, "main", tmp_path / "x")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_the_agent_never_starts_a_role_on_a_shard_that_fails_verification(
    live_server, shards, node_auth, tmp_path: Path, damage: str
) -> None:
    import asyncio

    from agent.runtime import RoleRunner
    from inference.wire.link import RoleState, StartRole, TaskDone

    node, secret = node_auth
    grant(node, shards.pk, "worker-0")
    served = next((Path(shards.shard_dir) / "worker-0").glob("*.safetensors"))
    data = served.read_bytes()
    served.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00" * len(data))
    sent: list = []

    async def send(message) -> None:
        sent.append(message)

    async def run() -> RoleRunner:
        runner = RoleRunner(NodeCredential(live_server.url, str(node.pk), secret, node.name), tmp_path, send)
        spec = {"deployment": "dep1-1", "role": "worker", "worker": 0, "addresses": {}, "settings": {}}
        await runner.start(
            StartRole(
                task_id="t1", deployment="dep1-1", model_id=shards.pk, shard="worker-0", spec=spec, client_keys={}
            )
        )
        await asyncio.wait_for(runner._work, timeout=60)
        return runner

    runner = asyncio.run(run())
    assert runner.process is None  # nothing was started
    failed = RoleState(deployment="dep1-1", role="worker", role_name="worker-0", state="failed", detail=sent[-1].detail)
    assert sent[-1] == failed
    assert "worker-0" in sent[-1].detail
    assert any(isinstance(m, TaskDone) and not m.ok for m in sent)
