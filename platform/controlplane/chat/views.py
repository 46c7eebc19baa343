"""Chat pages: the conversation list and one conversation, for any logged-in user."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.deployments.models import Deployment, DeploymentStatus

from .models import Conversation


@login_required
def chat(request: HttpRequest, conversation_id: int | None = None) -> HttpResponse:
    conversations = Conversation.objects.filter(owner=request.user)
    current = None
    if conversation_id is not None:
        current = conversations.filter(pk=conversation_id).first()
        if current is None:
            raise Http404("no such conversation")
    ready = Deployment.objects.filter(status=DeploymentStatus.READY).order_by("-updated_at").first()
    return render(
        request,
        "chat/chat.html",
        {
            "conversations": conversations[:100],
            "current": current,
            "messages": current.messages.all() if current else [],
            "ready": ready,
        },
    )
