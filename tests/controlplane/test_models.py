"""Registering checkpoints and building their role shards, with progress, on a real database."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.artifacts.models import ModelArtifact, ShardStatus
from controlplane.artifacts.services import ModelError, build_model_shards, register_model
from inference.modelio.shards import verify_shard

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


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Hub from tests: every request fails at once (huggingface_hub reads the flag at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_hub_repo_id_is_downloaded_in_the_background_and_fails_clearly_offline(
    staff: APIClient, settings, tmp_path: Path, hub_offline: None
) -> None:
    from controlplane.artifacts.models import ModelStatus
    from controlplane.artifacts.services import request_shard_build
    from controlplane.artifacts.tasks import download_model_task

    settings.VAR_DIR = tmp_path / "var"
    repo = "mistralai/Mixtral-8x7B-Instruct-v0.1"
    response = staff.post("/api/models", {"name": "mixtral", "path": repo}, format="json")
    assert response.status_code == 202, response.content
    body = response.json()
    assert (body["status"], body["repo_id"], body["revision"]) == ("downloading", repo, "")
    assert body["path"].startswith(str(tmp_path / "var" / "models"))
    artifact = ModelArtifact.objects.get(pk=body["id"])
    with pytest.raises(ModelError, match="still downloading"):
        request_shard_build(artifact=artifact, workers=2)

    download_model_task(artifact.pk)  # what the Celery worker runs; it records the failure, raises nothing
    failed = staff.get(f"/api/models/{artifact.pk}").json()
    assert failed["status"] == ModelStatus.FAILED and failed["summary"] == {}
    assert failed["error"].startswith(f"cannot download {repo} from the Hugging Face Hub: ")
    assert "HF_HUB_OFFLINE" in failed["error"] and "no route to the hub" in failed["error"]
    assert "register its directory" in failed["error"]
    with pytest.raises(ModelError, match="could not be registered"):
        build_model_shards(artifact_id=artifact.pk, workers=2)
    assert ModelArtifact.objects.get(pk=artifact.pk).shard_status == ShardStatus.NONE

    # The same repo again retries it (resuming); another one under a taken name is refused.
    again = staff.post("/api/models", {"name": "mixtral", "path": repo}, format="json")
    assert again.status_code == 202 and again.json()["status"] == "downloading" and again.json()["error"] == ""
    other = staff.post("/api/models", {"name": "mixtral", "path": "mistralai/Mixtral-8x7B-v0.1"}, format="json")
    assert other.status_code == 400 and "already registered" in other.json()["detail"]
    assert ModelArtifact.objects.count() == 1


@pytest.mark.parametrize(
    "garbage", ["not a repo", "owner/name/extra", "owner/", "/name", "-owner/name", "owner/na..me", "a/b@", "a/b@c d"]
)
def test_a_path_that_is_neither_a_directory_nor_a_repo_id_is_a_400(staff: APIClient, garbage: str) -> None:
    response = staff.post("/api/models", {"name": "x", "path": garbage}, format="json")
    assert response.status_code == 400
    assert ModelArtifact.objects.count() == 0


def test_a_repo_id_with_a_revision(staff: APIClient, settings, tmp_path: Path) -> None:
    settings.VAR_DIR = tmp_path / "var"
    body = staff.post(
        "/api/models", {"name": "m", "path": "mistralai/Mixtral-8x7B-v0.1@refs/pr/1"}, format="json"
    ).json()
    assert (body["repo_id"], body["revision"]) == ("mistralai/Mixtral-8x7B-v0.1", "refs/pr/1")
    assert body["path"] == str(tmp_path / "var" / "models" / "mistralai--Mixtral-8x7B-v0.1" / "refs--pr--1")


def test_download_progress_is_saved_from_the_hub_byte_bar(transactional_db, tmp_path: Path) -> None:
    import threading

    from controlplane.artifacts.models import ModelStatus
    from controlplane.artifacts.services import _progress_bar

    artifact = ModelArtifact.objects.create(
        name="m", path=str(tmp_path), repo_id="owner/model", status=ModelStatus.DOWNLOADING, download_total_bytes=1000
    )
    progress = _progress_bar(artifact.pk, already=200, total=1000)
    files = progress(total=3, desc="Fetching 3 files")  # counts files: not saved
    files.update(1)
    assert ModelArtifact.objects.get(pk=artifact.pk).download_done_bytes == 0
    # snapshot_download updates its byte bar from its download threads.
    byte_bar = progress(name="huggingface_hub.snapshot_download", total=800, unit="B", desc="Reconstructing")
    thread = threading.Thread(target=byte_bar.update, args=(300,))
    thread.start()
    thread.join()
    assert ModelArtifact.objects.get(pk=artifact.pk).download_progress == 0.5
