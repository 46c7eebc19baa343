"""Celery queues: jobs run apart from the control work (offline detection, deployment pushes)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from controlplane.ops.processes import python_env


def test_jobs_have_a_queue_of_their_own_and_liveness_never_waits_behind_them() -> None:
    from controlplane.chat.tasks import settle_interrupted_answers_task
    from controlplane.config.celery_app import app
    from controlplane.nodes.tasks import expire_silent_nodes_task
    from controlplane.ops.processes import celery_argv
    from controlplane.serving.tasks import run_job_output_task

    router = app.amqp.router
    assert router.route({}, run_job_output_task.name)["queue"].name == "jobs"
    assert router.route({}, expire_silent_nodes_task.name)["queue"].name == "celery"
    assert router.route({}, settle_interrupted_answers_task.name)["queue"].name == "celery"
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert {expire_silent_nodes_task.name, settle_interrupted_answers_task.name} <= scheduled
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


def test_a_process_that_never_imported_a_tasks_module_queues_by_name() -> None:
    """The web process and ``manage.py`` commands queue tasks without having imported any tasks module."""
    code = (
        "import django\n"
        "django.setup()\n"
        "import sys\n"
        "from celery.app.task import Task\n"
        "assert 'controlplane.deployments.tasks' not in sys.modules\n"
        "sent = []\n"
        "Task.delay = lambda self, *args: sent.append((self.name, args))  # no broker: record the send\n"
        "from controlplane.queueing import queue_task\n"
        "queue_task('controlplane.deployments.tasks.push_deployment_task', 7, 2)\n"
        "assert sent == [('controlplane.deployments.tasks.push_deployment_task', (7, 2))], sent\n"
    )
    in_a_fresh_process(code)


def test_threads_queueing_at_once_in_a_fresh_process_each_find_their_task() -> None:
    """Celery's autodiscovery returns at once, having found nothing, in a thread that calls it while
    another thread's discovery is under way (``celery.loaders.base._RACE_PROTECTION``): under the
    restart load run, a web process's first job and a heartbeat's write queued at once, and the
    job's POST got a 500 with "no Celery task is named ..." (``load-restarts-jobs-1``)."""
    code = (
        "import django\n"
        "django.setup()\n"
        "import threading\n"
        "from celery.app.task import Task\n"
        "sent = []\n"
        "Task.delay = lambda self, *args: sent.append(self.name)  # no broker: record the send\n"
        "from controlplane.queueing import queue_task\n"
        "names = ['controlplane.serving.tasks.run_job_output_task',\n"
        "         'controlplane.deployments.tasks.push_deployment_task']\n"
        "start, errors = threading.Barrier(8), []\n"
        "def queue(i):\n"
        "    start.wait()\n"
        "    try:\n"
        "        queue_task(names[i % 2], i)\n"
        "    except LookupError as exc:\n"
        "        errors.append(str(exc))\n"
        "threads = [threading.Thread(target=queue, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors and len(sent) == 8, errors\n"
    )
    in_a_fresh_process(code)


def in_a_fresh_process(code: str) -> None:
    """Run ``code`` in a new Python process under the test settings (no tasks module imported yet):
    it passes when it exits 0."""
    env = python_env(DJANGO_SETTINGS_MODULE="controlplane.config.settings.test")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
