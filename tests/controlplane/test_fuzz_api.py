"""Fuzzing the control plane's HTTP API on a live server: no input is a 5xx.

Schemathesis generates requests from the OpenAPI schema the server publishes at
``/api/schema/`` (valid ones and, in its coverage phase, ones that break the schema) and
sends them, as a staff API key, to a real ASGI server on the test database; the check is
``not_a_server_error``. The OpenAI-compatible endpoints under ``/v1`` are not in that schema:
hypothesis throws JSON bodies at them (random keys and values, the known fields with values
of the wrong type, integers past 64 bits, deep nesting, bytes that are not JSON). With no
deployment ready, every answer is a 4xx, or the documented 503 ``model_not_ready`` for the
deployment that exists but is not running.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import schemathesis
from django.test import override_settings
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.control import SkipTest

from controlplane.ops.processes import ProcessGroup, python_env
from inference.runtime.launcher import free_port
from tests.controlplane.conftest import redis_channel_layers
from tests.controlplane.live import Api, LiveControlPlane, database_url, purge_stale_tasks
from tests.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DRAFT = "fuzz-draft"  # a deployment that exists and is not running: asking it for text is a 503


@dataclass
class Live:
    server: str
    staff_key: str
    spare_key_id: int
    node_id: str


# Hypothesis keeps its caches under var/ (which git ignores), not in a .hypothesis/ of the checkout;
# set on import, since its pytest plugin gathers constants while collecting.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    set_hypothesis_home_dir(REPO / "var" / "hypothesis")


@pytest.fixture
def live(transactional_db, redis_url: str, tmp_path: Path, tiny_model: Path) -> Iterator[Live]:
    """A real ASGI server on the test database, with a staff key, a node, a model and a draft deployment."""
    from django.contrib.auth import get_user_model

    from controlplane.accounts.services import create_api_key
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.services import create_deployment
    from controlplane.nodes.services import create_join_token, enroll_node, record_heartbeat

    with override_settings(CHANNEL_LAYERS=redis_channel_layers(redis_url), VAR_DIR=tmp_path / "var"):
        purge_stale_tasks()
        staff = get_user_model().objects.create_user("staff", is_staff=True)
        _, key = create_api_key(user=staff)
        spare, _ = create_api_key(user=staff, name="spare")
        _, token = create_join_token(created_by=None)
        node, _ = enroll_node(token=token, name="box", inventory={})
        gpus = [{"index": i, "name": "RTX 3090", "memory_bytes": 24 * 2**30} for i in range(4)]
        inventory = {"address": "127.0.0.1", "free_ports": [9300, 9301, 9302, 9303, 9304], "gpus": gpus}
        record_heartbeat(node_id=str(node.pk), inventory=inventory | {"ram_bytes": 64 * 2**30})
        model = register_model(name="tiny", path=str(tiny_model))
        create_deployment(name=DRAFT, model=model, node_ids=[str(node.pk)])
        env = python_env(
            DJANGO_SETTINGS_MODULE="controlplane.config.settings.test",
            DATABASE_URL=database_url(),
            REDIS_URL=redis_url,
            ODMOE_VAR_DIR=str(tmp_path / "var"),
        )
        port = free_port()
        with ProcessGroup(tmp_path / "logs", env) as group:
            plane = LiveControlPlane(group, port, Api(f"http://127.0.0.1:{port}", key), tmp_path / "agents")
            plane.start_server()
            yield Live(plane.server, key, spare.pk, str(node.pk))
            group.check()  # the server is still up after all of it
        purge_stale_tasks()  # what the fuzzed requests enqueued, with no worker to run it


EXAMPLES = 6  # per operation and mode: ~30 operations, positive and negative, in well under a minute


def test_no_request_the_schema_allows_or_breaks_is_a_server_error(live: Live) -> None:
    """Every operation of the published schema, with data that fits it and data that breaks it."""
    schema = schemathesis.openapi.from_url(f"{live.server}/api/schema/", timeout=30)
    schema.config.update(
        base_url=live.server, headers={"Authorization": f"Bearer {live.staff_key}"}, request_timeout=30
    )
    # Negative data is asked for explicitly below; this makes an operation with nothing to
    # break (no parameters, no body) skip at once rather than draw and reject case after case.
    schema.config.generation.update(modes=[GenerationMode.NEGATIVE])
    failures: list[str] = []
    calls = 0
    operations = [result.ok() for result in schema.get_all_operations()]
    # Deletions last, so that what they remove is there for the others first.
    for operation in sorted(operations, key=lambda op: op.method.upper() == "DELETE"):
        # Random UUIDs name no node: node operations work on the enrolled one. And the key
        # operations on a spare key: revoking the fuzzer's own key would end the run.
        fixed = {"node_id": live.node_id, "key_id": live.spare_key_id}
        fixed = {name: value for name, value in fixed.items() if f"{{{name}}}" in operation.path} or None
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            made, failed = fuzz_operation(operation.as_strategy(mode, path_parameters=fixed))
            calls += made
            failures += failed[:1]  # one per operation and mode says where
    assert len(operations) >= 30 and calls >= 200, (len(operations), calls)  # the schema was read and fuzzed
    assert not failures, "\n".join(failures)


def fuzz_operation(strategy) -> tuple[int, list[str]]:
    """``EXAMPLES`` calls of what ``strategy`` generates: how many were made, and a curl command
    and the reason for each that was a server error."""
    made: list[schemathesis.Case] = []
    failed: list[str] = []

    # No shrinking: a failure is reported as found, with a command that repeats it.
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def call(case: schemathesis.Case) -> None:
        made.append(case)
        try:
            case.call_and_validate(checks=[not_a_server_error])
        except (AssertionError, BaseExceptionGroup) as exc:  # schemathesis's failure, or several at once
            failed.append(f"{case.as_curl_command()}\n    {exc}")

    with contextlib.suppress(SkipTest, Unsatisfiable):  # negative data for an operation that takes none
        call()
    return len(made), failed


# --- the OpenAI-compatible API, which the schema does not describe ------------------------------

FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "frequency_penalty",
    "response_format",
]
# Text with, now and then, a lone surrogate: JSON can write one ("\\ud800"), UTF-8 cannot.
TEXT = st.text(st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=40)
HUGE = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | HUGE
    | st.floats()  # NaN and infinities too: Python's json writes and reads them
    | TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={"role": st.sampled_from(["system", "user", "assistant", "tool", ""]) | JSON, "content": JSON},
)
BODIES = st.one_of(
    # The known fields with values of any type, and keys nobody knows.
    st.dictionaries(st.sampled_from(FIELDS) | TEXT, JSON, max_size=8),
    # Plausible requests, one field at a time gone wrong.
    st.fixed_dictionaries(
        {"model": st.sampled_from([DRAFT, "no-such-model", ""]) | JSON},
        optional={
            "messages": st.lists(MESSAGE, max_size=3) | JSON,
            "prompt": TEXT | st.lists(TEXT, max_size=2) | JSON,
            "max_tokens": st.integers() | HUGE | JSON,
            "temperature": st.floats() | HUGE | JSON,
            "top_p": st.floats() | JSON,
            "seed": st.integers() | HUGE | JSON,
            "n": st.integers(-1, 3) | JSON,
            "stop": TEXT | st.lists(JSON, max_size=6),
            "stream": st.booleans() | JSON,
            "stream_options": st.fixed_dictionaries({"include_usage": JSON}) | JSON,
            "logprobs": st.booleans() | st.integers(-1, 25) | JSON,
            "top_logprobs": st.integers(-1, 25) | JSON,
            "echo": st.booleans() | JSON,
        },
    ),
    JSON,  # not an object at all
)
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
# Bodies that are not JSON go to some of the REST API's JSON endpoints too (schemathesis sends JSON).
REST_ENDPOINTS = ["/api/jobs", "/api/deployments", "/api/models", "/api/agents/enroll", "/api/keys"]
NOT_JSON = [
    b"{",
    b'{"model": ' + b"9" * 5000 + b"}",  # past Python's digit limit for int()
    b"[" * 5000 + b"]" * 5000,  # deeper than Python's JSON parser recurses
    '{"model": "\u00e9"}'.encode("latin-1"),  # not UTF-8
]
# JSON, with lone surrogates: JSON can say "\\ud800", UTF-8 cannot, and neither can a database.
SURROGATES = [
    b'{"model": "\\ud800", "name": "\\ud800", "path": "\\ud800"}',
    b'{"model": "' + DRAFT.encode() + b'", "prompt": "\\udfff", "messages": [{"role": "user", "content": "\\udfff"}]}',
]


def send(url: str, key: str, data: bytes | None, method: str = "POST") -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def check_answer(status: int, raw: bytes, what: str) -> None:
    """A 4xx, or the 503 of a deployment that exists but is not ready; never any other 5xx."""
    if status < 500:
        return
    assert status == 503, f"{what}: {status} {raw[:300]!r}"
    assert json.loads(raw)["error"]["code"] == "model_not_ready", f"{what}: {raw[:300]!r}"


def test_the_openai_api_answers_fuzzed_bodies_without_a_server_error(live: Live) -> None:
    seen: set[int] = set()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(ENDPOINTS), body=BODIES)
    def json_bodies(path: str, body) -> None:
        status, raw = send(live.server + path, live.staff_key, json.dumps(body).encode())
        seen.add(status)
        check_answer(status, raw, f"POST {path} {json.dumps(body)[:300]}")

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(ENDPOINTS + REST_ENDPOINTS), data=st.binary(max_size=200))
    def raw_bodies(path: str, data: bytes) -> None:
        status, raw = send(live.server + path, live.staff_key, data)
        seen.add(status)
        check_answer(status, raw, f"POST {path} {data[:300]!r}")

    json_bodies()
    raw_bodies()
    for path in ENDPOINTS + REST_ENDPOINTS:
        for data in NOT_JSON + SURROGATES:
            status, raw = send(live.server + path, live.staff_key, data)
            check_answer(status, raw, f"POST {path} {data[:100]!r}")
            if data in NOT_JSON or path in ENDPOINTS:
                assert status == 400, f"POST {path} {data[:100]!r}: {status} {raw[:300]!r}"
    for method in ("GET", "PUT", "DELETE"):
        for path in ENDPOINTS:
            status, raw = send(live.server + path, live.staff_key, None, method)
            assert status == 405, f"{method} {path}: {status} {raw[:200]!r}"
    status, raw = send(live.server + "/v1/models", live.staff_key, None, "GET")
    assert status == 200 and json.loads(raw)["data"] == [], raw  # the draft is not listed: it is not ready
    assert send(live.server + "/v1/models", "not-a-key", None, "GET")[0] == 401
    assert 400 in seen and 503 in seen, seen  # the bodies reached both the checks and the lookup
