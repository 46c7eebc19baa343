from channels.auth import AuthMiddlewareStack
from django.urls import path

from controlplane.origins import SameOriginValidator

from .consumers import ChatConsumer

# Browsers authenticate with their session cookie, and only from a page of this site.
websocket_urlpatterns = [
    path("ws/chat/", SameOriginValidator(AuthMiddlewareStack(ChatConsumer.as_asgi()))),
]
