"""The odmoe agent: a small daemon per GPU box that enrolls it with the control plane.

Today it enrolls (spending a join token once), keeps its node credential, and holds the
agent link: one websocket to the control plane with heartbeats (inventory) up and commands
down, reconnecting with backoff. Shard downloads and running the runtime's roles are not
built yet.
"""
