"""Run one strategy over a routing trace for one (input, output) length pair: TTFT, decode and e2e rate.

At most `MAX_SIMULATED_STEPS` decode steps are simulated; step i then stands for the decode positions
around input + i * stride, so a long output costs no more time to estimate (the KV part grows
linearly and is sampled across the whole output). Consecutive simulated steps use consecutive trace
steps, so caches and locality behave as for consecutive tokens.
"""

from __future__ import annotations

import statistics

from inference.sim.costs import Costs
from inference.sim.efficiency import for_strategy
from inference.sim.hardware import Profile
from inference.sim.model_sizes import ModelSizes
from inference.sim.strategies import Cluster, Setup, build
from inference.sim.traces import Trace

MAX_SIMULATED_STEPS = 128


def decode_contexts(input_tokens: int, output_tokens: int, max_steps: int = MAX_SIMULATED_STEPS) -> list[int]:
    steps = output_tokens - 1
    simulated = min(steps, max_steps)
    stride = steps / simulated
    return [input_tokens + 1 + int(i * stride) for i in range(simulated)]


def cycle(trace: Trace, steps: int) -> Trace:
    return [trace[i % len(trace)] for i in range(steps)]


def run_pair(
    strategy_name: str,
    model: ModelSizes,
    profile: Profile,
    cluster: Cluster,
    trace: Trace,
    input_tokens: int,
    output_tokens: int,
    *,
    ideal: bool,
    recall: float | None = None,
    max_steps: int = MAX_SIMULATED_STEPS,
) -> dict:
    costs = Costs(model, profile, for_strategy(strategy_name, ideal))
    setup = Setup(costs, cluster)
    strategy = build(strategy_name, setup)
    if recall is not None and hasattr(strategy, "recall"):
        strategy.recall = recall
    ttft = strategy.prefill(input_tokens)
    contexts = decode_contexts(input_tokens, output_tokens, max_steps)
    step_times = strategy.decode(cycle(trace, len(contexts)), contexts)
    decode_s = statistics.fmean(step_times) * (output_tokens - 1)
    memory = strategy.memory(input_tokens + output_tokens)
    drafting = getattr(strategy, "drafting", None)
    return {
        "ttft_ms": ttft * 1000,
        "decode_tok_s": (output_tokens - 1) / decode_s,
        "e2e_tok_s": output_tokens / (ttft + decode_s),
        "memory_bytes": memory,
        "memory_total_bytes": sum(memory.values()),
        "drafts": drafting.as_dict() if drafting is not None else None,  # odmoe with draft_tokens only
    }


def average(results: list[dict]) -> dict:
    """Mean of the rates and TTFT over length pairs (as the paper averages its four pairs); peak memory."""
    keys = ("ttft_ms", "decode_tok_s", "e2e_tok_s")
    mean = {key: statistics.fmean(r[key] for r in results) for key in keys}
    worst = max(results, key=lambda r: r["memory_total_bytes"])
    mean["memory_bytes"] = worst["memory_bytes"]
    mean["memory_total_bytes"] = worst["memory_total_bytes"]
    drafted = [r["drafts"] for r in results if r.get("drafts")]
    if drafted:
        mean["drafts"] = combined_drafts(drafted)
    return mean


def combined_drafts(tallies: list[dict]) -> dict:
    """Several runs' ``DraftTally.as_dict`` as one: counts summed, rates over all their passes."""
    counts = {key: sum(t[key] for t in tallies) for key in ("passes", "tokens", "drafted", "accepted")}
    passes = counts["passes"]
    return counts | {
        "tokens_per_pass": counts["tokens"] / passes if passes else 0.0,
        "distinct_experts": sum(t["distinct_experts"] * t["passes"] for t in tallies) / passes if passes else 0.0,
    }
