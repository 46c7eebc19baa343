from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import ConsoleConsumer

websocket_urlpatterns = [
    path("ws/console/", AllowedHostsOriginValidator(AuthMiddlewareStack(ConsoleConsumer.as_asgi()))),
]
