"""The test suite: fast password hashing, its own signing key and a file-backed SQLite test database.

The database is a file (not in memory) so that a real Celery worker process started by
the tests sees what the tests write. ``DATABASE_URL`` overrides it (e.g. PostgreSQL).
"""

import os

from .base import *  # noqa: F403
from .base import SQLITE_OPTIONS, VAR_DIR

# The suite's own key, the same in every process it starts (they share sessions); never a production one.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or "odmoe-test-suite-only-key-not-for-any-server"

if "DATABASE_URL" not in os.environ:
    (VAR_DIR / "test").mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "test" / "unused.sqlite3"),
            # One file per test run, so that two runs on one machine never share it.
            "TEST": {"NAME": str(VAR_DIR / "test" / f"db-{os.getpid()}.sqlite3")},
            "OPTIONS": SQLITE_OPTIONS,
        }
    }
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# The suite makes thousands of calls from one address within a minute; the tests of the
# throttles themselves set their own rates.
REST_FRAMEWORK = {
    **REST_FRAMEWORK,  # noqa: F405
    "DEFAULT_THROTTLE_RATES": {"user": "100000/minute", "anon": "100000/minute", "chat": "100000/minute"},
}
