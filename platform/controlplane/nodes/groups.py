"""The channel-layer groups of the agent links: one per node (commands to its agent) and one per
generation (its events, to whoever streams them). Named here, below both the link's consumer
(``consumers``) and the services that send to a node, so neither imports the other for them."""

from __future__ import annotations


def node_group(node_id: str) -> str:
    return f"node.{node_id}"


def generation_group(request_id: str) -> str:
    return f"generation.{request_id}"
