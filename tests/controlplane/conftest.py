"""Real services for control-plane tests: a Redis server, a Celery worker process, a small served cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from django.test import override_settings

from controlplane.ops.processes import Child, ProcessGroup, python_env, redis_up, wait_until
from inference.runtime.launcher import free_port
from tests.conftest import xdist_worker
from tests.controlplane.isolated import NOBODY
from tests.controlplane.link_cut import LinkCut
from tests.controlplane.live import (
    SERVED_MODEL,
    TASK_REDELIVERY_S,
    Api,
    LiveControlPlane,
    Served,
    database_url,
    purge_stale_tasks,
)
from tests.paths import REPO


@pytest.fixture
def box() -> Iterator[Path]:
    """A directory of the installing user's own: this user's, or nobody's when the tests run as root
    (an ordinary user's install is then made as nobody: ``isolated.as_ordinary_user``). Not under
    pytest's temporary directory, which only root may enter."""
    path = Path(tempfile.mkdtemp(prefix="odmoe-box-"))
    path.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``REDIS_URL`` if set, else a private redis-server on a free port for this session. Under
    pytest-xdist, worker N uses database N of ``REDIS_URL``'s number onward: workers never purge or
    consume each other's tasks."""
    if os.environ.get("REDIS_URL"):
        yield redis_for_this_worker(os.environ["REDIS_URL"])
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("these tests need Redis: install redis-server or set REDIS_URL")
    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def redis_for_this_worker(url: str) -> str:
    """``url``, on database number N past its own under pytest-xdist's worker N (itself outside xdist)."""
    worker = xdist_worker()
    if worker is None or worker[0] == 0:
        return url
    parts = urllib.parse.urlsplit(url)
    db = int(parts.path.strip("/") or 0) + worker[0]
    return urllib.parse.urlunsplit(parts._replace(path=f"/{db}"))


@pytest.fixture(scope="session", autouse=True)
def celery_on_test_redis(redis_url: str) -> None:
    """Every task the tests enqueue goes to the test Redis, from the first one on, and the shared
    cache (``controlplane.nodes.step_watch``) is there too.

    Set once for the session: Celery keeps its producer connections, so a broker changed
    after the first task was sent would not be used.
    """
    from django.conf import settings

    from controlplane import celery_app

    settings.CELERY_BROKER_URL = redis_url  # for the whole session, on purpose
    settings.CACHES = shared_caches(settings.CACHES, redis_url)  # the step watch's mark, too
    celery_app.conf.broker_url  # noqa: B018 - loads the configuration now, so the next line is not overridden
    celery_app.conf.broker_url = redis_url


def redis_channel_layers(redis_url: str) -> dict:
    """``CHANNEL_LAYERS`` on the test Redis."""
    return {"default": {"BACKEND": "controlplane.channel_layer.RedisChannelLayer", "CONFIG": {"hosts": [redis_url]}}}


def shared_caches(caches: dict, redis_url: str) -> dict:
    """``CACHES`` with the ``shared`` one (``controlplane.nodes.step_watch``) on the test Redis."""
    return {**caches, "shared": {**caches["shared"], "LOCATION": redis_url}}


@pytest.fixture
def channel_layer_on_test_redis(settings, redis_url: str) -> Iterator[None]:
    """This process's channel layer and shared cache on the test Redis (layers are cached: dropped
    before and after)."""
    from channels.layers import channel_layers

    settings.CHANNEL_LAYERS = redis_channel_layers(redis_url)
    settings.CACHES = shared_caches(settings.CACHES, redis_url)
    settings.REDIS_URL = redis_url  # nodes' liveness too (controlplane.nodes.liveness)
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture
def celery_worker(transactional_db, redis_url: str, settings, tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A real Celery worker process on the test database and the test Redis."""
    settings.VAR_DIR = tmp_path / "var"  # shards land here, not in the checkout
    purge_stale_tasks()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.config.settings.test",
        "DATABASE_URL": database_url(),
        "REDIS_URL": redis_url,
        "ODMOE_VAR_DIR": str(settings.VAR_DIR),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
    }
    log = open(tmp_path / "celery.log", "wb")  # noqa: SIM115 - owned by the worker process
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "--pool=solo",
            "--concurrency=1",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--queues",
            "celery,jobs",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )
    log.close()
    deadline = time.monotonic() + 60
    while b"ready." not in (tmp_path / "celery.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the Celery worker did not start:\n" + (tmp_path / "celery.log").read_text()[-3000:])
        time.sleep(0.2)
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class OwnRedis:
    """A redis-server of one test, in its cluster's process group: it can be killed and started again on
    its port. No persistence: a restart starts empty, as after a crash between snapshots."""

    group: ProcessGroup
    port: int
    data_dir: Path
    child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("these tests need redis-server")
        argv = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self.child = self.group.start("redis", [*argv, "--dir", str(self.data_dir)])
        self.group.children.insert(0, self.group.children.pop())  # stopped last: after what uses it
        wait_until("redis-server answering", lambda: redis_up(self.url), timeout_s=20, check=self.group.check)

    def kill(self) -> None:
        assert self.child is not None
        self.group.stop(self.child, kill=True)
        self.child = None


@dataclass
class ServedOnOwnRedis:
    served: Served
    redis: OwnRedis


@pytest.fixture
def served(transactional_db, redis_url: str, tmp_path: Path, tiny_model: Path) -> Iterator[Served]:
    purge_stale_tasks()
    with tiny_cluster(tmp_path, tiny_model, redis_url) as (served, _):
        yield served


@pytest.fixture
def served_without_shadow(transactional_db, redis_url: str, tmp_path: Path, tiny_model: Path) -> Iterator[Served]:
    """``served`` on 2 agents: odmoe with main's next-gate predictor, so main and one worker, no shadow;
    its worker's experts stored coded (``expert_codec``), which must change no token."""
    purge_stale_tasks()
    cluster = tiny_cluster(
        tmp_path, tiny_model, redis_url, agents=2, predictor="next-gate", expert_codec="exponent-plane"
    )
    with cluster as (served, _):
        yield served


@pytest.fixture(params=[("qwen2_moe", "bfloat16"), ("granitemoe", "float32")], ids=lambda p: "-".join(p))
def served_family(request, transactional_db, redis_url: str, tmp_path: Path) -> Iterator[Served]:
    """``served`` on a checkpoint of another family: Qwen2-MoE in bf16 (a shared expert beside the
    routed ones) or GraniteMoE (experts fused on disk), in the release layout."""
    from inference.tools.tiny import make_tiny

    family, dtype = request.param
    shape = dict(layers=3, hidden=36, intermediate=22, experts=7, top_k=3, heads=3, kv_heads=1, head_dim=12)
    model = make_tiny(tmp_path / "model", family=family, dtype=dtype, seed=7, shards=3, **shape)
    purge_stale_tasks()
    with tiny_cluster(tmp_path, model, redis_url) as (served, _):
        yield served


@contextlib.contextmanager
def tiny_cluster(
    tmp_path: Path,
    tiny_model: Path,
    redis_url: str,
    own_redis_port: int | None = None,
    *,
    agents: int = 3,
    predictor: str = "",
    agent_python: Path | None = None,
    max_per_user: int | None = None,
    expert_codec: str = "none",
    draft_tokens: int = 0,
    link_cut: bool = False,
    replay: str = "prefill",
) -> Iterator[tuple[Served, OwnRedis | None]]:
    """A real ASGI server, Celery worker and ``agents`` agents serving ``tiny_model`` as one ready deployment
    with ``predictor``, ``expert_codec``, ``draft_tokens``, ``replay`` (and ``max_per_user``, if given), on
    ``redis_url``; with ``own_redis_port``, that Redis is started first, in the cluster's process group. With
    ``link_cut``, the agents reach the server through a proxy the test can cut (``plane.link_cut``).

    The deployment is started through the live server's REST API, so nothing is enqueued from this
    process (whose Celery producer stays on the session's Redis: ``celery_on_test_redis``). With
    ``agent_python``, the agents run from that interpreter's installation of the agent's package.
    """
    from channels.layers import channel_layers
    from django.contrib.auth import get_user_model

    from controlplane.accounts.services import create_api_key
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment
    from controlplane.deployments.services import create_deployment
    from controlplane.nodes.models import Node, NodeStatus
    from controlplane.nodes.services import create_join_token

    with override_settings(CHANNEL_LAYERS=redis_channel_layers(redis_url), VAR_DIR=tmp_path / "var"):
        channel_layers.backends.clear()
        users = get_user_model().objects
        keys = [
            create_api_key(user=users.create_user("staff", is_staff=True))[1],
            create_api_key(user=users.create_user("alice"))[1],
            create_api_key(user=users.create_user("bob"))[1],
        ]
        env = python_env(
            DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
            DATABASE_URL=database_url(),
            REDIS_URL=redis_url,
            ODMOE_VAR_DIR=str(tmp_path / "var"),
            ODMOE_TASK_REDELIVERY_S=str(TASK_REDELIVERY_S),
        )
        port = free_port()
        with contextlib.ExitStack() as stack, ProcessGroup(tmp_path / "logs", env) as group:
            own = None
            if own_redis_port is not None:
                own = OwnRedis(group, own_redis_port, tmp_path / "redis")
                own.data_dir.mkdir()
                own.start()
            plane = LiveControlPlane(group, port, Api(f"http://127.0.0.1:{port}", keys[0]), tmp_path / "agents")
            if link_cut:
                plane.link_cut = LinkCut(port)
                stack.callback(plane.link_cut.close)
            # The server, Celery and the agents start together: the agents once the server answers,
            # the deployment once Celery is ready.
            celery = plane.start_celery(wait=False)
            plane.start_server()
            _, token = create_join_token(created_by=None, max_uses=agents)
            plane.state_root.mkdir(parents=True, exist_ok=True)
            for i in range(agents):
                plane.start_agent(f"s{i}", token, python=agent_python)
            plane.wait_for_celery(celery)
            plane.wait_for(
                f"{agents} agents", lambda: Node.objects.filter(status=NodeStatus.ONLINE).count() == agents, 90
            )
            model = register_model(name="tiny", path=str(tiny_model))
            bound = {} if max_per_user is None else {"max_per_user": max_per_user}
            deployment = create_deployment(
                name=SERVED_MODEL,
                model=model,
                node_ids=[str(pk) for pk in Node.objects.values_list("pk", flat=True)],
                predictor=predictor,
                expert_codec=expert_codec,
                draft_tokens=draft_tokens,
                replay=replay,
                **bound,
            )
            plane.api.post(f"/api/deployments/{deployment.pk}/start", expect=202)
            plane.wait_for("ready", lambda: Deployment.objects.get(pk=deployment.pk).status == "ready", 180)
            yield Served(plane, *keys, tiny_model), own
        channel_layers.backends.clear()


@pytest.fixture
def served_on_own_redis(transactional_db, tmp_path: Path, tiny_model: Path) -> Iterator[ServedOnOwnRedis]:
    """``served``, but on a Redis of its own that the test may kill and restart (whatever ``REDIS_URL`` says),
    its agents linked through a proxy the test may cut (``plane.link_cut``), answers carried across main's restart
    exactly (``replay`` exact)."""
    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    cluster = tiny_cluster(tmp_path, tiny_model, redis_url, redis_port, link_cut=True, replay="exact")
    with cluster as (served, own):
        yield ServedOnOwnRedis(served, own)
