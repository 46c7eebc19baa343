"""The test suite's own database: how a run chooses it, and that the processes a test starts share it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.config.settings.test import ENGINES, choose_test_database
from controlplane.ops.processes import python_env
from inference.runtime.launcher import free_port
from tests.controlplane.live import database_url


@pytest.fixture
def nobody_at() -> str:
    """The URL of a PostgreSQL that is not there: a free port on loopback refuses at once."""
    return f"postgres://postgres@127.0.0.1:{free_port()}/postgres"


def test_sqlite_forced_is_sqlite_and_says_so(nobody_at: str) -> None:
    database, reason = choose_test_database({"ODMOE_TEST_DATABASE": "sqlite"}, nobody_at)
    assert database["ENGINE"] == ENGINES["sqlite"] and reason == "ODMOE_TEST_DATABASE=sqlite"


def test_postgres_forced_where_none_answers_fails_instead_of_falling_back(nobody_at: str) -> None:
    port = nobody_at.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(ImproperlyConfigured, match=rf"no PostgreSQL answers as postgres@127\.0\.0\.1:{port} .*refused"):
        choose_test_database({"ODMOE_TEST_DATABASE": "postgres"}, nobody_at)


def test_without_a_choice_and_without_postgres_the_run_uses_sqlite_and_says_why(nobody_at: str) -> None:
    database, reason = choose_test_database({}, nobody_at)
    assert database["ENGINE"] == ENGINES["sqlite"]
    assert reason.startswith("no PostgreSQL answers as postgres@127.0.0.1:") and "refused" in reason


def test_database_url_wins_and_a_force_that_contradicts_it_is_refused(nobody_at: str) -> None:
    elsewhere = "sqlite:////tmp/elsewhere.sqlite3"
    database, reason = choose_test_database({"DATABASE_URL": elsewhere}, nobody_at)
    assert database["ENGINE"] == ENGINES["sqlite"] and database["NAME"] == "/tmp/elsewhere.sqlite3"
    assert reason == "DATABASE_URL"
    with pytest.raises(ImproperlyConfigured, match=r"ODMOE_TEST_DATABASE=postgres but DATABASE_URL names .*sqlite3"):
        choose_test_database({"DATABASE_URL": elsewhere, "ODMOE_TEST_DATABASE": "postgres"}, nobody_at)
    with pytest.raises(ImproperlyConfigured, match="'mysql': use sqlite or postgres"):
        choose_test_database({"ODMOE_TEST_DATABASE": "mysql"}, nobody_at)


@pytest.mark.django_db
def test_this_runs_test_database_is_named_after_this_process() -> None:
    from django.db import connection

    assert str(os.getpid()) in os.path.basename(connection.settings_dict["NAME"])


@pytest.mark.django_db(transaction=True)
def test_a_process_a_test_starts_reads_what_the_test_wrote() -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection

    get_user_model().objects.create_user("written-by-the-test")
    probe = (
        "import django; django.setup()\n"
        "from django.contrib.auth import get_user_model\n"
        "from django.db import connection\n"
        "print(connection.vendor, list(get_user_model().objects.values_list('username', flat=True)))\n"
    )
    env = python_env(DJANGO_SETTINGS_MODULE="controlplane.config.settings.test", DATABASE_URL=database_url())
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [connection.vendor, "['written-by-the-test']"]
