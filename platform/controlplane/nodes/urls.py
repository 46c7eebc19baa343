from django.urls import path

from . import api

# URL patterns, one per line: alike deployments/urls.py's by shape, on purpose.
urlpatterns = [
    path("agents/enroll", api.EnrollApi.as_view(), name="agent-enroll"),
    path("agents/me", api.AgentMeApi.as_view(), name="agent-me"),
    path("join-tokens", api.JoinTokenApi.as_view(), name="join-tokens"),
    path("nodes", api.NodeListApi.as_view(), name="nodes"),
    path("nodes/<uuid:node_id>", api.NodeDetailApi.as_view(), name="node-detail"),
    path("nodes/<uuid:node_id>/drain", api.NodeDrainApi.as_view(), name="node-drain"),
    path("nodes/<uuid:node_id>/rotate-credential", api.NodeRotateCredentialApi.as_view(), name="node-rotate"),
    path("nodes/<uuid:node_id>/fetch", api.NodeFetchApi.as_view(), name="node-fetch"),
    path("nodes/<uuid:node_id>/tasks", api.NodeTasksApi.as_view(), name="node-tasks"),
]
