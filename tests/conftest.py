"""Shared fixtures: tiny checkpoints written once per session; the database a run uses, in its header."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.tiny import make_tiny
from tests.reference import ODD_SHAPE


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def odd_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("odd") / "model", seed=1, **ODD_SHAPE)
