from django.urls import path

from . import views

urlpatterns = [
    path("chat/", views.chat, name="chat"),
    path("chat/<int:conversation_id>/", views.chat, name="chat-conversation"),
]
