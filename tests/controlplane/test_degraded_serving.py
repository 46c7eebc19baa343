"""Serving through faults: a degraded deployment whose main is ready still serves; one that cannot
serve answers 503 with Retry-After; a job's prompt waits for a restarting role instead of failing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts.services import create_api_key
from controlplane.artifacts.services import register_model
from controlplane.deployments.generation import can_serve
from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, MemberState, Role
from controlplane.nodes.services import create_join_token, enroll_node
from controlplane.serving import jobs
from controlplane.serving.models import Job, JobOutput, OutputStatus

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def deployment(tiny_model: Path) -> Deployment:
    model = register_model(name="tiny", path=str(tiny_model))
    made = Deployment.objects.create(name="d", model=model, status=DeploymentStatus.DEGRADED)
    for i, role in enumerate([Role.MAIN, Role.SHADOW, Role.WORKER]):
        _, token = create_join_token(created_by=None)
        node, _ = enroll_node(token=token, name=f"n{i}", inventory={})
        DeploymentNode.objects.create(
            deployment=made, node=node, role=role, worker_index=0 if role == Role.WORKER else None
        )
    return made


def test_a_degraded_deployment_serves_while_its_main_is_ready(deployment: Deployment) -> None:
    deployment.members.exclude(role=Role.WORKER).update(state=MemberState.READY)
    deployment.members.filter(role=Role.WORKER).update(state=MemberState.STARTING)  # restarting
    assert can_serve(deployment)
    deployment.members.filter(role=Role.MAIN).update(state=MemberState.STARTING)
    assert not can_serve(deployment)
    Deployment.objects.filter(pk=deployment.pk).update(status=DeploymentStatus.DEPLOYING)
    deployment.refresh_from_db()
    assert not can_serve(deployment)


def test_a_deployment_that_cannot_serve_answers_503_with_retry_after(deployment: Deployment) -> None:
    _, key = create_api_key(user=get_user_model().objects.create_user("user"))
    body = {"model": "d", "messages": [{"role": "user", "content": "hi"}]}
    response = Client().post(
        "/v1/chat/completions", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert response.json()["error"]["code"] == "model_not_ready"


def test_a_jobs_prompt_waits_for_the_cluster_then_fails_with_the_reason(deployment: Deployment) -> None:
    owner = get_user_model().objects.create_user("owner")
    job = Job.objects.create(owner=owner, deployment=deployment, model_name="d", max_tokens=4)
    output = JobOutput.objects.create(job=job, index=0, prompt="hi")
    delays = []
    for attempt in range(jobs.JOB_RETRIES):
        with pytest.raises(jobs.RetryLater) as later:
            jobs.run_output(output_id=output.pk, attempt=attempt)
        delays.append(later.value.after_s)
        output.refresh_from_db()
        assert output.status == OutputStatus.QUEUED and "will try again" in output.error
    assert delays == [5.0, 10.0, 20.0, 40.0, 80.0]
    jobs.run_output(output_id=output.pk, attempt=jobs.JOB_RETRIES)  # the last try: failed, with the reason
    output.refresh_from_db()
    assert output.status == OutputStatus.FAILED and "degraded" in output.error


def test_a_jobs_prompt_waits_while_redis_is_unreachable(deployment: Deployment, settings) -> None:
    """Redis restarting under a running job: the prompt is queued again, never left running for ever."""
    from channels.layers import channel_layers

    from inference.runtime.launcher import free_port

    deployment.members.update(state=MemberState.READY, port=5000)
    Deployment.objects.filter(pk=deployment.pk).update(status=DeploymentStatus.READY)
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [closed]}}
    }
    channel_layers.backends.clear()
    owner = get_user_model().objects.create_user("owner")
    job = Job.objects.create(owner=owner, deployment=deployment, model_name="d", max_tokens=4)
    output = JobOutput.objects.create(job=job, index=0, prompt="hi")
    try:
        with pytest.raises(jobs.RetryLater):
            jobs.run_output(output_id=output.pk, attempt=0)
    finally:
        channel_layers.backends.clear()
    output.refresh_from_db()
    assert output.status == OutputStatus.QUEUED and "will try again" in output.error
