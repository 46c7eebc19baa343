"""URL map of the control plane."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/", include("controlplane.nodes.urls")),
    path("api/", include("controlplane.artifacts.urls")),
    path("api/", include("controlplane.deployments.urls")),
]
