"""The whole platform for real: Redis, Celery worker and beat, the ASGI server and ten agents.

Enroll the agents with a join token through the API, deploy the tiny model on them (1 main,
1 shadow, 8 workers), wait until every role reports ready, generate through the control
plane and get Transformers' tokens; change the alignment periods on the running deployment;
kill a worker's role process mid-answer and get the same tokens while its agent restarts it;
kill main's role process while 8 answers run and get each whole once its agent has started it again;
kill a worker's agent and see the node offline and the deployment degraded, then back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from controlplane.deployments.models import AnswerPause
from controlplane.ops.processes import ProcessGroup, python_env
from inference.runtime.launcher import free_port
from tests.controlplane.live import Api, LiveControlPlane, database_url, purge_stale_tasks, role_pids
from tests.reference import PROMPTS, reference_generate

AGENTS = 10
HEARTBEAT_TIMEOUT_S = 4
NEW_TOKENS = 10


@pytest.fixture
def live(transactional_db, redis_url: str, channel_layer_on_test_redis, tmp_path: Path) -> Iterator[LiveControlPlane]:
    from django.contrib.auth import get_user_model

    from controlplane.accounts.services import create_api_key

    purge_stale_tasks()
    env = python_env(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
        DATABASE_URL=database_url(),
        REDIS_URL=redis_url,
        ODMOE_VAR_DIR=str(tmp_path / "var"),
        ODMOE_NODE_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
    )
    admin = get_user_model().objects.create_user("admin", is_staff=True)
    _, key = create_api_key(user=admin)
    port = free_port()
    with ProcessGroup(tmp_path / "logs", env) as group:
        plane = LiveControlPlane(group, port, Api(f"http://127.0.0.1:{port}", key), tmp_path / "agents")
        celery = plane.start_celery(wait=False)  # starting while the server starts
        plane.start_server()
        plane.wait_for_celery(celery)
        yield plane


# An answer long enough (about 3 s at the tiny model's 60 tok/s here) that a kill 1 s in lands mid-answer.
LONG = 200
STREAMS = 8  # answers in flight when main is killed (main's batch holds 8)


def kill_role(runtime_dir: Path, shard: str) -> bool:
    """SIGKILL the role process serving ``shard`` whose spec lies under ``runtime_dir`` (an agent's state)."""
    for spec, pid in role_pids(runtime_dir).items():
        if Path(spec).name == f"{shard}.spec.json":
            os.kill(pid, signal.SIGKILL)
            return True
    return False


def deployment_status(live: LiveControlPlane, deployment_id: int) -> dict:
    return live.api.get(f"/api/deployments/{deployment_id}")


def wait_status(live: LiveControlPlane, deployment_id: int, status: str, timeout_s: float) -> dict:
    seen: dict = {}

    def reached() -> bool:
        seen.update(deployment_status(live, deployment_id))
        assert seen["status"] != "failed" or status == "failed", seen["status_reason"]
        return seen["status"] == status

    live.wait_for(f"deployment {status} (last: {seen.get('status')} {seen.get('status_reason')})", reached, timeout_s)
    return seen


@pytest.mark.slow
def test_ten_agents_enroll_deploy_generate_align_and_recover(live: LiveControlPlane, tiny_model: Path) -> None:
    api = live.api
    token = api.post("/api/join-tokens", {"name": "rack", "max_uses": AGENTS}, expect=201)["token"]
    agents = {f"box-{i}": live.start_agent(f"box-{i}", token) for i in range(AGENTS)}

    def all_online() -> bool:
        nodes = api.get("/api/nodes?limit=100")["results"]
        return len(nodes) == AGENTS and all(n["status"] == "online" for n in nodes)

    live.wait_for("ten nodes online", all_online, timeout_s=120)
    nodes = {n["name"]: n["id"] for n in api.get("/api/nodes?limit=100")["results"]}
    model = api.post("/api/models", {"name": "tiny", "path": str(tiny_model)}, expect=201)
    created = api.post(
        "/api/deployments", {"name": "rack", "model": model["id"], "nodes": list(nodes.values())}, expect=201
    )
    roles = sorted(m["role"] for m in created["members"])
    assert roles == ["main"] + ["shadow"] + ["worker"] * 8
    deployment = created["id"]

    api.post(f"/api/deployments/{deployment}/start", expect=202)
    ready = wait_status(live, deployment, "ready", timeout_s=300)
    assert all(m["state"] == "ready" and m["port"] for m in ready["members"])
    for m in ready["members"]:  # each role's memory, measured when it answered its agent's ping (no GPU here)
        memory = m["memory"]
        assert memory["peak_host_bytes"] >= memory["host_bytes"] > 50e6 and memory["device_bytes"] == 0, m

    # 1. Generation through the control plane is token-identical to Transformers.
    for prompt in PROMPTS[:2]:
        answer = api.post(
            f"/api/deployments/{deployment}/generate", {"prompt_ids": prompt, "max_new_tokens": NEW_TOKENS}
        )
        assert answer["token_ids"] == reference_generate(tiny_model, prompt, NEW_TOKENS)
        assert answer["metrics"]["token_period"] == 1 and answer["metrics"]["kv_period"] == 1

    # 2. New alignment periods reach the running runtime: no restart, same tokens.
    pids_before = {name: child.process.pid for name, child in agents.items()}
    api.call("PATCH", f"/api/deployments/{deployment}/settings", {"token_period": 3, "kv_period": 2}, expect=200)
    answer = api.post(
        f"/api/deployments/{deployment}/generate", {"prompt_ids": PROMPTS[0], "max_new_tokens": NEW_TOKENS}
    )
    assert (answer["metrics"]["token_period"], answer["metrics"]["kv_period"]) == (3, 2)
    assert answer["token_ids"] == reference_generate(tiny_model, PROMPTS[0], NEW_TOKENS)
    assert deployment_status(live, deployment)["status"] == "ready"
    assert {name: child.process.pid for name, child in agents.items()} == pids_before

    def main_reports_new_periods() -> bool:  # main's agent reports its last generation's figures
        main = next(m for m in deployment_status(live, deployment)["members"] if m["role"] == "main")
        return main["metrics"].get("token_period") == 3 and main["metrics"].get("kv_period") == 2

    live.wait_for("main's reported metrics", main_reports_new_periods, timeout_s=10)

    # 3. A worker's role process is killed mid-answer: the answer completes with the same tokens
    # (its group's survivors take its experts), its agent starts it again, and it rejoins.
    role_victim = next(m for m in ready["members"] if m["role"] == "worker" and m["worker_index"] == 1)
    spec = live.state_root / role_victim["node_name"] / "runtime"
    answer_box: dict = {}

    def ask() -> None:
        answer_box.update(
            api.post(f"/api/deployments/{deployment}/generate", {"prompt_ids": PROMPTS[3], "max_new_tokens": LONG})
        )

    asking = threading.Thread(target=ask)
    asking.start()
    time.sleep(1.0)  # prefill done, decoding
    killed = kill_role(spec, "worker-1")
    asking.join(timeout=120)
    assert killed and answer_box["token_ids"] == reference_generate(tiny_model, PROMPTS[3], LONG)
    assert answer_box["metrics"]["roles_lost"] == ["worker-1"]  # it was killed mid-answer, and served around

    def restarted() -> bool:
        member = next(m for m in deployment_status(live, deployment)["members"] if m["worker_index"] == 1)
        return "starting it again" in member["detail"] or member["state"] == "ready"

    live.wait_for("the killed worker restarted by its agent", restarted, timeout_s=30)
    wait_status(live, deployment, "ready", timeout_s=120)
    again = api.post(f"/api/deployments/{deployment}/generate", {"prompt_ids": PROMPTS[4], "max_new_tokens": 8})
    assert again["token_ids"] == reference_generate(tiny_model, PROMPTS[4], 8)

    # Main killed while 8 answers run, even ones greedy and odd ones seeded: its agent starts it again
    # and carries each answer to it (agent.migration, replay prefill). Each caller sees a pause, then
    # the rest of its answer: the tokens before the restart re-read as prompt, the rest of its budget,
    # the same seed. So a greedy answer is Transformers' tokens up to the restart, then Transformers'
    # continuing from them; a seeded one goes on as the same request asked afresh with those tokens.
    main_member = next(m for m in ready["members"] if m["role"] == "main")
    path = f"/api/deployments/{deployment}/generate"

    def asked(i: int, prompt_ids: list[int], max_new_tokens: int) -> dict:
        seeded = {"do_sample": True, "temperature": 1.0, "seed": 1000 + i} if i % 2 else {}
        return {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, **seeded}

    def ask_main(i: int) -> tuple[int, dict, float]:
        started = time.monotonic()
        code, body = api.call("POST", path, asked(i, PROMPTS[i % len(PROMPTS)], LONG))
        return code, body, time.monotonic() - started

    with ThreadPoolExecutor(STREAMS) as pool:
        asking = [pool.submit(ask_main, i) for i in range(STREAMS)]
        time.sleep(1.0)  # every answer's prefill done, decoding
        assert kill_role(live.state_root / main_member["node_name"] / "runtime", "main")
        carried = [answer.result(timeout=180) for answer in asking]
    pauses = {pause.request_id: pause for pause in AnswerPause.objects.filter(cause="main_restart")}
    assert len(pauses) == STREAMS  # the console lists each answer's pause
    wait_status(live, deployment, "ready", timeout_s=120)
    for i, (code, body, seconds) in enumerate(carried):
        assert code == 200, (i, body)
        prompt, tokens, restarts = PROMPTS[i % len(PROMPTS)], body["token_ids"], body["metrics"]["main_restarts"]
        (resumed_at,) = restarts["resumed_at"]
        assert restarts["count"] == 1 and 0 < resumed_at < len(tokens), (i, restarts)  # killed mid-answer
        (paused_ms,) = restarts["paused_ms"]  # from the last token before the kill to the first after
        assert 0 < paused_ms < seconds * 1000, (i, restarts)
        pause = pauses[body["request_id"]]
        assert (pause.at_token, pause.paused_ms, pause.detail) == (resumed_at, paused_ms, "replay: prefill")
        # Whole: to its budget, or (sampled) to the end of sequence it drew.
        assert (len(tokens), body["finish_reason"]) in ((LONG, "length"), (len(tokens), "stop")), (i, len(tokens))
        assert i % 2 or len(tokens) == LONG  # greedy, this model never ends these by itself
        before, rest = tokens[:resumed_at], tokens[resumed_at:]
        if i % 2 == 0:
            assert before == reference_generate(tiny_model, prompt, resumed_at)
            assert rest == reference_generate(tiny_model, prompt + before, LONG - resumed_at)
        else:
            assert rest == api.post(path, asked(i, prompt + before, LONG - resumed_at))["token_ids"], i
    wait_status(live, deployment, "ready", timeout_s=120)
    after = api.post(f"/api/deployments/{deployment}/generate", {"prompt_ids": PROMPTS[0], "max_new_tokens": 8})
    assert after["token_ids"] == reference_generate(tiny_model, PROMPTS[0], 8)

    # 4. A worker's agent dies: its node goes offline and the deployment degraded; back when it returns.
    victim = next(m for m in ready["members"] if m["role"] == "worker")
    live.group.stop(agents[victim["node_name"]], kill=True)
    degraded = wait_status(live, deployment, "degraded", timeout_s=HEARTBEAT_TIMEOUT_S * 3)
    assert victim["node_name"] in degraded["status_reason"]
    assert api.get(f"/api/nodes/{victim['node']}")["status"] == "offline"
    agents[victim["node_name"]] = live.start_agent(victim["node_name"])  # its stored credential, no token
    wait_status(live, deployment, "ready", timeout_s=120)
    assert api.get(f"/api/nodes/{victim['node']}")["status"] == "online"
    answer = api.post(
        f"/api/deployments/{deployment}/generate", {"prompt_ids": PROMPTS[1], "max_new_tokens": NEW_TOKENS}
    )
    assert answer["token_ids"] == reference_generate(tiny_model, PROMPTS[1], NEW_TOKENS)

    # Stop frees the nodes; every role reports stopped.
    api.post(f"/api/deployments/{deployment}/stop")

    def all_stopped() -> bool:
        return all(m["state"] == "stopped" for m in deployment_status(live, deployment)["members"])

    live.wait_for("every role stopped", all_stopped, timeout_s=30)
    code, refused = api.call("POST", f"/api/deployments/{deployment}/generate", {"prompt_ids": [1, 2]})
    assert code == 409 and "stopped" in refused["detail"]
