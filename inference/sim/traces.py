"""Routing traces: which experts each decode step used in each layer.

A trace is a list of steps; a step is a list with one entry per layer; an entry is the list of expert
ids routed there (top-k, distinct). Two sources:

- `synthetic_trace`: top-k of E with near-uniform load per layer and Mixtral's measured temporal
  locality (share of consecutive tokens that share at least one expert, per layer, from the Mixtral
  paper's routing analysis; see `sources`). Each of the previous token's experts is kept with
  probability q, the rest are drawn uniformly from the experts neither kept nor just dropped, so
  P(share >= 1) = 1 - (1 - q)^2 and q = 1 - sqrt(1 - target).
- `load_trace`: a JSON file, either a bare list of steps as above
  (`[[[3, 7], [0, 5], ...32 layers], ...steps]`), or `{"steps": <that list>}`, or the generation
  metrics of our runtime (a dict with `per_step`, whose decode steps' layers carry `real`).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from functools import lru_cache
from pathlib import Path

from inference.sim.model_sizes import ModelSizes
from inference.sim.sources import value

Trace = list[list[list[int]]]  # [step][layer] -> expert ids


def locality_per_layer(layers: int) -> list[float]:
    """Target P(consecutive tokens share an expert) per layer, piecewise-linear through layers 0, 15, 31."""
    points = [
        (0.0, value("mixtral_repeat_any_layer0")),
        (15 / 31, value("mixtral_repeat_any_layer15")),
        (1.0, value("mixtral_repeat_any_layer31")),
    ]
    targets = []
    for layer in range(layers):
        x = layer / (layers - 1) if layers > 1 else 0.0
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if x <= x1:
                targets.append(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
                break
    return targets


def _keep_probability(target: float, experts: int, top_k: int) -> float:
    # Random routing already shares an expert this often; a target below that means no locality.
    random_share = 1 - math.comb(experts - top_k, top_k) / math.comb(experts, top_k) if experts >= 2 * top_k else 1.0
    if target <= random_share:
        return 0.0
    return 1 - math.sqrt(1 - target)


def synthetic_trace(model: ModelSizes, steps: int, seed: int = 0) -> Trace:
    return [[list(layer) for layer in step] for step in _synthetic(model, steps, seed)]


@lru_cache(maxsize=32)
def _synthetic(model: ModelSizes, steps: int, seed: int) -> tuple:
    rng = random.Random(seed)
    keep = [_keep_probability(t, model.experts, model.top_k) for t in locality_per_layer(model.layers)]
    trace: list = []
    previous: list | None = None
    for _ in range(steps):
        step = []
        for layer in range(model.layers):
            if previous is None or keep[layer] == 0.0:
                chosen = rng.sample(range(model.experts), model.top_k)
            else:
                old = previous[layer]
                kept = [e for e in old if rng.random() < keep[layer]]
                pool = [e for e in range(model.experts) if e not in old]
                fresh = rng.sample(pool, model.top_k - len(kept))
                chosen = kept + fresh
            step.append(tuple(chosen))
        trace.append(tuple(step))
        previous = step
    return tuple(trace)


def _steps_from_json(data: object) -> Trace:
    if isinstance(data, dict) and "per_step" in data:
        return [[list(layer["real"]) for layer in step["layers"]] for step in data["per_step"] if step["step"] > 0]
    if isinstance(data, dict) and "steps" in data:
        return data["steps"]
    if isinstance(data, list):
        return data
    raise ValueError("a trace file holds a list of steps, {'steps': [...]}, or runtime metrics with 'per_step'")


def validate_trace(trace: Trace, model: ModelSizes) -> Trace:
    if not trace:
        raise ValueError("the trace has no decode steps")
    for index, step in enumerate(trace):
        if not isinstance(step, list) or len(step) != model.layers:
            raise ValueError(f"trace step {index} must list {model.layers} layers")
        for layer, experts in enumerate(step):
            if not isinstance(experts, list) or not experts:
                raise ValueError(f"trace step {index} layer {layer}: expected a non-empty list of expert ids")
            if any(not isinstance(e, int) or not 0 <= e < model.experts for e in experts):
                raise ValueError(
                    f"trace step {index} layer {layer}: expert ids must be integers in [0, {model.experts})"
                )
            if len(set(experts)) != len(experts):
                raise ValueError(f"trace step {index} layer {layer}: repeated expert id")
    return trace


def load_trace(path: str | Path, model: ModelSizes) -> Trace:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read trace file {path}: {error}") from error
    return validate_trace(_steps_from_json(data), model)


def repeat_rate(trace: Trace, layer: int) -> float:
    """Share of consecutive steps whose experts at `layer` overlap (the statistic the generator targets)."""
    pairs = list(itertools.pairwise(trace))
    if not pairs:
        return 0.0
    return sum(bool(set(a[layer]) & set(b[layer])) for a, b in pairs) / len(pairs)
