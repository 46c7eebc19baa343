"""The whole platform for real: Redis, Celery worker and beat, the ASGI server and ten agents.

Enroll the agents with a join token through the API, deploy the tiny model on them (1 main,
1 shadow, 8 workers), wait until every role reports ready, generate through the control
plane and get Transformers' tokens; change the alignment periods on the running deployment;
kill a worker's role process mid-answer and get the same tokens while its agent restarts it;
kill main's role process mid-answer and get the whole answer once its agent has started it again;
kill a worker's agent and see the node offline and the deployment degraded, then back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.deployments.models import AnswerPause
from controlplane.ops.processes import ProcessGroup, python_env
from inference.runtime.launcher import free_port
from tests.controlplane.live import Api, LiveControlPlane, database_url, purge_stale_tasks
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


def kill_role(runtime_dir: Path, shard: str) -> bool:
    """SIGKILL the role process serving ``shard`` whose spec lies under ``runtime_dir`` (an agent's state)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        wanted = (str(runtime_dir).encode(), f"{shard}.spec".encode())
        if b"serve-role" in argv and any(wanted[0] in a and wanted[1] in a for a in argv):
            os.kill(int(proc.name), signal.SIGKILL)
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

    # Main killed mid-answer: its agent starts it again and carries the answer to it (agent.migration).
    # The caller sees a pause, then the rest: Transformers' tokens up to the restart, then Transformers'
    # continuing from them (they are re-read as prompt); and the deployment serves on.
    main_member = next(m for m in ready["members"] if m["role"] == "main")
    carried: dict = {}

    def ask_main() -> None:
        started = time.monotonic()
        code, body = api.call(
            "POST", f"/api/deployments/{deployment}/generate", {"prompt_ids": PROMPTS[3], "max_new_tokens": LONG}
        )
        carried.update(code=code, body=body, seconds=time.monotonic() - started)

    asking = threading.Thread(target=ask_main)
    asking.start()
    time.sleep(1.0)
    assert kill_role(live.state_root / main_member["node_name"] / "runtime", "main")
    asking.join(timeout=180)
    assert carried["code"] == 200, carried
    tokens, restarts = carried["body"]["token_ids"], carried["body"]["metrics"]["main_restarts"]
    (resumed_at,) = restarts["resumed_at"]
    assert restarts["count"] == 1 and 0 < resumed_at < LONG, restarts  # killed mid-answer
    (paused_ms,) = restarts["paused_ms"]  # from the last token before the kill to the first after
    assert 0 < paused_ms < carried["seconds"] * 1000, restarts
    (pause,) = AnswerPause.objects.filter(cause="main_restart")  # the console lists it
    assert (pause.at_token, pause.paused_ms, pause.detail) == (resumed_at, paused_ms, "replay: prefill")
    assert len(tokens) == LONG
    assert tokens[:resumed_at] == reference_generate(tiny_model, PROMPTS[3], resumed_at)
    assert tokens[resumed_at:] == reference_generate(tiny_model, PROMPTS[3] + tokens[:resumed_at], LONG - resumed_at)
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
