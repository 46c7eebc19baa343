from django.apps import AppConfig


class ArtifactsConfig(AppConfig):
    name = "controlplane.artifacts"
    label = "artifacts"
    verbose_name = "Models"
