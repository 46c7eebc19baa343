from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "controlplane.deployments"
    label = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        from controlplane.nodes import signals

        from . import lifecycle

        def on_runtime(sender, *, node_id: str, reports: list, complete: bool, **kwargs) -> bool:
            return lifecycle.reconcile(node_id=node_id, reports=reports, complete=complete)

        def on_offline(sender, *, node_ids: list[str], **kwargs) -> None:
            lifecycle.nodes_went_offline(node_ids=node_ids)

        def on_removing(sender, *, node_id: str, name: str, **kwargs) -> None:
            lifecycle.release_node(node_id=node_id, name=name)

        signals.runtime_reported.connect(on_runtime, weak=False, dispatch_uid="deployments.reconcile")
        signals.node_removing.connect(on_removing, weak=False, dispatch_uid="deployments.release")
        signals.nodes_went_offline.connect(on_offline, weak=False, dispatch_uid="deployments.offline")
