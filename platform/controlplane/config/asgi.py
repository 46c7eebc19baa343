"""ASGI entry point of the control plane."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.config.settings.local")
application = get_asgi_application()
