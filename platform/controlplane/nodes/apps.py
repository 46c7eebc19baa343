from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "controlplane.nodes"
    label = "nodes"
    verbose_name = "Nodes"
