"""Celery queues: jobs run apart from the control work (offline detection, deployment pushes)."""

from __future__ import annotations


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
