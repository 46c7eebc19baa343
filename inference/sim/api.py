"""The simulator's public entry point for the control plane: `estimate(...)` and `list_profiles()`.

`estimate` validates its input (ValueError with a readable reason), simulates the chosen strategy both
at the roofline (`ideal`) and with measured/published implementation efficiencies (`adjusted`) and
returns a JSON-able dict. It runs in well under 50 ms for the default sizes.
"""

from __future__ import annotations

from inference.sim.hardware import DEFAULT_PROFILE, get_profile
from inference.sim.hardware import list_profiles as _list_profiles
from inference.sim.model_sizes import ModelSizes, resolve_model
from inference.sim.simulate import run_pair
from inference.sim.strategies import STRATEGIES, Cluster
from inference.sim.strategies.base import SIMULATED_SHADOW_DTYPE
from inference.sim.traces import Trace, synthetic_trace, validate_trace

MAX_TOKENS = 32768
API_STEPS = 48  # decode steps simulated per estimate: keeps a web request under 50 ms

ASSUMPTIONS = [
    "decode is batch 1; each step reads the routed experts, attention weights, KV cache and LM head once",
    "full-cache is Transformers with device_map over the given GPUs: one GPU busy at a time",
    "eager PyTorch segments cost max(CPU launch time, GPU time); Transformers syncs once per segment",
    "workers keep experts in pinned host memory; a worker holds at most two experts on its GPU",
    "a wrong shadow guess is a wasted copy (not cancelled); the right expert is copied after routing",
    "the shadow runs the full quantised model with the baseline's implementation, aligned every step",
    "prefill spreads every expert of a layer over all workers in 4 mini-batches; no prediction",
    "synthetic routing: near-uniform expert load with Mixtral's measured consecutive-token locality",
    "memory is weights + KV cache + one CUDA context per GPU process; activations are ignored",
]


def list_profiles() -> list[dict]:
    return _list_profiles()


def _check_drafts(strategy: str, draft_tokens: int, draft_agreement: float | None) -> None:
    if draft_tokens and strategy != "odmoe":
        raise ValueError(f"the simulator models drafts for odmoe (the shadow drafts, main verifies), not {strategy}")
    if draft_tokens and draft_agreement is None:
        raise ValueError(
            "draft_tokens needs draft_agreement, the chance a draft equals main's token: the simulator does not "
            "guess a shadow's agreement (measure it: python -m benchmarks.draft_agreement)"
        )
    if not draft_tokens and draft_agreement is not None:
        raise ValueError("draft_agreement is a figure of drafts: give draft_tokens above 0, or leave it out")


def _check_tokens(name: str, tokens: object, minimum: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not minimum <= tokens <= MAX_TOKENS:
        raise ValueError(f"{name} must be an integer in [{minimum}, {MAX_TOKENS}], got {tokens!r}")
    return tokens


def estimate(
    model: str | dict | ModelSizes = "mixtral-8x7b",
    profile: str = DEFAULT_PROFILE,
    workers: int = 8,
    group_size: int = 2,
    shadow_dtype: str = SIMULATED_SHADOW_DTYPE,
    strategy: str = "odmoe",
    input_tokens: int = 128,
    output_tokens: int = 128,
    *,
    trace: Trace | None = None,
    seed: int = 0,
    draft_tokens: int = 0,
    draft_policy: str = "fixed",
    draft_agreement: float | None = None,
) -> dict:
    """Predicted decode tok/s, TTFT, end-to-end tok/s and per-node memory, ideal and adjusted.

    With ``draft_tokens`` (odmoe only) the shadow drafts that many tokens a pass (``draft_policy``
    ``auto``: main's tuner picks 0 to that many, pass by pass), each kept with probability
    ``draft_agreement`` given those before it were: a figure of the shadow on the model that only a
    measurement gives (``benchmarks.draft_agreement``), so it has no default. Each kind's ``drafts``
    then holds the simulated passes' tally.
    """
    sizes = resolve_model(model)
    hardware = get_profile(profile)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    for name, count in (("workers", workers), ("group_size", group_size)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive integer, got {count!r}")
    _check_tokens("input_tokens", input_tokens, 1)
    _check_tokens("output_tokens", output_tokens, 2)
    _check_drafts(strategy, draft_tokens, draft_agreement)
    cluster = Cluster(
        workers=workers,
        group_size=group_size,
        shadow_dtype=shadow_dtype,
        seed=seed,
        draft_tokens=draft_tokens,
        draft_agreement=draft_agreement or 0.0,
        draft_policy=draft_policy,
    )
    routing = validate_trace(trace, sizes) if trace is not None else synthetic_trace(sizes, API_STEPS, seed)
    results = {
        kind: run_pair(
            strategy,
            sizes,
            hardware,
            cluster,
            routing,
            input_tokens,
            output_tokens,
            ideal=kind == "ideal",
            max_steps=API_STEPS,
        )
        for kind in ("ideal", "adjusted")
    }
    return {
        "model": sizes.as_dict(),
        "profile": hardware.as_dict(),
        "strategy": strategy,
        "workers": workers,
        "group_size": group_size,
        "shadow_dtype": shadow_dtype,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "draft_tokens": draft_tokens,
        "draft_policy": draft_policy,
        "draft_agreement": draft_agreement,
        **results,
        "assumptions": list(ASSUMPTIONS),
    }
