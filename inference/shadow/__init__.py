"""The shadow's lossy model: quantization, the conversion of a checkpoint's tensors, and the model
built from a shard (used by the shard build and by the shadow role).
"""
