"""The load benchmark: its pure figures, and one short run against a real control plane."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import load
from tests.paths import REPO


def test_summary_and_percentiles() -> None:
    figures = load.summary([4.0, 1.0, 3.0, 2.0])
    assert figures["n"] == 4 and figures["min"] == 1.0 and figures["max"] == 4.0
    assert figures["p50"] == pytest.approx(2.5) and figures["p99"] == pytest.approx(3.97)
    assert load.summary([])["p50"] is None
    assert math.isnan(load.percentile([], 0.5))


def test_heartbeats_are_judged_written_or_lost() -> None:
    sent = {("a", 1): 10.0, ("a", 2): 15.0, ("b", 1): 11.0, ("b", 2): 21.0, ("b", 3): 40.0}
    written = {("a", 1): 10.01, ("a", 2): 15.5, ("b", 2): 21.002}
    figures = load.heartbeat_figures(sent, written, (10.0, 30.0), judged_until=30.0)
    assert figures["sent"] == 4 and figures["written"] == 3  # ("b", 3) came after judging
    assert figures["superseded"] == 1 and figures["lost"] == 0  # b#1 never written, but b#2 was
    assert figures["sent_after_judging"] == 1
    assert figures["ms"]["n"] == 3 and figures["ms"]["max"] == pytest.approx(500)
    assert [t["sent"] for t in figures["timeline"]] == [3, 1]


def test_a_heartbeat_overtaken_by_a_later_one_written_is_superseded_not_lost() -> None:
    """The control plane writes a node's newest heartbeat: when its writes fall behind, an older
    one overtaken by a later one of the same agent is never written, and that is no loss."""
    sent = {("a", 1): 10.0, ("a", 2): 15.0, ("a", 3): 20.0, ("b", 1): 11.0, ("b", 2): 16.0}
    written = {("a", 3): 21.0, ("b", 1): 11.5}
    figures = load.heartbeat_figures(sent, written, (10.0, 30.0), judged_until=30.0)
    assert (figures["written"], figures["superseded"], figures["lost"]) == (2, 2, 1)
    assert figures["lost_examples"] == ["b#2"]  # nothing of b's was written after it


def test_only_offline_before_the_cutoff_is_wrong() -> None:
    transitions = [
        ("n1", "enrolled", "online", 1.0),
        ("n1", "online", "offline", 5.0),
        ("n2", "online", "offline", 50.0),  # after the links were closed on purpose
        ("other", "online", "offline", 5.0),  # not watched
    ]
    assert load.wrongly_offline(transitions, {"n1", "n2"}, cutoff=40.0) == ["n1"]


def test_chat_messages_are_complete_failed_or_lost() -> None:
    def record(text: str, done: dict | None, errors: list[str] | None = None) -> dict:
        return {"text": text, "done": done, "errors": errors or [], "problem": ""}

    records = [
        record("hi", {"message_id": 1, "content": "hi", "status": "complete"}),
        record("", {"message_id": 2, "content": "", "status": "failed"}, ["no answer"]),
        record("h", None),  # no done
        record("ab", {"message_id": 3, "content": "abc", "status": "complete"}),  # tokens do not add up
        record("x", {"message_id": 4, "content": "x", "status": "complete"}),  # saved differently
    ]
    saved = {1: ("hi", "complete"), 2: ("", "failed"), 3: ("abc", "complete"), 4: ("y", "complete")}
    judged = load.judge_chats(records, saved)
    assert (judged["sent"], judged["complete"], judged["failed"], judged["lost"]) == (5, 1, 1, 3)


def test_a_chat_message_refused_ends_the_wait_told_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send turned away before anything of it was stored (the database away: PostgreSQL restarting)
    gets an error with ``refused`` and never a ``done``: the browser's page gives the text back, and
    so does the benchmark's user. It waited for a ``done`` instead, and counted the message lost after
    ``CHAT_TIMEOUT_S`` (``load-restarts-jobs-5``: 4 sends at PostgreSQL's restart, "no done within 300 s")."""
    refusal = {"type": "error", "detail": "the database cannot be reached right now (x); try again", "refused": True}
    monkeypatch.setattr(load, "CHAT_TIMEOUT_S", 2.0)

    class Socket:
        def __init__(self, events: list[dict]) -> None:
            self.events = [json.dumps(event) for event in events]

        async def send(self, raw: str) -> None:
            pass

        async def recv(self) -> str:
            if self.events:
                return self.events.pop(0)
            await asyncio.Event().wait()  # the server says nothing more
            raise AssertionError("unreachable")

    record = asyncio.run(load.chat_once(Socket([refusal]), 0, "hello", 8))
    assert (record["problem"], record.get("told")) == ("", f"refused: {refusal['detail']}"), record
    judged = load.judge_chats([record], {})
    assert (judged["failed"], judged["lost"]) == (1, 0) and judged["reasons"] == {record["told"]: 1}


def test_api_streams_are_complete_failed_or_lost() -> None:
    def record(finish: str | None, error: str = "", broken: bool = False) -> dict:
        return {"finish": finish, "error": error, "chunks": 1, **({"broken": True} if broken else {})}

    records = [
        record("length"),
        record("stop"),
        record(None, "HTTP 429: too many generations"),  # refused: the client was told
        record(None, "error event: the link to main's node closed mid-generation"),  # told why, mid-stream
        record(None, "the stream broke: RemoteProtocolError()", broken=True),
        record(None),  # ended without a finish reason
    ]
    judged = load.judge_streams(records)
    assert (judged["sent"], judged["complete"], judged["failed"], judged["lost"]) == (6, 2, 2, 2)
    assert judged["reasons"]["no finish reason"] == 1


