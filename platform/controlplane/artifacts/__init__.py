"""Artifacts: model checkpoints registered with the control plane, and their role shards."""
