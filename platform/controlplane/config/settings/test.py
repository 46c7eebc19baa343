"""The test suite: fast password hashing, its own signing key and a test database of this run's own.

Which database, decided once as the settings load (pytest's header says which and why):

1. ``DATABASE_URL``, if set. It is also how the processes a test starts (ASGI server, Celery,
   ``manage.py``) are pointed at the test process's own test database
   (``tests/controlplane/live.py``: ``database_url``).
2. Else ``ODMOE_TEST_DATABASE``: ``sqlite``, or ``postgres`` (PostgreSQL at 127.0.0.1:5432 as
   user ``postgres``; a run fails at once if none answers there, it never falls back).
3. Else that PostgreSQL if it answers within ``PROBE_TIMEOUT_S``, else SQLite.

The test database is this run's own: a SQLite file named after the process (a file, not in
memory, so that the processes the tests start see what the tests write), or a PostgreSQL
database named after the process and a random suffix (two runs on one machine, or two
machines on one server, never share one nor drop each other's). pytest-django creates it
and drops it at the end of the run.
"""

import os
import secrets
import urllib.parse
from collections.abc import Mapping

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import VAR_DIR, database_from_url

# The suite's own key, the same in every process it starts (they share sessions); never a production one.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or "odmoe-test-suite-only-key-not-for-any-server"

LOCAL_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/postgres"
PROBE_TIMEOUT_S = 2  # libpq's smallest useful connect_timeout; a refused port answers at once
ENGINES = {"sqlite": "django.db.backends.sqlite3", "postgres": "django.db.backends.postgresql"}


def postgres_refusal(url: str) -> str:
    """Why PostgreSQL at ``url`` cannot be used; empty when a connection succeeds."""
    try:
        import psycopg
    except ImportError as exc:
        return f"psycopg is not installed ({exc})"
    try:
        psycopg.connect(url, connect_timeout=PROBE_TIMEOUT_S).close()
    except psycopg.Error as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return ""


def choose_test_database(environ: Mapping[str, str], local_url: str = LOCAL_POSTGRES_URL) -> tuple[dict, str]:
    """The ``default`` database's settings for a test run, and why it is that one."""
    forced = environ.get("ODMOE_TEST_DATABASE", "").strip().lower()
    if forced not in ("", "sqlite", "postgres"):
        raise ImproperlyConfigured(f"ODMOE_TEST_DATABASE={forced!r}: use sqlite or postgres (or leave it unset)")
    if environ.get("DATABASE_URL"):
        chosen = database_from_url(environ["DATABASE_URL"])
        if forced and chosen["ENGINE"] != ENGINES[forced]:
            raise ImproperlyConfigured(
                f"ODMOE_TEST_DATABASE={forced} but DATABASE_URL names {chosen['ENGINE']}: unset one of them"
            )
        return chosen, "DATABASE_URL"
    if forced == "sqlite":
        return sqlite_settings(), "ODMOE_TEST_DATABASE=sqlite"
    where = urllib.parse.urlsplit(local_url).netloc  # user@host:port
    refusal = postgres_refusal(local_url)
    if forced == "postgres":
        if refusal:
            raise ImproperlyConfigured(
                f"ODMOE_TEST_DATABASE=postgres, but no PostgreSQL answers as {where} ({refusal}): "
                "start one, set DATABASE_URL to one, or unset ODMOE_TEST_DATABASE"
            )
        return database_from_url(local_url), "ODMOE_TEST_DATABASE=postgres"
    if refusal:
        return sqlite_settings(), f"no PostgreSQL answers as {where}: {refusal}"
    return database_from_url(local_url), f"PostgreSQL answers as {where}"


def sqlite_settings() -> dict:
    return database_from_url(f"sqlite:///{VAR_DIR / 'test' / 'unused.sqlite3'}")


TEST_DATABASE, TEST_DATABASE_REASON = choose_test_database(os.environ)
if TEST_DATABASE["ENGINE"] == ENGINES["sqlite"]:
    (VAR_DIR / "test").mkdir(parents=True, exist_ok=True)
    TEST_DATABASE["TEST"] = {"NAME": str(VAR_DIR / "test" / f"db-{os.getpid()}.sqlite3")}
else:
    # Identifiers hold 63 bytes: this name is about 25.
    TEST_DATABASE["TEST"] = {"NAME": f"test_odmoe_{os.getpid()}_{secrets.token_hex(3)}"}
DATABASES = {"default": TEST_DATABASE}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# The suite makes thousands of calls from one address within a minute; the tests of the
# throttles themselves set their own rates.
REST_FRAMEWORK = {
    **REST_FRAMEWORK,  # noqa: F405
    "DEFAULT_THROTTLE_RATES": {"user": "100000/minute", "anon": "100000/minute", "chat": "100000/minute"},
}
