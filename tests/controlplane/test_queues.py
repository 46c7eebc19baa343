"""Celery queues: jobs run apart from the control work (offline detection, deployment pushes)."""

from __future__ import annotations

import re

import pytest


def test_jobs_have_a_queue_of_their_own_and_liveness_never_waits_behind_them() -> None:
    from controlplane.config.celery_app import app
    from controlplane.nodes.tasks import expire_silent_nodes_task
    from controlplane.ops.processes import celery_argv
    from controlplane.serving.tasks import run_job_output_task

    router = app.amqp.router
    assert router.route({}, run_job_output_task.name)["queue"].name == "jobs"
    assert router.route({}, expire_silent_nodes_task.name)["queue"].name == "celery"
    argv = celery_argv(beat_schedule=None, queues=("jobs",), name="jobs")
    assert argv[argv.index("--queues") + 1] == "jobs" and "--beat" not in argv


def test_every_task_a_service_queues_by_name_is_the_task_of_that_name() -> None:
    from controlplane.artifacts import services, tasks
    from controlplane.config.celery_app import app
    from controlplane.deployments import lifecycle
    from controlplane.deployments import tasks as deployment_tasks
    from controlplane.serving import jobs
    from controlplane.serving import tasks as serving_tasks

    queued = {
        services.BUILD_MODEL_SHARDS_TASK: tasks.build_model_shards_task,
        services.DOWNLOAD_MODEL_TASK: tasks.download_model_task,
        lifecycle.PUSH_DEPLOYMENT_TASK: deployment_tasks.push_deployment_task,
        jobs.RUN_JOB_OUTPUT_TASK: serving_tasks.run_job_output_task,
    }
    for name, task in queued.items():
        assert app.tasks[name] is task._get_current_object()  # shared_task gives a proxy


def test_queueing_a_task_that_does_not_exist_says_so() -> None:
    from controlplane.queueing import queue_task

    with pytest.raises(LookupError, match=re.escape("no Celery task is named 'controlplane.nowhere.task'")):
        queue_task("controlplane.nowhere.task", 1)
