"""The config.json fields of real releases that memory plans and README's family table size.

Only the shape fields are kept, transcribed from each release's ``config.json`` on the
Hugging Face hub (this machine has no hub access; Qwen3-30B-A3B's shape was cross-checked
against zyzshishui/slime's ``scripts/models/qwen3-30B-A3B.sh``, Qwen1.5-MoE-A2.7B's against a
copy of its config.json). ``python -m inference.building.memory --model NAME`` plans any of them.
"""

from __future__ import annotations

from typing import Any

RELEASES: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
    "mixtral-8x22b": {  # mistralai/Mixtral-8x22B-v0.1
        "model_type": "mixtral",
        "num_hidden_layers": 56,
        "hidden_size": 6144,
        "intermediate_size": 16384,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
    "qwen1.5-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B
        "model_type": "qwen2_moe",
        "num_hidden_layers": 24,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
    "olmoe-1b-7b": {  # allenai/OLMoE-1B-7B-0924
        "model_type": "olmoe",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
}
