"""``manage.py up`` run again on another port: its local agents follow the server they are started for.

Their credentials live under var/ and name the URL they enrolled with; a real agent refuses to
send one to any other server, and must go on refusing. ``up`` owns both ends, so before starting
its own agents it moves a credential this database issued to the new URL (the same nodes, so the
demo deployment is the same), and forgets one this database does not know.

``up`` keeps its data in its own SQLite under var/, as ``make run`` does; when the suite runs
on PostgreSQL, ``up`` is given the test database instead (``DATABASE_URL``), as production's
would be: the same test then checks ``up`` on PostgreSQL.
"""

from __future__ import annotations

import json
import re
import sqlite3
import stat
import uuid
from pathlib import Path

import pytest
import redis

from agent import credentials
from agent.__main__ import enroll_or_resume
from controlplane.nodes.services import create_join_token, enroll_node
from controlplane.ops import demo
from inference.runtime.launcher import free_port
from tests.controlplane.live import manage_py_up, on_postgres

OLD, NEW = "http://127.0.0.1:41919", "http://127.0.0.1:52609"


def enrolled(state_dir: Path, server: str = OLD, name: str = "local-0") -> credentials.NodeCredential:
    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name=name, inventory={})
    credential = credentials.NodeCredential(server, str(node.pk), secret, name)
    credentials.save(state_dir, credential)
    return credential


def test_a_real_agent_never_sends_its_credential_to_another_server(tmp_path: Path) -> None:
    credentials.save(tmp_path, credentials.NodeCredential(OLD, "id", "odmoe-node-secret", "box"))
    with pytest.raises(ValueError, match=f"holds a credential for {OLD}, not {NEW}"):
        enroll_or_resume(NEW, None, "box", tmp_path)  # refused before any request


@pytest.mark.django_db
def test_a_credential_of_this_database_follows_the_server_to_its_new_port(tmp_path: Path) -> None:
    before = enrolled(tmp_path)
    assert demo.local_credential_action(tmp_path, OLD) == demo.KEEP
    assert demo.local_credential_action(tmp_path, OLD + "/") == demo.KEEP

    assert demo.prepare_local_credential(tmp_path, NEW + "/") == demo.FOLLOW
    after = credentials.load(tmp_path)
    assert after == credentials.NodeCredential(NEW, before.node_id, before.node_secret, before.name)
    assert stat.S_IMODE((tmp_path / credentials.FILE_NAME).stat().st_mode) == 0o600
    assert demo.prepare_local_credential(tmp_path, NEW) == demo.KEEP


@pytest.mark.django_db
def test_a_credential_this_database_does_not_know_is_forgotten(tmp_path: Path) -> None:
    strangers = {  # another database's node (a fresh database), and an id that is no node id at all
        tmp_path / "a": credentials.NodeCredential(OLD, str(uuid.uuid4()), "odmoe-node-x", "local-0"),
        tmp_path / "b": credentials.NodeCredential(OLD, "not-a-uuid", "odmoe-node-x", "local-1"),
    }
    for state, credential in strangers.items():
        credentials.save(state, credential)
        assert demo.prepare_local_credential(state, NEW) == demo.FORGET
        assert not (state / credentials.FILE_NAME).exists()
    garbled = tmp_path / "c"
    garbled.mkdir()
    (garbled / credentials.FILE_NAME).write_text("{not json")
    assert demo.prepare_local_credential(garbled, NEW) == demo.FORGET
    assert demo.prepare_local_credential(tmp_path / "none", NEW) == demo.KEEP


@pytest.mark.django_db
def test_a_credential_whose_secret_does_not_check_out_is_not_moved(tmp_path: Path) -> None:
    real = enrolled(tmp_path)
    forged = credentials.NodeCredential(OLD, real.node_id, "odmoe-node-not-the-secret", real.name)
    credentials.save(tmp_path, forged)
    assert demo.prepare_local_credential(tmp_path, NEW) == demo.KEEP
    assert credentials.load(tmp_path) == forged  # the agent will refuse it, as a real one must


# --- end to end: the command itself, twice, on two ports -------------------------------------

AGENTS = 3


def run_up_until_ready(var: Path, port: int, model: Path, log: Path) -> str:
    """Start ``manage.py up``, wait for ``odmoe ready``, check its Redis takes no client without the
    password up made, stop it with SIGTERM; its whole output."""
    with manage_py_up(var, port, model, log, agents=AGENTS):
        (redis_port,) = re.findall(r"starting a private Redis on port (\d+)", log.read_text(errors="replace"))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=int(redis_port), socket_timeout=5).keys("*")
        password = (var / "redis" / "password").read_text().strip()
        assert redis.Redis(host="127.0.0.1", port=int(redis_port), password=password).ping()
    return log.read_text(errors="replace")


def node_ids(var: Path) -> set[str]:
    if on_postgres():
        from controlplane.nodes.models import Node

        return {str(pk) for pk in Node.objects.values_list("pk", flat=True)}
    with sqlite3.connect(var / "db.sqlite3") as db:
        return {row[0] for row in db.execute("SELECT id FROM nodes_node")}


@pytest.mark.slow
def test_up_again_on_another_port_becomes_ready_and_generates(
    transactional_db, tmp_path: Path, tiny_model: Path
) -> None:
    var = tmp_path / "var"
    first = run_up_until_ready(var, free_port(), tiny_model, tmp_path / "first.log")
    assert " tokens" in first  # the server and Celery reached the Redis that wants a password
    password = (var / "redis" / "password").read_text()
    nodes = node_ids(var)
    assert len(nodes) == AGENTS
    assert (var / "db.sqlite3").exists() is not on_postgres()  # the database it was given, and no other

    port = free_port()
    second = run_up_until_ready(var, port, tiny_model, tmp_path / "second.log")
    assert "holds a credential" not in second
    assert f"{AGENTS} local agents enrolled with this database follow it to http://127.0.0.1:{port}" in second
    assert " tokens" in second.split("generating through the cluster", 1)[1]  # the first generation worked
    assert node_ids(var) == nodes  # the same nodes, on their own new URL: no stale twins
    assert (var / "redis" / "password").read_text() == password  # made once, at the first up
    for i in range(AGENTS):
        stored = json.loads((var / "agents" / f"local-{i}" / credentials.FILE_NAME).read_text())
        assert stored["server"] == f"http://127.0.0.1:{port}"
