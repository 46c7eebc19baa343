"""Names shared by the CLI, the specs and the roles, kept free of heavy imports."""

SHADOW_DTYPES = ("fp32", "bf16", "fp16", "int8", "nf4")
# The shadow dtype that is a checkpoint's own (config ``dtype``): no conversion needed.
OWN_SHADOW_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# What a role computes in: "auto" is the checkpoint's own dtype (config ``dtype``), as
# Transformers' ``from_pretrained(dtype="auto")`` loads it; the others override it.
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Where a worker keeps the experts it owns: "ram" reads its shard into host memory at start,
# "disk" reads each expert from the shard files when it is loaded (inference/store.py).
EXPERT_STORES = ("ram", "disk")

# The most sequences main may run at once (``Settings.max_batch``): each holds a thread and a KV cache.
MAX_BATCH = 64
# How a worker computes an expert's rows of several batched sequences (``Settings.batch_arithmetic``).
BATCH_ARITHMETICS = ("exact", "fused")
