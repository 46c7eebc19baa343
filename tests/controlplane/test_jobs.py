"""Jobs with their submitter's rights and bounded results: a revoked or expired key, or a deactivated
user, stops what they queued; an output keeps a bounded summary of its metrics; a job's outputs
come a page at a time; a user's stored job output has a quota, and an ended job can be deleted.
(A job run by a real Celery worker on a live cluster is in test_serving_e2e.py.)"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import create_api_key
from controlplane.pagination import MAX_PAGE, Pages
from controlplane.serving import jobs, results
from controlplane.serving.models import Job, JobOutput, JobStatus, OutputStatus
from tests.controlplane.live import purge_stale_tasks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def deployment(tiny_model: Path):
    """A ready deployment named ``d`` with no cluster behind it: a prompt that reaches for the cluster
    is told to try again later."""
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment, DeploymentStatus

    model = register_model(name="tiny", path=str(tiny_model))
    made = Deployment.objects.create(name="d", model=model, status=DeploymentStatus.READY)
    yield made
    purge_stale_tasks()  # the submits queued tasks for a worker these tests have not


@pytest.fixture
def alice():
    return get_user_model().objects.create_user("alice")


def client_for(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def submit(key: str, prompts: list[str], **fields) -> dict:
    answer = client_for(key).post("/api/jobs", {"model": "d", "prompts": prompts, "max_tokens": 4, **fields})
    assert answer.status_code == 201, answer.content
    return answer.json()


def outputs_of(job_id: str) -> list[tuple[str, str]]:
    return list(JobOutput.objects.filter(job_id=job_id).order_by("index").values_list("status", "error"))


# --- a job runs with its submitter's rights -------------------------------------------------------


def expire(key: ApiKey) -> None:
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))


def revoke_without_a_signal(key: ApiKey) -> None:
    ApiKey.objects.filter(pk=key.pk).update(revoked=True, revoked_at=timezone.now())


def deactivate_without_a_signal(key: ApiKey) -> None:
    get_user_model().objects.filter(pk=key.user_id).update(is_active=False)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (expire, "has expired"),
        (revoke_without_a_signal, "was revoked"),
        (deactivate_without_a_signal, "the account that submitted this job was deactivated"),
    ],
    ids=["key-expired", "key-revoked", "owner-deactivated"],
)
def test_a_jobs_next_prompt_checks_its_key_and_owner_and_cancels_the_rest_with_the_reason(
    deployment, alice, change, said: str
) -> None:
    """Before, a job's queued prompts ran to the end whatever became of the key or the user."""
    key, clear = create_api_key(user=alice, scopes=["inference"])
    job = submit(clear, ["one", "two", "three"])
    first, second, _ = JobOutput.objects.filter(job_id=job["id"]).order_by("index")
    JobOutput.objects.filter(pk=first.pk).update(status=OutputStatus.DONE, text="ran before")
    change(key)
    jobs.run_output(output_id=second.pk)  # what the Celery task does; it never reaches for the cluster
    statuses = outputs_of(job["id"])
    assert statuses[0] == (OutputStatus.DONE, "")  # what ran is kept
    assert [s for s, _ in statuses[1:]] == [OutputStatus.CANCELLED] * 2
    assert all(said in error and error.startswith("cancelled: ") for _, error in statuses[1:]), statuses
    assert Job.objects.get(pk=job["id"]).status == JobStatus.CANCELLED


def test_revoking_a_key_cancels_what_it_queued_at_once_and_deactivating_its_user_the_rest(deployment, alice) -> None:
    key, clear = create_api_key(user=alice, scopes=["inference"])
    _, other = create_api_key(user=alice, scopes=["inference"])
    revoked_jobs = [submit(clear, ["a", "b"])["id"], submit(clear, ["c"])["id"]]
    kept = submit(other, ["d", "e"])["id"]
    browser = APIClient()
    browser.force_login(alice)
    assert browser.delete(f"/api/keys/{key.pk}").status_code == 200  # the API keys page's revoke, through the API
    for job_id in revoked_jobs:
        assert Job.objects.get(pk=job_id).status == JobStatus.CANCELLED
        assert all(s == OutputStatus.CANCELLED and "was revoked" in e for s, e in outputs_of(job_id))
    assert Job.objects.get(pk=kept).status == JobStatus.QUEUED  # another key's job runs on
    alice.is_active = False
    alice.save()  # what the admin's user form does
    assert Job.objects.get(pk=kept).status == JobStatus.CANCELLED
    assert all("deactivated" in e for _, e in outputs_of(kept))


