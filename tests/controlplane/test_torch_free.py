"""The control plane's web and Celery processes never import torch (nor Transformers).

Torch takes seconds and hundreds of MB to import; the web process only tokenizes
(``controlplane/serving/tokenizer.py``) and the Celery worker only builds shards with it, inside
the functions that do (``inference.building.sharding``). Each check runs in a process of its own, so
that what other tests imported cannot hide an import or fake one:

- the ASGI application and every view its URLs name, imported as a server would;
- every app's ``tasks`` module, autodiscovered as ``celery -A controlplane worker`` does;
- a real ASGI server (uvicorn, a second web worker beside the cluster's own) serving a chat
  message over its websocket and an OpenAI chat completion from a real served cluster, its
  modules written as it exits (``modules_probe.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.ops.processes import asgi_argv, http_up, python_env, wait_until
from inference.runtime.launcher import free_port
from tests.controlplane.live import SERVED_MODEL, Served
from tests.paths import REPO

HEAVY = ("torch", "transformers")


def imported_in_a_fresh_process(code: str) -> set[str]:
    """The modules a new interpreter holds after running ``code`` with the test settings."""
    script = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    env = python_env(DJANGO_SETTINGS_MODULE="controlplane.config.settings.test")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.split())


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_the_web_process_imports_its_application_and_every_view_without_torch() -> None:
    modules = imported_in_a_fresh_process(
        "import django\n"
        "django.setup()\n"
        "from controlplane.config.asgi import application\n"
        "from django.urls import get_resolver\n"
        "def views(patterns):\n"
        "    for p in patterns:\n"
        "        yield from views(p.url_patterns) if hasattr(p, 'url_patterns') else [p.callback]\n"
        "assert len(list(views(get_resolver().url_patterns))) > 20\n"
        "import inference\n"
        "assert inference.__file__.startswith(" + repr(str(REPO)) + "), inference.__file__\n"
    )
    assert "controlplane.serving.openai_api" in modules and "controlplane.chat.consumers" in modules
    assert heavy(modules) == []


def test_a_celery_worker_imports_every_task_module_without_torch() -> None:
    modules = imported_in_a_fresh_process(
        "from controlplane.config.celery_app import app\n"
        "import django\n"
        "django.setup()\n"
        "app.loader.import_default_modules()  # what a worker does as it starts: every app's tasks\n"
        "assert 'controlplane.artifacts.tasks.build_model_shards_task' in app.tasks\n"
    )
    assert {"controlplane.artifacts.tasks", "controlplane.deployments.tasks", "controlplane.serving.tasks"} <= modules
    assert heavy(modules) == []


@pytest.mark.slow
def test_a_web_worker_serves_a_chat_and_an_openai_call_without_importing_torch(served: Served, tmp_path: Path) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client
    from websockets.sync.client import connect

    plane = served.plane
    port, out = free_port(), tmp_path / "web-modules.txt"
    argv = asgi_argv(port)
    assert argv[1:3] == ["-m", "uvicorn"]
    probe = plane.group.start(
        "asgi-probe", [sys.executable, str(Path(__file__).parent / "modules_probe.py"), str(out), *argv[2:]]
    )
    server = f"http://127.0.0.1:{port}"
    wait_until("the second web worker", lambda: http_up(server + "/api/schema/"), timeout_s=60, check=plane.group.check)

    browser = Client()
    browser.force_login(get_user_model().objects.get(username="alice"))
    headers = {"Origin": server, "Cookie": f"sessionid={browser.cookies['sessionid'].value}"}
    events = []
    with connect(f"ws://127.0.0.1:{port}/ws/chat/", additional_headers=headers, open_timeout=30) as socket:
        socket.send(json.dumps({"type": "send", "conversation": None, "content": "Which experts?", "max_tokens": 6}))
        while not events or events[-1]["type"] not in ("done", "error"):
            events.append(json.loads(socket.recv(timeout=120)))
    assert events[-1]["type"] == "done" and events[-1]["status"] == "complete", events[-1]
    assert any(e["type"] == "token" for e in events)

    client = served.client()
    client.base_url = f"{server}/v1"
    answer = client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Which experts?"}], max_tokens=6, temperature=0
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0

    plane.group.stop(probe)  # uvicorn shuts down on SIGTERM; the probe writes its modules as it exits
    modules = set(out.read_text().split())
    assert "controlplane.serving.openai_api" in modules and "controlplane.chat.consumers" in modules
    assert "tokenizers" in modules and "jinja2" in modules  # it did tokenize and render
    assert heavy(modules) == []


def test_the_probe_reports_what_a_process_imported(tmp_path: Path) -> None:
    out = tmp_path / "modules.txt"
    probe = Path(__file__).parent / "modules_probe.py"
    subprocess.run([sys.executable, str(probe), str(out), "json.tool", "--help"], check=True, capture_output=True)
    modules = set(out.read_text().split())
    assert {"json", "argparse"} <= modules and "torch" not in modules  # json.tool runs as __main__
