"""The test suite: fast password hashing, an in-memory SQLite unless DATABASE_URL is set."""

import os

from .base import *  # noqa: F403

if "DATABASE_URL" not in os.environ:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