def test_a_job_submitted_from_a_live_key_and_active_user_is_not_stopped(deployment, alice) -> None:
    _, clear = create_api_key(user=alice, scopes=["inference"])
    job = submit(clear, ["one"])
    alice.first_name = "Alice"
    alice.save()
    assert jobs.stop_jobs(owner_id=alice.pk) == 0
    (output,) = JobOutput.objects.filter(job_id=job["id"])
    with pytest.raises(jobs.RetryLater):  # past the check: reaching for the cluster, which is not there
        jobs.run_output(output_id=output.pk)


# --- bounded results --------------------------------------------------------------------------------


def per_step_record(steps: int, layers: int) -> list[dict]:
    """A per-step record as the runtime reports it: about 450 bytes a layer a step."""
    layer = {"real": [1, 5], "predicted": [1, 5], "wait_ms": 0.123, "worker_ms": 1.234, "dispatch_ms": 2.345}
    layer |= {"breakdown_ms": {"main_before_send": 0.1, "hops": 0.2, "worker_python": 0.3}, "recall": 1.0}
    return [{"step": s, "ms": 12.5, "layers": [{**layer, "layer": i} for i in range(layers)]} for s in range(steps)]


SUMMARY = {"ttft_ms": 40.0, "decode_tok_s": 9.5, "recall": 0.97, "generated_tokens": 512, "groups": [[0, 1], [2, 3]]}


def test_the_metrics_summary_drops_the_per_step_record_and_keeps_the_figures_whole() -> None:
    metrics = {**SUMMARY, "per_step": per_step_record(513, 32), "per_step_omitted": 0}
    assert results.metrics_summary(metrics) == SUMMARY
    assert results.metrics_summary(["not", "a", "dict"]) == {}


def test_a_summary_past_its_bound_leaves_out_its_largest_figures_first_and_names_them() -> None:
    metrics = {**SUMMARY, "alignment_changes": [{"step": s, "token_period": 2} for s in range(2000)]}
    summary = results.metrics_summary(metrics)
    assert summary == {**SUMMARY, "omitted_metrics": ["alignment_changes"]}
    assert results.json_bytes(summary) <= results.MAX_OUTPUT_METRICS_BYTES
    assert results.metrics_summary({f"k{i}": i for i in range(5000)}, max_bytes=100) == {"omitted_metrics": ["*"]}


def test_a_job_output_stores_a_bounded_summary_of_its_metrics_and_counts_its_bytes(deployment, alice) -> None:
    """Before, each output stored the per-step record too: up to 4 MiB an output, 400 MB a job."""
    from controlplane.serving.completions import CompletionResult

    _, clear = create_api_key(user=alice)
    job = submit(clear, ["Route every token"])
    (output,) = JobOutput.objects.filter(job_id=job["id"])
    assert output.stored_bytes == len(b"Route every token")
    metrics = {**SUMMARY, "per_step": per_step_record(513, 32), "per_step_omitted": 1536}
    assert results.json_bytes(metrics) > 2**20
    result = CompletionResult(
        text="é" * 10, token_ids=[7] * 10, finish_reason="length", prompt_tokens=4, metrics=metrics
    )
    jobs.record_result(output_id=output.pk, result=result)
    output.refresh_from_db()
    assert output.metrics == SUMMARY
    assert output.stored_bytes == len(b"Route every token") + 20 + len("[7,7,7,7,7,7,7,7,7,7]") + results.json_bytes(
        SUMMARY
    )


def test_a_jobs_detail_counts_its_outputs_and_the_outputs_come_a_page_at_a_time(deployment, alice) -> None:
    """Before, the detail carried every output with its metrics: about 400 MB of JSON for a
    Mixtral-size job of 100 prompts, built in one answer."""
    _, clear = create_api_key(user=alice)
    job = submit(clear, [f"prompt {i}" for i in range(5)])
    detail = client_for(clear).get(f"/api/jobs/{job['id']}").json()
    assert "outputs" not in detail and detail["prompts"] == 5
    assert detail["outputs_by_status"] == {"queued": 5, "running": 0, "done": 0, "failed": 0, "cancelled": 0}
    assert detail["stored_bytes"] == 5 * len(b"prompt 0")
    page = client_for(clear).get(f"/api/jobs/{job['id']}/outputs?limit=2&offset=2").json()
    assert page["count"] == 5 and [o["prompt"] for o in page["results"]] == ["prompt 2", "prompt 3"]
    assert "offset=4" in page["next"] and "per_step" not in page["results"][0]["metrics"]
    assert client_for(clear).get("/api/jobs").json()["results"][0]["prompts"] == 5
    _, other = create_api_key(user=get_user_model().objects.create_user("bob"))
    assert client_for(other).get(f"/api/jobs/{job['id']}/outputs").status_code == 404  # private to its owner


