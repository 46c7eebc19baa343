from django.urls import path

from . import api

urlpatterns = [
    path("deployments", api.DeploymentListApi.as_view(), name="deployments"),
    path("deployments/suggest", api.SuggestApi.as_view(), name="deployment-suggest"),
    path("deployments/estimate", api.EstimateApi.as_view(), name="deployment-estimate"),
    path("deployments/<int:deployment_id>", api.DeploymentDetailApi.as_view(), name="deployment-detail"),
    path("deployments/<int:deployment_id>/settings", api.DeploymentSettingsApi.as_view(), name="deployment-settings"),
    path("deployments/<int:deployment_id>/start", api.DeploymentStartApi.as_view(), name="deployment-start"),
    path("deployments/<int:deployment_id>/stop", api.DeploymentStopApi.as_view(), name="deployment-stop"),
    path("deployments/<int:deployment_id>/generate", api.DeploymentGenerateApi.as_view(), name="deployment-generate"),
]
