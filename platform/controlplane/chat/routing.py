from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import ChatConsumer

# Browsers authenticate with their session cookie, and only from a page of this site.
websocket_urlpatterns = [
    path("ws/chat/", AllowedHostsOriginValidator(AuthMiddlewareStack(ChatConsumer.as_asgi()))),
]
