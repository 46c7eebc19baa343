"""Production: refuses to start with debug on or without a secret key of its own; HTTPS only.

It runs behind the TLS proxy of ``deploy/`` (the proxy passes ``X-Forwarded-Proto``, which the
ASGI server trusts from 127.0.0.1): a plain-HTTP request is redirected to HTTPS, and browsers are
told to use HTTPS only for a year (HSTS; ``ODMOE_HSTS_SECONDS``, 0 turns it off).
"""

import os

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import CACHES, DEBUG, INSECURE_DEV_SECRET, METRICS_TOKEN, SECRET_KEY, SECRET_KEY_FALLBACKS

if DEBUG:
    raise ImproperlyConfigured("DJANGO_DEBUG must be off in production")
# The example in deploy/odmoe.env.example is long enough to pass a length check: refuse it by name.
PUBLISHED_SECRETS = {INSECURE_DEV_SECRET, "replace-with-64-random-characters"}
if SECRET_KEY in PUBLISHED_SECRETS or SECRET_KEY.startswith("replace-with") or len(SECRET_KEY) < 32:
    raise ImproperlyConfigured(
        "set DJANGO_SECRET_KEY to a random value of at least 32 characters "
        "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(48))'), not the example's"
    )
if PUBLISHED_SECRETS & set(SECRET_KEY_FALLBACKS):
    raise ImproperlyConfigured("DJANGO_SECRET_KEY_FALLBACKS holds a published key: remove it")

# /metrics answers only ``Authorization: Bearer $ODMOE_METRICS_TOKEN``: a credential of the scraper's,
# which no person holds and which can do nothing else. Unset, /metrics is served to nobody (403),
# rather than the server refusing to start: a platform without Prometheus must not need one.
METRICS_TOKEN_ONLY = True
if METRICS_TOKEN and (METRICS_TOKEN.startswith("replace-with") or len(METRICS_TOKEN) < 32):
    raise ImproperlyConfigured(
        "set ODMOE_METRICS_TOKEN to a random value of at least 32 characters "
        "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'), "
        "or leave it unset to serve /metrics to nobody"
    )

# Throttle counts shared by every server process.
CACHES = {**CACHES, "default": CACHES["shared"]}

SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
# The TLS proxy sets X-Forwarded-Proto (overwriting any a client sent): a request it took over
# https is secure, so the console shows https commands with the certificate's pin.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_SSL_REDIRECT = True
SECURE_HSTS_SECONDS = int(os.environ.get("ODMOE_HSTS_SECONDS", str(365 * 24 * 3600)))
# Left to the operator: other names under this domain may not serve HTTPS, and a preload list
# entry is hard to undo. (A browser ignores HSTS from a certificate it does not trust, so a
# self-signed server is not locked out by it.)
SECURE_HSTS_INCLUDE_SUBDOMAINS = os.environ.get("ODMOE_HSTS_INCLUDE_SUBDOMAINS", "") == "1"
SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]  # the two choices above, made on purpose