def test_job_prompts_are_done_failed_or_lost() -> None:
    def record(status: str | None, done: int = 0, job_id: str | None = "j", error: str = "") -> dict:
        ended = {"ended_s": 2.0} if status in load.JOB_ENDED else {}
        return {"id": job_id, "status": status, "outputs": {"done": done}, "error": error, **ended}

    every = load.JOB_PROMPTS
    records = [
        record("succeeded", every),
        record("failed", every - 1),  # one output failed, saying why
        record("running", 1, error="poll: 503"),  # never ended within the wait: all its prompts lost
        record(None, job_id=None, error="refused: 429"),  # refused: nothing queued
    ]
    judged = load.judge_jobs(records)
    assert judged["prompts"] == {"sent": 4 * every, "done": 2 * every - 1, "failed": 1, "lost": 2 * every}
    assert judged["statuses"] == {"succeeded": 1, "failed": 1, "running": 1, "refused": 1}
    assert judged["job_s"]["n"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_small_load_loses_nothing(tmp_path: Path) -> None:
    """10 agents, 2 chats, a developer's jobs, 5 s against a whole control plane: every figure there,
    nothing lost."""
    out = tmp_path / "load.json"
    argv = [sys.executable, "-m", "benchmarks.load", "--agents", "10", "--chats", "2", "--duration", "5"]
    run = subprocess.run(
        [*argv, "--jobs", "1", "--chat-tokens", "8", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    setup = figures["setup"]
    assert (setup["agents"], setup["chats"], setup["duration_s"], setup["real_agents"]) == (10, 2, 5.0, 3)
    assert figures["enrollment"]["enrolled"] == 10 and figures["enrollment"]["failed"] == 0
    heartbeat = figures["heartbeat"]
    assert heartbeat["sent"] >= 10 and heartbeat["lost"] == 0 and heartbeat["written"] == heartbeat["sent"]
    assert 0 < heartbeat["ms"]["p50"] <= heartbeat["ms"]["p99"]
    assert figures["nodes"]["wrongly_offline"] == 0 and figures["nodes"]["marked_offline"] == []
    assert figures["links"]["drops"] == 0 and figures["nodes"]["real_agent_link_drops"] == 0
    chat = figures["chat"]
    assert chat["sent"] >= 2 and chat["lost"] == 0 and chat["failed"] == 0 and chat["complete"] == chat["sent"]
    assert chat["tokens"] > 0 and chat["ttft_ms"]["p50"] <= chat["answer_ms"]["p50"]
    assert figures["api"]["requests"] > 0 and figures["api"]["errors"] == 0 and figures["api"]["ms"]["p50"] > 0
    jobs = figures["jobs"]
    assert jobs["sent"] >= 1 and jobs["statuses"] == {"succeeded": jobs["sent"]}, jobs
    assert jobs["prompts"]["done"] == jobs["prompts"]["sent"] == jobs["sent"] * load.JOB_PROMPTS
    assert "| heartbeat: sent → written |" in run.stdout and "| nodes wrongly marked offline | 0 | 0 |" in run.stdout


def test_a_restart_is_asked_for_as_what_and_when_and_refused_otherwise() -> None:
    from benchmarks.restarts import restart_at

    assert restart_at("redis:40") == ("redis", 40.0) and restart_at("postgres:0") == ("postgres", 0.0)
    for wrong, why in [
        ("mongo:4", "not one of redis, postgres"),
        ("redis:soon", "not a number"),
        ("redis:-1", "before"),
    ]:
        with pytest.raises(Exception, match=why):
            restart_at(wrong)
    for argv, why in [
        (["--restart", "redis:4"], "add --production"),
        (["--production", "--duration", "30", "--restart", "redis:30"], "within the 30 s window"),
    ]:
        refused = subprocess.run([sys.executable, "-m", "benchmarks.load", *argv], capture_output=True, text=True)
        assert refused.returncode == 2 and why in refused.stderr, refused.stderr


def test_the_stacks_redis_restarts_in_its_place_with_its_data(tmp_path: Path) -> None:
    """A restart stops Redis cleanly and starts it again as it was: what was written before is there
    after (appendonly, as deploy/redis/odmoe.conf has it), and it is still stopped after the web."""
    from types import SimpleNamespace

    import redis

    from benchmarks.restarts import restarter
    from controlplane.ops.processes import ProcessGroup, python_env
    from deploy.prodcheck import start_redis

    with ProcessGroup(tmp_path / "logs", python_env()) as group:
        url = start_redis(group, tmp_path)
        group.start("after", ["sleep", "60"])  # what the stack starts after Redis (its web servers)
        redis.Redis.from_url(url).set("kept", "yes")
        before = group.children[0].process.pid
        stack = SimpleNamespace(group=group, work=tmp_path, env={"REDIS_URL": url})
        restarter(stack)("redis")  # type: ignore[arg-type]
        assert [c.name for c in group.children] == ["redis", "after"] and group.children[0].process.pid != before
        assert redis.Redis.from_url(url).get("kept") == b"yes"


def test_a_family_restarted_in_the_window_has_no_cpu_figure() -> None:
    """Its processes before the restart took their CPU time with them: a figure would read low or
    below zero (load-production-run9 read -8 % for PostgreSQL)."""
    start, end = {"redis": 3.0, "web": 2.0, "machine": 10.0}, {"redis": 0.5, "web": 4.0, "machine": 20.0}
    figures = load.cpu_figures(start, end, 10.0, restarted=["redis", "postgres"])
    assert figures["percent_of_one_core"] == {"web": 20.0} and figures["restarted_not_measured"] == ["redis"]
