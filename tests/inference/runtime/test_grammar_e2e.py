"""Grammar compiles end to end: main compiles off its step loop, after admission, under the limits.

Real main, shadow and worker roles on 127.0.0.1 (threads of the test process, over the same
authenticated sockets), one deployment for the module: one place in the batch, two in the queue,
two generations a user. The heavy schema is the hostile-tenant report's: 8,000 optional
properties (231 KB), seconds of compile before llguidance finds it past ``max_grammar_size``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import llguidance
import pytest

from inference.runtime.client import RuntimeClient
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.wire.generation import Done, Failed, Generate, Token

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 14]


def _heavy(properties: int = 8000) -> str:
    """The report's schema (another number of properties: another grammar, not in main's cache)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


BROKEN = llguidance.grammar_from("lark", "start: missing_rule")  # does not compile


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[LocalCluster]:
    settings = DeploymentSettings(max_batch=1, max_waiting=2, max_per_user=2)
    with LocalCluster(tiny_model, ClusterOptions(workers=2, settings=settings, in_process=True)) as running:
        yield running


class _Requests:
    """Generations sent to main one after another over one client; their answers in arrival order."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        self.answers: list[Done | Failed] = []
        self.tokens: dict[str, int] = {}

    def send(
        self, user: str, *, grammar: str = "", max_new_tokens: int = 8, prompt: list[int] = PROMPT, answered: int = 0
    ) -> str:
        request_id = f"{user}-{uuid.uuid4().hex[:6]}"
        generate = Generate(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            user=user,
            grammar=grammar,
            answered=answered,
        )
        self.client.endpoint.send("main", generate)
        return request_id

    def wait(self, until, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            received = self.client.endpoint.recv(timeout_s=0.5)
            if received is None:
                continue
            msg = received.msg
            if isinstance(msg, Token):
                self.tokens[msg.request_id] = self.tokens.get(msg.request_id, 0) + 1
            elif isinstance(msg, Done | Failed):
                self.answers.append(msg)
        assert until(), f"main did not answer in time: {self.answers}"

    def answer(self, request_id: str) -> Done | Failed | None:
        return next((a for a in self.answers if a.request_id == request_id), None)

    def answered(self, *request_ids: str):
        return lambda: all(self.answer(r) is not None for r in request_ids)

    def close(self) -> None:
        self.client.close()


@pytest.fixture()
def requests(cluster: LocalCluster) -> Iterator[_Requests]:
    made = _Requests(cluster)
    yield made
    made.close()


def test_another_users_generation_runs_to_its_end_while_a_heavy_grammar_compiles(requests: _Requests) -> None:
    heavy = requests.send("bob", grammar=_heavy())
    plain = requests.send("alice")
    requests.wait(requests.answered(heavy, plain))
    order = [a.request_id for a in requests.answers]
    assert order == [plain, heavy]  # alice's 8 tokens did not wait for bob's compile
    done = requests.answer(plain)
    assert isinstance(done, Done) and len(done.token_ids) == 8
    refused = requests.answer(heavy)
    assert isinstance(refused, Failed)
    assert "over the limit max_grammar_size = 40000 grammar symbols" in refused.error


def test_admission_refuses_before_any_compile(requests: _Requests) -> None:
    # A grammar that does not compile, sent past a bound: the answer is the bound, because admission
    # comes first (the compile never runs). Alice fills the batch and her own bound of two.
    running = requests.send("alice", max_new_tokens=400)
    requests.wait(lambda: requests.tokens.get(running, 0) > 0)
    queued = requests.send("alice", max_new_tokens=400)
    too_many = requests.send("alice", grammar=BROKEN)
    requests.wait(requests.answered(too_many))
    refusal = requests.answer(too_many)
    assert isinstance(refusal, Failed) and refusal.too_many_generations, refusal
    # Carol takes the queue's second place; the queue is full for bob.
    waiting = requests.send("carol")
    full = requests.send("bob", grammar=BROKEN)
    requests.wait(requests.answered(full))
    refusal = requests.answer(full)
    assert isinstance(refusal, Failed) and refusal.busy, refusal
    for request_id in (running, queued, waiting):
        requests.client.cancel(request_id)
    requests.wait(requests.answered(running, queued, waiting))


def test_a_request_cancelled_while_its_grammar_compiles_is_answered_at_once(requests: _Requests) -> None:
    heavy = requests.send("bob", grammar=_heavy(7999))
    requests.client.cancel(heavy)
    requests.wait(requests.answered(heavy))
    answer = requests.answer(heavy)
    assert isinstance(answer, Done) and answer.finish_reason == "cancelled" and answer.token_ids == []
    # Bob's place is free again: his next generations are admitted (two may run and wait).
    first, second = requests.send("bob"), requests.send("bob")
    requests.wait(requests.answered(first, second))
    assert all(isinstance(requests.answer(r), Done) for r in (first, second))


def test_a_continuation_walks_its_grammar_through_the_answer_it_re_reads(requests: _Requests) -> None:
    """Main's restart cut an answer under a grammar after ``cut`` tokens; its continuation
    (``agent.migration``) re-reads them as prompt and says so (``Generate.answered``): main's
    grammar walks them first, so the rest is the undisturbed answer's. A request that did not say
    so would begin a new document there."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    new, cut = 12, 5
    undisturbed = requests.send("alice", grammar=grammar, max_new_tokens=new)
    requests.wait(requests.answered(undisturbed))
    whole = requests.answer(undisturbed)
    assert isinstance(whole, Done) and len(whole.token_ids) == new, whole
    continued = {
        answered: requests.send(
            "alice", grammar=grammar, max_new_tokens=new - cut, prompt=PROMPT + whole.token_ids[:cut], answered=answered
        )
        for answered in (cut, 0)
    }
    requests.wait(requests.answered(*continued.values()))
    walked, fresh = (requests.answer(continued[answered]) for answered in (cut, 0))
    assert isinstance(walked, Done) and walked.token_ids == whole.token_ids[cut:], (walked, whole)
    assert isinstance(fresh, Done) and fresh.token_ids != whole.token_ids[cut:]
    # Tokens the grammar refuses (the answer's last, where its document began): refused, saying so.
    refused = requests.send("alice", grammar=grammar, prompt=PROMPT + whole.token_ids[cut:], answered=new - cut)
    requests.wait(requests.answered(refused))
    failed = requests.answer(refused)
    assert isinstance(failed, Failed)
    assert "the grammar refuses the answer's tokens from before its restart" in failed.error
