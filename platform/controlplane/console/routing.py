from channels.auth import AuthMiddlewareStack
from django.urls import path

from controlplane.origins import SameOriginValidator

from .consumers import ConsoleConsumer

websocket_urlpatterns = [
    path("ws/console/", SameOriginValidator(AuthMiddlewareStack(ConsoleConsumer.as_asgi()))),
]
