"""Making and checking the control plane's secrets (join tokens, node credentials)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

JOIN_TOKEN_PREFIX = "odmoe-join-"
NODE_SECRET_PREFIX = "odmoe-node-"


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    """What is stored instead of ``secret``: its SHA-256 (secrets are random, 256 bits)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(secret), stored_digest)
