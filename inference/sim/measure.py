"""Measure, on this machine, the framework overhead that the simulator's efficiency factors use.

Run `python -m inference.sim.measure` (wrap it in `flock /tmp/odmoe-bench.lock` on a shared box).
It needs torch and transformers, which the simulator itself does not. It reports, per decoder layer
of a single-token decode with a KV cache, for tiny Hugging Face Transformers models whose weights are
so small that the time is almost all Python, dispatch and kernel-call overhead:

- the wall time of a `MixtralForCausalLM` layer (attention, norms, router, the expert loop),
- the wall time of a `MistralForCausalLM` layer (attention, norms, one dense MLP): what a main node
  that runs attention and the router in eager PyTorch pays per layer,
- the number of aten operators each dispatches (each is one kernel launch on a GPU),
- and this CPU's streaming memory bandwidth (numpy copy) for reference.

The numbers it printed when we ran it are recorded in `inference.sim.sources` with the date.
"""

from __future__ import annotations

import json
import time


def _tiny_config(family: str, layers: int, top_k: int = 2):
    from transformers import MistralConfig, MixtralConfig

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if family == "mixtral":
        return MixtralConfig(num_local_experts=8, num_experts_per_tok=top_k, **common)
    return MistralConfig(**common)


def _model(family: str, layers: int, top_k: int = 2):
    import torch
    from transformers import MistralForCausalLM, MixtralForCausalLM

    torch.manual_seed(0)
    cls = MixtralForCausalLM if family == "mixtral" else MistralForCausalLM
    config = _tiny_config(family, layers, top_k)
    # Transformers 5 runs Mixtral's experts as one grouped matmul by default; the paper's
    # baseline (Transformers 4.x) had only the Python loop over the hit experts, which "eager" is.
    config._experts_implementation = "eager"
    model = cls(config).eval()
    if family == "mixtral":
        assert model.config._experts_implementation == "eager"
    return model


