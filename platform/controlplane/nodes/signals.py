"""What the nodes app tells other apps, without knowing them (the deployments app listens).

``runtime_reported``: a node's agent said what its runtime roles are doing; ``reports`` is a
list of ``inference.wire.link.RoleState`` as JSON, ``complete`` when it is every role the box runs
(a heartbeat, ``[]`` when it runs none) rather than one that changed (a role-state event); a
receiver answers whether the node is settled (``deployments.lifecycle.reconcile``).
``nodes_went_offline``: these nodes' agents fell silent or disconnected. ``node_removing``:
this node is about to be deleted; let go of it (inside the deleting transaction, so a
receiver that refuses rolls everything back).
"""

from django.dispatch import Signal

runtime_reported = Signal()  # kwargs: node_id, reports, complete
nodes_went_offline = Signal()  # kwargs: node_ids
node_removing = Signal()  # kwargs: node_id, name
