"""ASGI entry point of the control plane: HTTP through Django, websockets through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.config.settings.local")
django_application = get_asgi_application()  # sets Django up before the routes import models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from controlplane.nodes.routing import websocket_urlpatterns as agent_routes  # noqa: E402

application = ProtocolTypeRouter({"http": django_application, "websocket": URLRouter(agent_routes)})
