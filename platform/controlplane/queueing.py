"""Queue a Celery task by its name, from the service that decides the work.

A service decides what to run and queues it; its app's ``tasks.py`` is the thin wrapper that
calls the service back in a worker. Taking the task from the Celery app's registry by name,
rather than importing it, keeps a service and its task module from importing each other
(``.importlinter``: no import cycles). A task's name is its own (``module.function``), the
string ``CELERY_TASK_ROUTES`` and the beat schedule know it by; each service names the tasks
it queues in a constant, and ``tests/controlplane/test_queues.py`` checks every one of them
against the registry.
"""

from __future__ import annotations

import threading

from celery import current_app

# One thread discovers the tasks modules at a time: Celery's autodiscovery, called while another
# thread's is under way, returns at once having imported nothing (``_RACE_PROTECTION`` in
# ``celery.loaders.base``), and that thread's lookup failed (a job's POST answered 500 under load).
_discovering = threading.Lock()


def queue_task(name: str, *args: object) -> None:
    """Send the task ``name`` with ``args`` to its queue, as ``task.delay(*args)`` does."""
    if name not in current_app.tasks:
        # Outside a worker nothing has imported the apps' tasks modules yet: Celery's
        # autodiscovery runs when its loader imports the default modules, as a worker does at start.
        with _discovering:
            if name not in current_app.tasks:
                current_app.loader.import_default_modules()
    try:
        task = current_app.tasks[name]
    except KeyError:
        raise LookupError(f"no Celery task is named {name!r}: is its app's tasks module discovered?") from None
    task.delay(*args)
