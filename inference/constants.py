"""Names shared by the CLI, the specs and the roles, kept free of heavy imports."""

SHADOW_DTYPES = ("fp32", "bf16", "fp16", "int8", "nf4")
