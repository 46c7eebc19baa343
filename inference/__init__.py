"""odmoe runtime: serve an MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE) with on-demand expert loading.

The model is split over separate processes that talk over ZeroMQ: *main* (attention,
norms, routers, LM head, KV cache), a quantized *shadow* that predicts routing ahead of
main, and *workers* that copy the predicted experts to their compute device just in time,
compute, and free them at once. ``python -m inference --help`` lists the commands.
"""

__version__ = "0.1.0"
