"""Shared fixtures: tiny checkpoints written once per session; the database a run uses, in its header;
torch's default dtype checked after every test; local clusters' roles forked from a zygote; under
pytest-xdist, each worker's own ports, and the tests that time themselves run alone."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference.runtime.launcher import PORT_RANGE_ENV, SPAWN_ENV, port_range
from inference.tools.tiny import make_tiny
from tests.durations import load, order
from tests.reference import ODD_SHAPE


def xdist_worker() -> tuple[int, int] | None:
    """This process's index among pytest-xdist's workers and their count; None outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if not name.startswith("gw"):
        return None
    return int(name[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_configure(config: pytest.Config) -> None:
    """Local clusters' role processes fork from a zygote that imported their code once
    (``inference.runtime.zygote``), unless a test asks for fresh ones (those that measure a role's
    memory). Under pytest-xdist, each worker picks ports (``free_port``) from a slice of the range of
    its own, and so does every process it starts (servers, Celery, agents and their roles inherit
    the variable): two workers never take the same port between one's probe and its bind."""
    os.environ.setdefault(SPAWN_ENV, "fork")
    worker = xdist_worker()
    if worker is None:
        return
    os.environ[PORT_RANGE_ENV] = "{}-{}".format(*worker_ports(*worker, port_range()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test: it holds the
    run's lock file exclusively, every other test holds it shared, from its setup (module fixtures
    included) to its teardown. Its own timing then meets the bound it asserts as in a serial run."""
    if xdist_worker() is None:
        return (yield)
    lock = Path(item.config.option.basetemp).parent / "alone.lock"  # the run's, beside popen-gwN
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the test files longest first, by a whole run's seconds per file
    (``tests/durations.py``): xdist deals files out in collection order (the Makefile turns off its
    own reordering, by number of tests), so the run ends on short files rather than on a long one
    dealt last. The tests of a file keep their order."""
    if xdist_worker() is None:
        return
    rank = order([item.path for item in items], load())
    items.sort(key=lambda item: rank[item.path])


def worker_ports(index: int, count: int, ports: tuple[int, int]) -> tuple[int, int]:
    """Worker ``index``'s slice of ``ports`` (both ends included) among ``count`` workers."""
    low, high = ports
    width = (high - low + 1) // count
    return low + index * width, low + (index + 1) * width - 1


def pytest_report_header(config: pytest.Config) -> str:
    """Which database this run's Django tests use, and why (``controlplane.config.settings.test``)."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    reason = getattr(settings, "TEST_DATABASE_REASON", "DJANGO_SETTINGS_MODULE")
    name = db.get("TEST", {}).get("NAME") or db["NAME"]
    if db["ENGINE"] == "django.db.backends.postgresql":
        where = f"PostgreSQL at {db['HOST'] or 'the local socket'}:{db['PORT'] or 5432}, test database {name}"
    elif db["ENGINE"] == "django.db.backends.sqlite3":
        where = f"SQLite, test database {name}"
    else:
        where = f"{db['ENGINE']}, test database {name}"
    return f"database: {where} ({reason}; ODMOE_TEST_DATABASE=sqlite|postgres forces one)"


@pytest.fixture(autouse=True)
def torch_default_dtype_unchanged() -> Iterator[None]:
    """No test leaves torch's process-wide default dtype changed (roles built in threads of this
    process once left bf16 behind, and fp32 tests after them failed)."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"this test left torch's default dtype at {after} (it was {before})")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def odd_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("odd") / "model", seed=1, **ODD_SHAPE)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker) -> Iterator[None]:
    """pytest-django's, and before it drops a PostgreSQL test database: the sessions still open on
    it are ended. Channels' test communicator keeps a consumer from closing its connections (on
    the threads of ``database_sync_to_async``) and a killed process may leave one behind; any of
    them would make ``DROP DATABASE`` fail and leave this run's database on the server."""
    yield
    from django.db import connections

    with django_db_blocker.unblock():
        for connection in connections.all():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                connection.close()
