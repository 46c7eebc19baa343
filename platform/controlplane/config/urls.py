"""URL map of the control plane."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.nodes import install

# The database away (PostgreSQL restarting) outside a view is a 503 as inside one.
handler500 = "controlplane.database_away.server_error"

urlpatterns = [
    # The front page is the chat; staff reach the admin (nodes, models, deployments) from its bar.
    path("", RedirectView.as_view(url="/chat/", permanent=False)),
    path("admin/", admin.site.urls),
    path("agent/install.sh", install.install_script, name="agent-install"),
    path("agent/facts", install.agent_facts, name="agent-facts"),
    path("agent/<str:filename>", install.agent_package, name="agent-package"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/", include("controlplane.nodes.urls")),
    path("api/", include("controlplane.artifacts.urls")),
    path("api/", include("controlplane.deployments.urls")),
    path("", include("controlplane.accounts.urls")),
    path("", include("controlplane.serving.urls")),
    path("", include("controlplane.chat.urls")),
    path("", include("controlplane.console.urls")),
    path("accounts/", include("django.contrib.auth.urls")),
]
