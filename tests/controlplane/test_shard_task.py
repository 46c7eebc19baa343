"""A shard build requested through the API runs in a real Celery worker over a real Redis."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.artifacts.models import ModelArtifact, ShardStatus
from inference.modelio.shards import verify_shard

pytestmark = pytest.mark.slow


def test_requested_shards_are_built_by_the_celery_worker(celery_worker, settings, tmp_path, tiny_model) -> None:
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    model = staff.post("/api/models", {"name": "tiny", "path": str(tiny_model)}, format="json").json()

    queued = staff.post(f"/api/models/{model['id']}/shards", {"workers": 2}, format="json")
    assert queued.status_code == 202 and queued.json()["shard_status"] == "building"
    again = staff.post(f"/api/models/{model['id']}/shards", {"workers": 2}, format="json")
    assert again.status_code == 409 and "already being built" in again.json()["detail"]

    deadline = time.monotonic() + 90
    artifact = ModelArtifact.objects.get(pk=model["id"])
    while artifact.shard_status == ShardStatus.BUILDING and time.monotonic() < deadline:
        time.sleep(0.3)
        artifact.refresh_from_db()
    assert artifact.shard_status == ShardStatus.READY, artifact.shard_error
    assert artifact.shard_done_bytes == artifact.shard_total_bytes > 0
    assert verify_shard(Path(artifact.shard_dir) / "main", expect_role="main")["role"] == "main"
    assert str(settings.VAR_DIR) in artifact.shard_dir


def test_bad_shard_requests_are_refused(transactional_db, tiny_model) -> None:
    staff = APIClient()
    staff.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    model = staff.post("/api/models", {"name": "tiny", "path": str(tiny_model)}, format="json").json()
    assert staff.post(f"/api/models/{model['id']}/shards", {"workers": 0}, format="json").status_code == 400
    assert staff.post("/api/models/999/shards", {"workers": 2}, format="json").status_code == 404
    assert ModelArtifact.objects.get().shard_status == ShardStatus.NONE
