"""Production: refuses to start with debug on or with the development secret key."""

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import DEBUG, INSECURE_DEV_SECRET, REDIS_URL, SECRET_KEY

if DEBUG:
    raise ImproperlyConfigured("DJANGO_DEBUG must be off in production")
# The example in deploy/odmoe.env.example is long enough to pass a length check: refuse it by name.
PUBLISHED_SECRETS = {INSECURE_DEV_SECRET, "replace-with-64-random-characters"}
if SECRET_KEY in PUBLISHED_SECRETS or SECRET_KEY.startswith("replace-with") or len(SECRET_KEY) < 32:
    raise ImproperlyConfigured(
        "set DJANGO_SECRET_KEY to a random value of at least 32 characters "
        "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(48))'), not the example's"
    )

# Throttle counts shared by every server process.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "odmoe",
    }
}

SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
# The TLS proxy sets X-Forwarded-Proto (overwriting any a client sent): a request it took over
# https is secure, so the console shows https commands with the certificate's pin.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
