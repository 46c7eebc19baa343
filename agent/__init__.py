"""The odmoe agent: a small daemon per GPU box that enrolls it with the control plane.

Today it enrolls (spending a join token once), keeps its node credential, and checks it
with the control plane. The agent link (websocket, commands and heartbeats), shard
downloads and running the runtime's roles are not built yet.
"""
