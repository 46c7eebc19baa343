"""ASGI entry point of the control plane: HTTP through Django, websockets through Channels.

Static files (the admin's and Swagger UI's) are served by the app itself, so the platform
needs no separate web server; a large deployment may put one in front for ``/static/``.
Everything passes the edge's cap on request bodies and websocket frames first
(``controlplane/edge.py``): no view reads a body past ``MAX_REQUEST_BYTES``.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.config.settings.local")
django_application = get_asgi_application()  # sets Django up before the routes import models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from controlplane.chat.routing import websocket_urlpatterns as chat_routes  # noqa: E402
from controlplane.console.routing import websocket_urlpatterns as console_routes  # noqa: E402
from controlplane.edge import BodyLimit  # noqa: E402
from controlplane.nodes.routing import websocket_urlpatterns as agent_routes  # noqa: E402

application = BodyLimit(
    ProtocolTypeRouter(
        {
            "http": ASGIStaticFilesHandler(django_application),
            # Agents authenticate with their node credential; the chat and console routes carry
            # their own session and origin checks.
            "websocket": URLRouter([*agent_routes, *chat_routes, *console_routes]),
        }
    ),
    max_bytes=settings.MAX_REQUEST_BYTES,
)
