from django.urls import path

from inference.wire.link import LINK_PATH

from . import consumers

websocket_urlpatterns = [path(LINK_PATH.lstrip("/"), consumers.AgentConsumer.as_asgi())]
