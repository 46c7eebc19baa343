"""The agent's roles: one runner per role of its deployment, a box with several GPUs runs several;
and what a generation's result carries up the link."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agent.generations import MAX_METRICS_BYTES, bounded_metrics
from agent.roles import Roles
from inference.wire.generation import Failed, Generate
from inference.wire.link import CancelGeneration, RoleState, StartRole


def start(deployment: str, role: str, worker: int | None = None) -> StartRole:
    shard = role if worker is None else f"worker-{worker}"
    spec = {"deployment": deployment, "role": role, "worker": worker, "addresses": {}, "settings": {}}
    return StartRole(
        task_id=f"{deployment}-{shard}", deployment=deployment, model_id=1, shard=shard, spec=spec, client_keys={}
    )


def test_roles_are_kept_per_deployment_and_role_name(tmp_path: Path) -> None:
    sent: list = []

    async def send(message) -> None:
        sent.append(message)

    async def scenario() -> tuple:
        roles = Roles(None, tmp_path, send)  # no credential: each fetch fails, which is all this needs
        await roles.start(start("dep1-1", "main"))
        await roles.start(start("dep1-1", "worker", 0))
        await roles.start(start("dep1-1", "worker", 1))
        await asyncio.gather(*(r._work for r in roles.runners.values()))
        both = sorted(roles.runners)
        named = sorted(s["role_name"] for s in roles.snapshot())
        await roles.stop("dep1-1", "worker-1")
        after_one = {name: r.state.state for (_, name), r in roles.runners.items()}
        await roles.generate(Generate(request_id="r1", deployment="dep9-9", prompt_ids=[1], max_new_tokens=2))
        await roles.cancel(CancelGeneration(request_id="r1"))  # main is here: it takes the cancel, no error
        await roles.start(start("dep2-1", "shadow"))  # another deployment: the first one's roles go
        await asyncio.gather(*(r._work for r in roles.runners.values()))
        return both, named, after_one, sorted(roles.runners)

    both, named, after_one, last = asyncio.run(scenario())
    assert both == [("dep1-1", "main"), ("dep1-1", "worker-0"), ("dep1-1", "worker-1")]
    assert named == ["main", "worker-0", "worker-1"]
    assert after_one == {"main": "failed", "worker-0": "failed", "worker-1": "stopped"}
    assert last == [("dep2-1", "shadow")]
    refused = [m for m in sent if isinstance(m, Failed)]
    assert len(refused) == 1 and "does not run a ready main for deployment dep9-9" in refused[0].error
    states = [m for m in sent if isinstance(m, RoleState)]
    assert {s.role_name for s in states} == {"main", "worker-0", "worker-1", "shadow"}


def _step(step: int, layers: int) -> dict:
    """A decode step's record as ``inference.runtime.metrics.build_metrics`` writes it (about 450 bytes a layer)."""
    layer = {
        "layer": 0,
        "real": [1, 5],
        "wait_ms": 0.123,
        "worker_ms": 1.234,
        "dispatch_ms": 2.345,
        "breakdown_ms": {"main_before_send": 0.1, "hops": 0.2, "worker_python": 0.3, "wait_compute": 0.4},
        "hops_split_ms": {"receivers": 0.1, "between_sockets": 0.2},
        "hits": 2,
        "misses": 0,
        "predicted": [1, 5],
        "predicted_in_time": True,
        "recall": 1.0,
    }
    return {
        "step": step,
        "tokens": 1,
        "ms": 12.5,
        "recall": 1.0,
        "layers": [{**layer, "layer": i} for i in range(layers)],
    }


def test_a_long_answers_metrics_fit_the_link_with_its_per_step_record_cut_and_counted() -> None:
    """A 2,048-token answer of a 32-layer model records about 29 MB of steps, past the link's 16 MiB
    frame cap: its steps past the budget are left out and counted, the summary is whole."""
    summary = {"ttft_ms": 40.0, "decode_tok_s": 9.5, "recall": 0.97, "generated_tokens": 2048}
    metrics = {**summary, "per_step": [_step(s, 32) for s in range(2049)]}
    assert len(json.dumps(metrics)) > 16 * 2**20

    bounded = bounded_metrics(metrics)

    assert len(json.dumps(bounded)) <= MAX_METRICS_BYTES
    assert {k: bounded[k] for k in summary} == summary
    kept = bounded["per_step"]
    assert kept == metrics["per_step"][: len(kept)] and len(kept) > 100
    assert bounded["per_step_omitted"] == 2049 - len(kept)


def test_metrics_that_fit_the_link_go_up_unchanged() -> None:
    metrics = {"ttft_ms": 40.0, "per_step": [_step(s, 4) for s in range(48)]}
    assert bounded_metrics(metrics) is metrics
    assert bounded_metrics({"ttft_ms": 1.0}, max_bytes=4) == {"ttft_ms": 1.0}  # nothing to cut: kept whole
