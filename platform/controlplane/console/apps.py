from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "controlplane.console"
    label = "console"
    verbose_name = "Admin console"
