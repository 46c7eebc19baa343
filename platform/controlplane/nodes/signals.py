"""What the nodes app tells other apps, without knowing them (the deployments app listens).

``runtime_reported``: a node's agent said what its runtime role is doing (a heartbeat or a
role-state event); ``report`` is ``agent.messages.RoleState`` as JSON, or ``{}`` when the
box runs no role. ``nodes_went_offline``: these nodes' agents fell silent or disconnected.
``node_removing``: this node is about to be deleted; let go of it (inside the deleting
transaction, so a receiver that refuses rolls everything back).
"""

from django.dispatch import Signal

runtime_reported = Signal()  # kwargs: node_id, report
nodes_went_offline = Signal()  # kwargs: node_ids
node_removing = Signal()  # kwargs: node_id, name
