"""Production: refuses to start with debug on or with the development secret key."""

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import DEBUG, INSECURE_DEV_SECRET, SECRET_KEY

if DEBUG:
    raise ImproperlyConfigured("DJANGO_DEBUG must be off in production")
if SECRET_KEY == INSECURE_DEV_SECRET or len(SECRET_KEY) < 32:
    raise ImproperlyConfigured("set DJANGO_SECRET_KEY to a random value of at least 32 characters")

SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
