"""URL map of the control plane."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("controlplane.nodes.urls")),
    path("api/", include("controlplane.artifacts.urls")),
    path("api/", include("controlplane.deployments.urls")),
]
