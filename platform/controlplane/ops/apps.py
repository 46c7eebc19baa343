from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "controlplane.ops"
    label = "ops"
    verbose_name = "Running the platform"