def test_a_page_holds_at_most_the_most_rows_whatever_limit_it_asks(deployment, alice, monkeypatch) -> None:
    """``?limit=1000000`` once built a whole list in one answer; a page now holds at most
    ``MAX_PAGE`` rows (three here, to show it on a small job), and ``next`` leads on."""
    assert Pages.max_limit == MAX_PAGE
    monkeypatch.setattr(Pages, "max_limit", 3)
    _, clear = create_api_key(user=alice)
    job = submit(clear, [f"prompt {i}" for i in range(5)])
    page = client_for(clear).get(f"/api/jobs/{job['id']}/outputs?limit=1000000").json()
    assert page["count"] == 5 and [o["prompt"] for o in page["results"]] == ["prompt 0", "prompt 1", "prompt 2"]
    assert "offset=3" in page["next"]


def test_a_submit_past_the_users_job_storage_is_refused_saying_how_much_and_how_to_make_room(
    deployment, alice, settings
) -> None:
    settings.MAX_STORED_JOB_BYTES_PER_USER = 100
    _, clear = create_api_key(user=alice)
    first = submit(clear, ["x" * 60])
    refused = client_for(clear).post("/api/jobs", {"model": "d", "prompts": ["y" * 30, "z" * 20], "max_tokens": 4})
    assert refused.status_code == 413, refused.content
    body = refused.json()
    assert (body["code"], body["stored_bytes"], body["adding_bytes"], body["quota_bytes"]) == (
        "job_storage_full",
        60,
        50,
        100,
    )
    assert body["detail"].startswith(
        "your jobs store 0.0 MiB of prompts, answers and metrics, and this job's prompts add"
    )
    assert "DELETE /api/jobs/<id>" in body["detail"]
    assert (Job.objects.count(), JobOutput.objects.count()) == (1, 1)  # nothing of it was stored
    _, bobs = create_api_key(user=get_user_model().objects.create_user("bob"))
    assert client_for(bobs).get(f"/api/jobs/{first['id']}").status_code == 404
    assert client_for(bobs).delete(f"/api/jobs/{first['id']}").status_code == 404  # not bob's to delete
    submit(bobs, ["y" * 30, "z" * 20])  # a quota per user

    running = client_for(clear).delete(f"/api/jobs/{first['id']}")
    assert running.status_code == 409 and "cancel it first" in running.json()["detail"]
    assert client_for(clear).post(f"/api/jobs/{first['id']}/cancel").status_code == 200
    assert client_for(clear).delete(f"/api/jobs/{first['id']}").status_code == 204
    assert not JobOutput.objects.filter(job_id=first["id"]).exists()
    submit(clear, ["y" * 30, "z" * 20])  # room made


def test_the_migration_cuts_stored_outputs_metrics_to_their_summary_and_counts_their_bytes(alice) -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before, after = [("serving", "0002_job_api_key")], [("serving", "0003_output_metrics_summary_and_stored_bytes")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()  # where the test leaves the schema: every later test needs it
    executor.migrate(before)
    try:
        apps = executor.loader.project_state(before).apps
        old_job = apps.get_model("serving", "Job").objects.create(owner_id=alice.pk, model_name="d", max_tokens=4)
        metrics = {**SUMMARY, "per_step": per_step_record(64, 32), "per_step_omitted": 0}
        apps.get_model("serving", "JobOutput").objects.create(
            job=old_job, index=0, prompt="hi", text="ok", token_ids=[1, 2], metrics=metrics
        )
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(after)
    try:
        (output,) = JobOutput.objects.all()
    finally:
        MigrationExecutor(connection).migrate(latest)
    assert output.metrics == SUMMARY
    assert output.stored_bytes == len("hi") + len("ok") + len("[1,2]") + results.json_bytes(SUMMARY)