def decode_step_seconds(family: str, layers: int, *, prompt: int = 16, steps: int = 200, top_k: int = 2) -> float:
    """Median wall time of one single-token decode forward (with KV cache) of a tiny model."""
    import torch

    model = _model(family, layers, top_k)
    ids = torch.randint(0, 256, (1, prompt))
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - start)
            past = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
    times.sort()
    return times[len(times) // 2]


def ops_per_layer(family: str, top_k: int = 2) -> float:
    """aten operators dispatched per decoder layer in one decode step (difference of 4 and 2 layers)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for layers in (2, 4):
        model = _model(family, layers, top_k)
        with torch.no_grad():
            out = model(torch.randint(0, 256, (1, 16)), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            with _Count() as counter:
                model(token, past_key_values=out.past_key_values, use_cache=True)
        counts[layers] = counter.count
    return (counts[4] - counts[2]) / 2


def memory_bandwidth_bytes_per_s(size_bytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Streaming copy bandwidth (read + write counted) of numpy on this CPU."""
    import numpy as np

    src = np.ones(size_bytes // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * size_bytes / best


def main(argv: list[str] | None = None) -> None:
    import argparse
    import platform

    parser = argparse.ArgumentParser(
        prog="python -m inference.sim.measure",
        description="Measure the simulator's CPU-side constants on this machine (a few minutes) and print them "
        "as JSON, to compare with inference/sim/sources.py.",
    )
    parser.parse_args(argv)

    import torch
    import transformers

    result: dict[str, object] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "memory_bandwidth_GBps": memory_bandwidth_bytes_per_s() / 1e9,
    }
    for family in ("mixtral", "mistral"):
        t2 = decode_step_seconds(family, 2)
        t6 = decode_step_seconds(family, 6)
        result[f"{family}_layer_ms"] = (t6 - t2) / 4 * 1000
        result[f"{family}_step_fixed_ms"] = (t2 - 2 * (t6 - t2) / 4) * 1000
        result[f"{family}_ops_per_layer"] = ops_per_layer(family)
    result["lean_block_layer_ms"] = lean_block_seconds() * 1000
    result.update(moe_block_cpu())
    print(json.dumps(result, indent=2))


def layer_seconds(family: str, top_k: int = 2, small: int = 2, big: int = 6) -> float:
    """Per-layer decode time of a tiny Transformers model: (big-layer step - small-layer step) / layers."""
    return (decode_step_seconds(family, big, top_k=top_k) - decode_step_seconds(family, small, top_k=top_k)) / (
        big - small
    )


def moe_block_cpu(rounds: int = 3) -> dict[str, float]:
    """The CPU time of Transformers' Mixtral MoE block beyond a dense MLP, split into a fixed part and
    a part per expert the loop computes (``MixtralExperts.forward`` loops over the *hit* experts only,
    each behind a ``torch.where``): a decode token hits ``top_k`` experts, so the Mixtral layer with
    top-1 and with top-2 against the Mistral layer of the same shape give both parts.

    Each of the three layer times is the median over ``rounds`` interleaved measurements, so a
    burst of load on the machine hits all three alike; the spread is reported too.
    """
    samples: dict[str, list[float]] = {"mistral": [], "mixtral_top1": [], "mixtral_top2": []}
    for _ in range(rounds):
        samples["mistral"].append(layer_seconds("mistral"))
        samples["mixtral_top1"].append(layer_seconds("mixtral", top_k=1))
        samples["mixtral_top2"].append(layer_seconds("mixtral", top_k=2))
    median = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    ops = {"mistral": ops_per_layer("mistral"), "mixtral_top1": ops_per_layer("mixtral", 1)}
    ops["mixtral_top2"] = ops_per_layer("mixtral", 2)
    # The split by operator counts (exact, unlike the small time difference of top-1 and top-2,
    # which is within the timing noise): each aten op costs the Mistral layer's time per op.
    per_op = median["mistral"] / ops["mistral"]
    per_expert = (ops["mixtral_top2"] - ops["mixtral_top1"]) * per_op
    fixed = median["mixtral_top2"] - median["mistral"] - 2 * per_expert
    return {
        "moe_rounds": rounds,
        **{f"{k}_ops_per_layer": v for k, v in ops.items()},
        "timed_top2_minus_top1_ms": (median["mixtral_top2"] - median["mixtral_top1"]) * 1000,
        **{f"{k}_layer_ms_samples": [x * 1000 for x in v] for k, v in samples.items()},
        **{f"{k}_layer_ms": x * 1000 for k, x in median.items()},
        "moe_cpu_per_hit_expert_ms": per_expert * 1000,
        "moe_cpu_fixed_ms": fixed * 1000,
    }


def lean_block_seconds(layers_small: int = 2, layers_big: int = 6, steps: int = 200) -> float:
    """Per-layer decode time of a lean Llama-style block (fused qkv, static KV cache, no framework layers).

    The same math as a Transformers Mistral layer, written the way gpt-fast's eager baseline is, so the
    ratio of the two on this CPU says how much heavier Transformers' Python is than gpt-fast's.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    hidden, heads, kv_heads, head_dim, inter, cache_len = 64, 4, 2, 16, 128, 512

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.Parameter(torch.ones(hidden))
            self.norm2 = nn.Parameter(torch.ones(hidden))
            self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
            self.out = nn.Linear(heads * head_dim, hidden, bias=False)
            self.up = nn.Linear(hidden, 2 * inter, bias=False)
            self.down = nn.Linear(inter, hidden, bias=False)
            self.register_buffer("k_cache", torch.zeros(1, kv_heads, cache_len, head_dim))
            self.register_buffer("v_cache", torch.zeros(1, kv_heads, cache_len, head_dim))

        @staticmethod
        def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

        @staticmethod
        def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            first, second = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-second, first), dim=-1) * sin

        def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.rms(x, self.norm1)).split(
                [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
            )
            q = self.rotate(q.view(1, 1, heads, head_dim).transpose(1, 2), cos, sin)
            k = self.rotate(k.view(1, 1, kv_heads, head_dim).transpose(1, 2), cos, sin)
            self.k_cache.index_copy_(2, pos, k)
            self.v_cache.index_copy_(2, pos, v.view(1, 1, kv_heads, head_dim).transpose(1, 2))
            keys = self.k_cache.repeat_interleave(heads // kv_heads, dim=1)
            values = self.v_cache.repeat_interleave(heads // kv_heads, dim=1)
            mask = (torch.arange(cache_len) <= pos).view(1, 1, 1, cache_len)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            h = x + self.out(y.transpose(1, 2).reshape(1, 1, heads * head_dim))
            gate, up = self.up(self.rms(h, self.norm2)).chunk(2, dim=-1)
            return h + self.down(F.silu(gate) * up)

    def step_time(layers: int) -> float:
        torch.manual_seed(0)
        blocks = nn.ModuleList(Block() for _ in range(layers)).eval()
        cos = torch.ones(1, 1, 1, head_dim)
        sin = torch.zeros(1, 1, 1, head_dim)
        x = torch.randn(1, 1, hidden)
        times = []
        with torch.no_grad():
            for i in range(steps):
                pos = torch.tensor([i % cache_len])
                start = time.perf_counter()
                h = x
                for block in blocks:
                    h = block(h, pos, cos, sin)
                times.append(time.perf_counter() - start)
        times.sort()
        return times[len(times) // 2]

    return (step_time(layers_big) - step_time(layers_small)) / (layers_big - layers_small)


if __name__ == "__main__":
    main()
