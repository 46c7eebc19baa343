"""The odmoe agent: a small daemon per GPU box that joins it to the control plane and runs its roles.

It enrolls (spending a join token once), keeps its node credential, checks the box
(``agent.doctor``), and holds the agent link: one websocket to the control plane with
heartbeats (inventory, role states) up and commands down, reconnecting with backoff. On
command it downloads shards (``agent.download``) and starts, watches and restarts the
runtime's role processes (``agent.runtime``). It ships as its own package with the runtime
(``platform/controlplane/nodes/agent_wheel.py``), without any part of the control plane.
"""
