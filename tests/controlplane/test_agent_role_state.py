"""What an agent says about its running role: state, readiness and memory, without a role process.

``RoleRunner`` hears its role's health answers (``inference.wire.runtime.Pong``) and turns them
into ``RoleState`` events; these tests feed it answers and read what it would send.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.runtime import RoleRunner, memory_changed
from inference.wire.link import EVENTS, MessageError, RoleState, StartRole, parse
from inference.wire.runtime import Pong

MB = 2**20
GB = 2**30


def pong(*, ready: bool = True, detail: str = "", host: int, peak: int = 0, device: int = 0) -> Pong:
    return Pong(
        role="main", ready=ready, detail=detail, host_bytes=host, peak_host_bytes=peak or host, device_bytes=device
    )


def test_only_a_first_answer_or_a_real_move_is_worth_a_role_state_of_its_own() -> None:
    base = {"host_bytes": 4 * GB, "peak_host_bytes": 4 * GB, "device_bytes": 0}
    assert memory_changed({}, base)
    assert not memory_changed({}, {})
    assert not memory_changed(base, {**base, "host_bytes": 4 * GB + 30 * MB})  # under 1 % of 4 GB
    assert memory_changed(base, {**base, "host_bytes": 4 * GB + 50 * MB})  # over 1 % and 16 MB
    small = {"host_bytes": 300 * MB, "peak_host_bytes": 300 * MB, "device_bytes": 0}
    assert not memory_changed(small, {**small, "host_bytes": 310 * MB})  # over 1 %, under 16 MB
    assert memory_changed(small, {**small, "device_bytes": 200 * MB})


def test_a_running_role_reports_its_memory_when_it_moves_and_with_every_heartbeat(tmp_path: Path) -> None:
    sent: list = []

    async def send(message) -> None:
        sent.append(message)

    runner = RoleRunner(None, tmp_path, send)  # no credential: nothing is downloaded here
    runner.command = StartRole(
        task_id="t1", deployment="dep1-1", model_id=1, shard="main", spec={"role": "main"}, client_keys={}
    )

    async def scenario() -> None:
        await runner.set_state("starting", "waiting for the role to answer")
        assert runner.state.memory == {}  # no answer yet
        await runner._heard(pong(ready=False, detail="loading main's tensors", host=300 * MB))
        await runner._heard(pong(host=1 * GB, peak=1200 * MB, device=2 * GB))
        assert len(sent) == 3
        await runner._heard(pong(host=1 * GB + 4 * MB, peak=1200 * MB, device=2 * GB))  # noise: not sent...
        assert len(sent) == 3
        assert runner.snapshot()["memory"]["host_bytes"] == 1 * GB + 4 * MB  # ...but the heartbeat carries it
        await runner._heard(pong(host=1 * GB + 4 * MB, peak=1200 * MB, device=3 * GB))  # a real move is sent
        await runner.set_state("ready", metrics={"decode_tok_s": 5.0})  # a generation's figures keep the memory
        await runner.set_state("failed", "the role process exited with code -9")

    asyncio.run(scenario())
    states = [(m.state, m.detail, m.memory) for m in sent]
    assert states[0] == ("starting", "waiting for the role to answer", {})
    assert states[1][:2] == ("starting", "loading main's tensors") and states[1][2]["host_bytes"] == 300 * MB
    assert states[2] == ("ready", "", {"host_bytes": 1 * GB, "peak_host_bytes": 1200 * MB, "device_bytes": 2 * GB})
    assert states[3][2]["device_bytes"] == 3 * GB
    assert sent[4].memory["device_bytes"] == 3 * GB and sent[4].metrics == {"decode_tok_s": 5.0}
    assert states[5][0] == "failed" and states[5][2] == {}  # a dead process holds nothing
    assert all(parse(m.to_json(), allowed=EVENTS) == m for m in sent)  # each one passes the control plane's check


@pytest.mark.parametrize(
    "memory", [{"host_bytes": -1}, {"host_bytes": True}, {"host_bytes": "1 GB"}, {"host_bytes": 1.5}, [1]]
)
def test_a_role_state_with_bad_memory_figures_is_refused_on_arrival(memory) -> None:
    state = RoleState(deployment="dep1-1", role="main", state="ready").to_json()
    assert parse(state, allowed=EVENTS).memory == {}
    with pytest.raises(MessageError, match="memory"):
        parse({**state, "memory": memory}, allowed=EVENTS)
