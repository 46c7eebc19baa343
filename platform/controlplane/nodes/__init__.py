"""Nodes: the GPU boxes of the cluster — join tokens, enrollment, node credentials."""
