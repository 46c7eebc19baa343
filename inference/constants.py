"""Names shared by the CLI, the specs and the roles, kept free of heavy imports."""

SHADOW_DTYPES = ("fp32", "bf16", "fp16", "int8", "nf4")
# Elements per fp32 absmax in an nf4 shadow (inference.shadow.quant quantizes so; inference.building.memory sizes so).
NF4_BLOCKSIZE = 64
# The shadow dtype that is a checkpoint's own (config ``dtype``): no conversion needed.
OWN_SHADOW_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# What a role computes in: "auto" is the checkpoint's own dtype (config ``dtype``), as
# Transformers' ``from_pretrained(dtype="auto")`` loads it; the others override it.
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Where a worker keeps the experts it owns: "ram" reads its shard into host memory at start,
# "disk" reads each expert from the shard files when it is loaded (inference/runtime/disk_store.py), "hot"
# reads them from disk too but keeps the last ``hot_experts`` in RAM, predicted ones pinned
# until used (inference/policies/hotset.py).
EXPERT_STORES = ("ram", "disk", "hot")

# How a shard build writes the experts of worker shards: "none" as the checkpoint holds them,
# "exponent-plane" each weight's exponent bits coded and the rest raw, lossless
# (inference/modelio/expert_codec.py). A shard's manifest names the code of each tensor it
# stores coded, with its dtype, shape, raw and stored bytes: a build writes EXPONENT_PALETTE_CODEC
# (the exponents as fixed-width codes a GPU decodes, inference/modelio/exponent_palette.py); a
# set built before it, EXPONENT_PLANE_CODEC (the exponents through zstandard), still reads.
EXPONENT_PLANE = "exponent-plane"
EXPERT_CODECS = ("none", EXPONENT_PLANE)
EXPONENT_PLANE_CODEC = "exponent-plane+zstd"
EXPONENT_PALETTE_CODEC = "exponent-plane+palette"
# The expert codec whose worker shards store tensors with each per-tensor code.
EXPERT_CODEC_OF_CODE = {EXPONENT_PLANE_CODEC: EXPONENT_PLANE, EXPONENT_PALETTE_CODEC: EXPONENT_PLANE}
# Bytes per word of the dtypes it codes, by their safetensors names.
CODED_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}

# The most sequences main may run at once (``DeploymentSettings.max_batch``): each holds a thread and a KV cache.
MAX_BATCH = 64
# The most tokens the shadow may draft for one decode pass of main (``DeploymentSettings.draft_tokens``): each
# drafted position is one more row of every layer's exchange and one more shadow step.
MAX_DRAFT_TOKENS = 16
# How many of them a pass drafts (``DeploymentSettings.draft_policy``): always ``draft_tokens``, or per pass from
# the measured agreement and costs, up to ``draft_tokens`` (``inference.policies.drafting``).
DRAFT_POLICIES = ("fixed", "auto")
# How main's agent carries an answer across main's restart (``DeploymentSettings.replay``): the tokens already
# sent re-read as prompt (one prefill), or the request run again from its start (``agent.migration``).
REPLAY_MODES = ("prefill", "exact")
MAX_MIGRATIONS_LIMIT = (
    8  # the most main restarts one answer may be carried across (``DeploymentSettings.max_migrations``)
)
# Requests main holds beyond its batch (``DeploymentSettings.max_waiting``), and the generations one user may
# have in main at once, running and waiting (``DeploymentSettings.max_per_user``), by default.
DEFAULT_MAX_WAITING = 64
DEFAULT_MAX_PER_USER = 32
# The shadow follows at most this many sequences per sequence main may run (``max_batch``), each
# with its own KV cache: main ends a sequence on the shadow (and waits for its statistics)
# before another takes its place, on the same ordered link, so more is a stale state (left
# from a main that went away) or a peer misbehaving, and the shadow drops the oldest
# (inference/runtime/roles/shadow.py); the memory estimate counts this many (inference/building/memory.py).
SHADOW_STATES_PER_SEQUENCE = 1
# Tokens of KV cache each sequence of main and the shadow is sized for (inference/building/memory.py);
# what the running sequences leave of it holds finished sequences' KV for reuse (inference/runtime/prefix_cache.py).
DEFAULT_CONTEXT_TOKENS = 4096
# How a worker computes an expert's rows of several batched sequences (``DeploymentSettings.batch_arithmetic``).
BATCH_ARITHMETICS = ("exact", "fused")
# How main sums expert outputs (``DeploymentSettings.experts_arithmetic``, inference.runtime.routing).
EXPERTS_ARITHMETICS = ("auto", "grouped", "eager")

# Files a strategy or predictor needs beside a checkpoint's weights (``shard`` carries them into
# main's shard): the importance strategy's expert similarity table (``python -m inference
# calibrate``) and the prerouter's heads and recovery adapter (``python -m inference train-prerouter``).
SIMILARITY_FILE = "expert-similarity.safetensors"
PREROUTER_FILE = "prerouter.safetensors"
MAIN_EXTRAS = (SIMILARITY_FILE, PREROUTER_FILE)  # not weights: never read as the model's tensors
