"""``python manage.py up``: the whole platform on this machine, in one command.

Starts Redis with a password (``processes.private_redis``; unless ``REDIS_URL`` is set, which is
used as it is), migrates, creates an admin account if there is none, starts the ASGI server and a
Celery worker with beat, then (unless ``--no-demo``) N local agents on 127.0.0.1 that enroll with a
join token, deploys the demo model on them and generates through the cluster once. It prints
``odmoe ready: URL`` when all of that worked, and stops everything it started on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import urllib.parse
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from controlplane.ops import demo
from controlplane.ops.processes import (
    ChildFailed,
    ProcessGroup,
    agent_argv,
    asgi_argv,
    celery_argv,
    http_up,
    private_redis,
    python_env,
    redis_up,
    wait_until,
)
from inference.runtime.launcher import SPAWNS, free_port

# The demo model: a small Mixtral trained on Python's documentation (python -m inference train-demo).
SHIPPED_DEMO_MODEL = Path(settings.REPO_DIR) / "platform" / "demo-model"
DEMO_PROMPT = "In Python, a dictionary"
DEMO_TOKENS = 24


class Command(BaseCommand):
    help = __doc__.splitlines()[0].split(": ", 1)[1]

    def add_arguments(self, parser) -> None:
        parser.add_argument("--port", type=int, default=8000, help="the web and API port (default 8000)")
        parser.add_argument("--agents", type=int, default=10, help="local agents: 1 main, 1 shadow, the rest workers")
        parser.add_argument("--no-demo", action="store_true", help="only the control plane: no local agents or demo")
        parser.add_argument(
            "--model", type=Path, default=None, help="the demo checkpoint (default: platform/demo-model)"
        )
        parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the demo deployment")
        parser.add_argument(
            "--role-spawn",
            choices=SPAWNS,
            default="fork",
            help="fork: the local agents' roles fork from a zygote of each kind they share, which imported the "
            "runtime once (default); exec: each role a fresh process, as on a box with an agent of its own",
        )

    def handle(self, *args, **options) -> None:
        if not options["no_demo"] and options["agents"] < 3:
            raise CommandError("--agents must be at least 3 (main, shadow and one worker)")
        var = Path(settings.VAR_DIR)
        var.mkdir(parents=True, exist_ok=True)
        _port_free_or_fail(options["port"])
        stopping = {"signal": None}

        def on_signal(signum, frame) -> None:
            if stopping["signal"] is not None:
                return  # already stopping: a second Ctrl-C must not cut the clean-up short
            stopping["signal"] = signum
            raise KeyboardInterrupt

        # Both explicitly: a shell that starts ``up`` in the background leaves SIGINT ignored.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        group = ProcessGroup(var / "logs", python_env())
        try:
            self._run(group, var, options)
            self._serve_until_stopped(group)
        except KeyboardInterrupt:
            self.stdout.write("stopping…")
        except ChildFailed as exc:
            raise CommandError(str(exc)) from None
        finally:
            self._stop_demo()
            group.stop_all()
            self.stdout.write("stopped everything up started")

    # --- steps ---------------------------------------------------------------------------------

    def _run(self, group: ProcessGroup, var: Path, options: dict) -> None:
        port = options["port"]
        url = f"http://127.0.0.1:{port}"
        self._redis(group, var)
        self.step("migrating the database")
        call_command("migrate", interactive=False, verbosity=0)
        password = demo.ensure_admin()
        demo.forget_connections()
        self.step("starting the ASGI server, a Celery worker with beat, and one for jobs")
        group.start("asgi", asgi_argv(port))
        celery = group.start(
            "celery", celery_argv(beat_schedule=var / "celerybeat-schedule", queues=(settings.CONTROL_QUEUE,))
        )
        jobs = group.start("jobs", celery_argv(beat_schedule=None, queues=(settings.JOBS_QUEUE,), name="jobs"))
        wait_until("the ASGI server answering", lambda: http_up(url + "/api/schema/"), timeout_s=60, check=group.check)
        for worker in (celery, jobs):
            wait_until(
                f"the Celery worker {worker.name}",
                lambda worker=worker: b"ready." in worker.log_path.read_bytes(),
                timeout_s=90,
                check=group.check,
            )
        if not options["no_demo"]:
            self._demo(group, var, url, options)
        self.stdout.write(self.style.SUCCESS(f"odmoe ready: {url}/"))
        if password:
            self.stdout.write(f"admin account (shown once): user {demo.ADMIN_NAME}, password {password}")
        self.stdout.write(f"chat {url}/chat/ · console {url}/console/ · API docs {url}/api/docs/ · OpenAI API {url}/v1")
        self.stdout.write(f"logs in {group.log_dir} · Ctrl-C stops everything")

    def _redis(self, group: ProcessGroup, var: Path) -> None:
        if os.environ.get("REDIS_URL"):  # the user's, used as it is
            if not redis_up(os.environ["REDIS_URL"]):
                raise CommandError(f"REDIS_URL={_without_password(os.environ['REDIS_URL'])} does not answer")
            return
        port = free_port()
        self.step(f"starting a private Redis on port {port}, with a password (data in {var / 'redis'})")
        try:
            argv, url = private_redis(var, port)
            group.start("redis", argv)
        except ChildFailed as exc:
            raise CommandError(str(exc)) from None
        wait_until("Redis answering", lambda: redis_up(url), timeout_s=30, check=group.check)
        _use_redis(url)
        group.env["REDIS_URL"] = url

    def _demo(self, group: ProcessGroup, var: Path, url: str, options: dict) -> None:
        from controlplane.deployments.models import Deployment, DeploymentStatus
        from controlplane.nodes.models import Node, NodeStatus

        model_dir = options["model"] or SHIPPED_DEMO_MODEL
        if not (model_dir / "config.json").exists():
            if options["model"] is not None:
                raise CommandError(f"{model_dir} is not a checkpoint directory (no config.json)")
            from inference.tools.tiny import make_tiny

            model_dir = var / "demo-model"
            self.step(f"the shipped demo model is missing; writing a random one to {model_dir}")
            make_tiny(model_dir, seed=0)
        agents = options["agents"]
        self.step(f"starting {agents} local agents")
        token = demo.local_join_token(agents)
        names = [f"local-{i}" for i in range(agents)]
        states = {name: var / "agents" / name for name in names}
        # Its own agents' credentials: forgotten for a fresh database, moved to this URL after a run on another port.
        moved = [name for name in names if demo.prepare_local_credential(states[name], url) == demo.FOLLOW]
        if moved:
            self.step(f"{len(moved)} local agents enrolled with this database follow it to {url}")
        zygotes = group.share_zygotes() if options["role_spawn"] == "fork" else None
        for name in names:
            argv = agent_argv(url, states[name], name=name, token=token, heartbeat_s=2.0, zygotes=zygotes)
            group.start(f"agent-{name}", argv, env={"REDIS_URL": None})  # an agent needs no Redis, nor its password

        def online() -> bool:
            return Node.objects.filter(name__in=names, status=NodeStatus.ONLINE).count() == agents

        wait_until(f"{agents} agents online", online, timeout_s=180, check=group.check)
        model = demo.ensure_model(model_dir)
        deployment = demo.start_demo(model, names)
        self.step(f"deploying {model.name} on {agents} nodes (1 main, 1 shadow, {agents - 2} workers)")
        deadline = time.monotonic() + options["timeout"]
        last = ""
        while True:
            group.check()
            deployment = Deployment.objects.get(pk=deployment.pk)
            line = f"{deployment.status} {deployment.status_reason}".strip()
            if line != last:
                self.stdout.write(f"  {line}")
                last = line
            if deployment.status == DeploymentStatus.READY:
                break
            if deployment.status == DeploymentStatus.FAILED:
                raise CommandError(f"the demo deployment failed: {deployment.status_reason}")
            if time.monotonic() > deadline:
                raise CommandError(f"the demo deployment was not ready within {options['timeout']:.0f} s: {line}")
            time.sleep(0.5)
        self._generate_once(deployment, model_dir)

    def _generate_once(self, deployment, model_dir: Path) -> None:
        from controlplane.deployments import generation
        from controlplane.serving.tokenizer import load_text_tokenizer  # the web's: no Transformers to import

        tokenizer = load_text_tokenizer(model_dir)
        prompt_ids = tokenizer.encode(DEMO_PROMPT) if tokenizer is not None else [1, 5, 6, 7, 8]
        self.step("generating through the cluster")
        try:
            done = generation.generate(
                deployment.pk, generation.new_request(prompt_ids=prompt_ids, max_new_tokens=DEMO_TOKENS)
            )
        except (generation.ClusterUnavailable, generation.ClusterGenerationError) as exc:
            raise CommandError(f"the first generation through the cluster failed: {exc}") from None
        text = tokenizer.decode(done.token_ids, skip_special_tokens=True) if tokenizer is not None else done.token_ids
        rate = done.metrics.get("decode_tok_s")
        self.stdout.write(f"  {len(done.token_ids)} tokens" + (f" at {rate:.1f} tok/s" if rate else "") + f": {text!r}")

    def _serve_until_stopped(self, group: ProcessGroup) -> None:
        while True:
            try:
                group.check()
            except ChildFailed as exc:
                if "agent-" not in str(exc).split(" exited", 1)[0]:
                    raise
                self.stderr.write(f"warning: {exc}")
                group.children = [c for c in group.children if c.process.poll() is None]
            time.sleep(1)

    def _stop_demo(self) -> None:
        from controlplane.deployments import lifecycle
        from controlplane.deployments.models import RUNNING, Deployment

        try:
            for deployment in Deployment.objects.filter(name=demo.DEMO_NAME, status__in=RUNNING):
                lifecycle.stop_deployment(deployment=deployment)
        except Exception as exc:  # the database may be what failed; stopping the processes matters more
            self.stderr.write(f"warning: could not mark the demo deployment stopped: {exc}")

    def step(self, text: str) -> None:
        self.stdout.write(f"· {text}")
        sys.stdout.flush()


def _port_free_or_fail(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise CommandError(f"port {port} is in use; pass another with --port") from None


def _without_password(url: str) -> str:
    """``url`` as it may be printed: its password, if any, left out."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1]))


def _use_redis(url: str) -> None:
    """Point this process's Celery, channel layer and shared cache at ``url`` (the children get REDIS_URL)."""
    from channels.layers import channel_layers
    from django.core.signals import setting_changed

    from controlplane import celery_app

    os.environ["REDIS_URL"] = url
    settings.REDIS_URL = settings.CELERY_BROKER_URL = url
    settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"] = [url]
    channel_layers.backends.clear()
    settings.CACHES["shared"]["LOCATION"] = url
    setting_changed.send(sender=None, setting="CACHES", value=settings.CACHES, enter=True)  # clients reopen there
    celery_app.conf.broker_url = url
