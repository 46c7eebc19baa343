"""Model I/O: checkpoints, tensor files, the model families and their releases, reading and checking
shards, and main's model built from its shard.
"""
