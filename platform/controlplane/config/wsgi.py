"""WSGI entry point (the ASGI one, for websockets, is asgi.py)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.config.settings.local")
application = get_wsgi_application()
