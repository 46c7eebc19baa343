"""A laptop or a single box: SQLite under var/ unless DATABASE_URL says otherwise.

Debug stays off unless ``DJANGO_DEBUG=1`` asks for it: ``make run`` serves a real chat and a
real API on a port, and Django's debug pages show settings and code to whoever reaches them.
Without ``DJANGO_SECRET_KEY`` the signing key is this install's own, made once and kept in
``var/secret_key`` (mode 0600), never a key published with the source.
"""

import os
import secrets

from .base import *  # noqa: F403
from .base import VAR_DIR

VAR_DIR.mkdir(parents=True, exist_ok=True)


def _install_secret() -> str:
    path = VAR_DIR / "secret_key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(48))
    return path.read_text().strip()


if "DJANGO_SECRET_KEY" not in os.environ:
    SECRET_KEY = _install_secret()
