"""Registering checkpoints and building their role shards, with progress, on a real database."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.artifacts.models import ModelArtifact, ShardStatus
from controlplane.artifacts.services import ModelError, build_model_shards, register_model
from inference.sharding import verify_shard

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    return client


def test_registering_a_checkpoint_reads_its_shape(staff: APIClient, tiny_model: Path) -> None:
    response = staff.post("/api/models", {"name": "tiny", "path": str(tiny_model)}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["summary"]["layers"] == 4 and body["summary"]["experts"] == 8 and body["summary"]["top_k"] == 2
    assert body["total_bytes"] > 0 and body["shard_status"] == "none"
    assert staff.get(f"/api/models/{body['id']}").json()["name"] == "tiny"


def test_a_bad_path_or_a_taken_name_is_refused_and_changes_nothing(
    staff: APIClient, tiny_model: Path, tmp_path: Path
) -> None:
    missing = staff.post("/api/models", {"name": "x", "path": str(tmp_path / "nope")}, format="json")
    assert missing.status_code == 400 and "nope" in missing.json()["detail"]
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    wrong = staff.post("/api/models", {"name": "x", "path": str(tmp_path)}, format="json")
    assert wrong.status_code == 400 and "mixtral" in wrong.json()["detail"].lower()
    assert staff.post("/api/models", {"name": "tiny", "path": str(tiny_model)}, format="json").status_code == 201
    taken = staff.post("/api/models", {"name": "tiny", "path": str(tiny_model)}, format="json")
    assert taken.status_code == 400 and "already registered" in taken.json()["detail"]
    assert ModelArtifact.objects.count() == 1


def test_only_staff_register_models(tiny_model: Path) -> None:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("alice"))
    assert client.post("/api/models", {"name": "t", "path": str(tiny_model)}, format="json").status_code == 403


def test_building_shards_records_progress_and_verifiable_shards(settings, tmp_path: Path, tiny_model: Path) -> None:
    settings.VAR_DIR = tmp_path / "var"
    artifact = register_model(name="tiny", path=str(tiny_model))
    built = build_model_shards(artifact_id=artifact.pk, workers=3)
    assert built.shard_status == ShardStatus.READY and built.shard_workers == 3
    assert built.shard_total_bytes > 0 and built.shard_done_bytes == built.shard_total_bytes
    assert built.shard_progress == 1.0
    shard_dir = Path(built.shard_dir)
    assert verify_shard(shard_dir / "worker-2", expect_role="worker", expect_worker=2)["role"] == "worker"


def test_a_failed_build_is_recorded_with_its_reason(settings, tmp_path: Path, tiny_model: Path) -> None:
    import shutil

    settings.VAR_DIR = tmp_path / "var"
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    artifact = register_model(name="tiny", path=str(copy))
    (copy / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match="failed"):
        build_model_shards(artifact_id=artifact.pk, workers=2)
    artifact.refresh_from_db()
    assert artifact.shard_status == ShardStatus.FAILED
    assert "model.safetensors" in artifact.shard_error
