"""The agent's roles: one runner per role of its deployment, a box with several GPUs runs several."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.messages import CancelGeneration, Generate, GenerationFailed, RoleState, StartRole
from agent.roles import Roles


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
    refused = [m for m in sent if isinstance(m, GenerationFailed)]
    assert len(refused) == 1 and "does not run a ready main for deployment dep9-9" in refused[0].error
    states = [m for m in sent if isinstance(m, RoleState)]
    assert {s.role_name for s in states} == {"main", "worker-0", "worker-1", "shadow"}
