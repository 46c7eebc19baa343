"""Building per-role shards from a checkpoint, and the memory each role of a deployment needs."""
