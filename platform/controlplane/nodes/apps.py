from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "controlplane.nodes"
    label = "nodes"
    verbose_name = "Nodes"

    def ready(self) -> None:
        from controlplane import schema  # noqa: F401 - registers the OpenAPI auth schemes

        from . import tls  # noqa: F401 - registers the check of ODMOE_TLS_CERT_FILE
