"""A laptop or a single box: debug on, SQLite under var/ unless DATABASE_URL says otherwise."""

import os

os.environ.setdefault("DJANGO_DEBUG", "1")

from .base import *  # noqa: F403
from .base import VAR_DIR

VAR_DIR.mkdir(parents=True, exist_ok=True)
