"""The chat page in a real browser (Debian's headless Chromium driven by Playwright) against a live cluster.

Log in, send a message and watch the answer arrive token by token, compare it with the
API's greedy answer, reload and find the history, stop a long answer mid-way. Screenshots
go to ``artifacts/screenshots/`` (``ODMOE_SCREENSHOTS`` overrides), kept by CI.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import inference
from tests.controlplane.conftest import tiny_cluster
from tests.controlplane.live import SERVED_MODEL, Served, purge_stale_tasks
from tests.paths import REPO

pytestmark = pytest.mark.slow
SHOTS = Path(os.environ.get("ODMOE_SCREENSHOTS", REPO / "artifacts" / "screenshots"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
PASSWORD = "a-long-test-password"


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.fail("browser tests need Chromium: apt install chromium chromium-driver (make test does)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def served(transactional_db, redis_url: str, tmp_path: Path, tiny_model: Path) -> Iterator[Served]:
    """The conftest's ``served``, drafting: the shadow drafts 2 tokens a pass, which the console shows."""
    purge_stale_tasks()
    with tiny_cluster(tmp_path, tiny_model, redis_url, draft_tokens=2) as (served, _):
        yield served


@pytest.fixture
def passwords(served: Served) -> None:
    """Before the browser starts: Playwright's event loop forbids the ORM in the test's thread."""
    from django.contrib.auth import get_user_model

    for name in ("alice", "staff"):
        user = get_user_model().objects.get(username=name)
        user.set_password(PASSWORD)
        user.save()


def log_in(page, served: Served, username: str) -> None:
    page.goto(f"{served.plane.server}/accounts/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/chat/")


def test_the_console_and_the_chat_in_the_browser(served: Served, redis_url: str, passwords, browser) -> None:
    """One cluster for both pages (a cluster takes 10 to 30 s to start and stop): the console's checks,
    which leave every node as they found it, then the chat's, as another user, then the pause the
    chat's web server restart made, in the console."""
    check_the_console_shows_the_cluster_live_and_makes_a_join_token(served, browser)
    check_chat_in_the_browser_streams_keeps_history_and_stops(served, redis_url, browser)
    check_the_console_lists_the_pause_the_restart_made(served, browser)


def check_the_console_shows_the_cluster_live_and_makes_a_join_token(served: Served, browser) -> None:
    page = browser.new_page()
    page.set_default_timeout(60_000)
    log_in(page, served, "staff")
    page.click("text=Console")
    page.wait_for_selector("#live:has-text('live')")
    page.wait_for_selector("tr[data-node] >> nth=2")  # three nodes, from the websocket
    assert page.locator("tr[data-node]").count() == 3
    # Each agent's version, the server's own: no upgrade offered; no doctor failure under a name.
    page.wait_for_selector(f"tr[data-node] td:has-text('{inference.__version__}') >> nth=2")
    assert page.locator("tr[data-node] [data-upgrade]").count() == 0
    assert page.locator("tr[data-node] [data-problem]").count() == 0
    assert page.locator(f"[data-deployment='{SERVED_MODEL}'] h3 .badge.ready").count() == 1
    page.fill("#token-form input[name=max_uses]", "2")
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#token-result:not([hidden])")
    command = page.inner_text("#install-command")
    # The token in sh's environment, not on its command line; plain http, as on loopback, with no warning.
    assert command.startswith(f"curl -fsSL {served.plane.server}/agent/install.sh | ODMOE_JOIN_TOKEN=odmoe-join-")
    assert command.endswith(f" sh -s -- --server {served.plane.server}")
    assert page.locator("#token-warning").is_hidden()
    page.screenshot(path=SHOTS / "console-enroll.png", full_page=True)
    # The deployment form estimates a plan's speed with the simulator before anything deploys.
    page.wait_for_selector("#profile-select option[value='3090-pcie4-1gbe']", state="attached")
    page.click("#estimate")
    page.wait_for_selector("#estimate-line")
    estimate = page.inner_text("#estimate-line")
    assert (
        "Simulated on 3090-pcie4-1gbe" in estimate and "(odmoe, int8 shadow" in estimate and "tok/s decode" in estimate
    )
    memory = page.inner_text("#estimate-memory")  # memory per role, from the tiny checkpoint's tensors
    assert "main" in memory and "shadow (int8)" in memory and "each worker" in memory and "MB" in memory
    # A strategy without a predictor has no shadow seat: no shadow in the estimate, one more worker.
    page.select_option("#deployment-form select[name=strategy]", "full-cache")
    page.click("#estimate")
    page.wait_for_selector("#estimate-line:has-text('full-cache')")
    estimate = page.inner_text("#estimate-line")
    assert "(full-cache, no shadow: no predictor)" in estimate and "tok/s decode" in estimate
    memory = page.inner_text("#estimate-memory")
    assert "main" in memory and "shadow" not in memory and "each worker" in memory
    # A generation shows in the live pipeline: one row per layer, with its group and experts.
    served.client().completions.create(model=SERVED_MODEL, prompt="Mixture of experts", max_tokens=16, temperature=0)
    page.wait_for_selector("#pipeline-rows tr[data-layer='3']")
    assert "group 0" in page.inner_text("#pipeline-rows")
    page.wait_for_selector("#live-step:has-text('drafts kept')")  # a drafted pass: its positions, drafts kept
    page.wait_for_selector("#cluster-view:has-text('last generation')")
    page.wait_for_selector("#cluster-view:has-text('tokens per decode pass')")
    page.screenshot(path=SHOTS / "console-cluster.png", full_page=True)
    # A node drained from the console shows as draining without a reload.
    page.locator("tr[data-node] button").first.click()
    page.wait_for_selector("tr[data-node] .badge.draining")
    page.locator("tr[data-node] button").first.click()
    page.wait_for_selector("tr[data-node] .badge.draining", state="detached")


def check_chat_in_the_browser_streams_keeps_history_and_stops(served: Served, redis_url: str, browser) -> None:
    page = browser.new_page()
    page.set_default_timeout(60_000)
    log_in(page, served, "alice")
    page.screenshot(path=SHOTS / "chat-empty.png")

    question = "Which experts does this token need?"
    page.fill("#prompt", question)
    # Count how often the answer's text changes while it is written: tokens arrive one by one.
    page.evaluate("""() => {
        window.__changes = 0;
        new MutationObserver(() => { window.__changes += 1; })
            .observe(document.getElementById('messages'), {subtree: true, characterData: true, childList: true});
    }""")
    page.click("#send")
    page.wait_for_selector("li.message.assistant.complete")
    answer = page.inner_text("li.message.assistant.complete .content")
    changes = page.evaluate("window.__changes")
    page.screenshot(path=SHOTS / "chat-answered.png")
    api = served.client().chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": question}], max_tokens=128, temperature=0
    )
    assert answer == api.choices[0].message.content.strip() or answer == api.choices[0].message.content
    assert changes > 5
    assert "tok/s" in page.inner_text("li.message.assistant.complete .figures")

    page.reload()
    assert page.inner_text("li.message.user .content") == question
    assert page.inner_text("li.message.assistant .content") in (answer, api.choices[0].message.content)

    page.fill("#prompt", "Tell me more, at length")
    page.wait_for_selector("#send:enabled")  # the reloaded page's socket is open: Send waits for it
    page.evaluate("document.getElementById('send').click()")
    page.wait_for_function("document.querySelectorAll('li.message.assistant')[1].innerText.length > 3")
    page.click("#stop")
    page.wait_for_selector("li.message.assistant.stopped")
    page.screenshot(path=SHOTS / "chat-stopped.png")
    assert "stopped" in page.inner_text("li.message.assistant.stopped .figures")
    # The cluster is free: the API answers at once.
    quick = served.client().chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert quick.choices[0].finish_reason == "length"

    # The web server killed mid-answer and started again: the page reconnects and shows the whole
    # answer. The answer's writer died with the server; the page, following the answer again, takes
    # the writing over and has main go on from the tokens already written (chat.writer).
    page.fill("#prompt", "And then?")
    page.wait_for_selector("#send:enabled")
    page.evaluate("document.getElementById('send').click()")
    page.wait_for_function("document.querySelectorAll('li.message.assistant')[2].innerText.length > 0", polling=20)
    asgi = next(child for child in served.plane.group.children if child.name == "asgi")
    served.plane.group.stop(asgi, kill=True)
    before = page.inner_text("li.message.assistant >> nth=2")
    answer = int(page.get_attribute("li.message.assistant >> nth=2", "data-id"))
    served.plane.start_server()
    page.wait_for_selector("li.message.assistant.complete >> nth=1", timeout=120_000)
    page.screenshot(path=SHOTS / "chat-resumed.png")
    shown = page.inner_text("li.message.assistant.complete >> nth=1 >> .content")
    assert "carried across a server restart" in page.inner_text("li.message.assistant.complete >> nth=1 >> .figures")
    check_the_answer_went_on_from_where_it_was(served, redis_url, answer, before, shown)


def check_the_console_lists_the_pause_the_restart_made(served: Served, browser) -> None:
    """The chat answer taken over after the web server's restart is in the console's *Pauses*: its
    cause, its deployment and how it went on, with a pause of some milliseconds."""
    page = browser.new_page()
    page.set_default_timeout(60_000)
    log_in(page, served, "staff")
    page.click("text=Console")
    row = page.wait_for_selector("#pause-rows tr[data-cause='web_restart']")
    cells = [cell.inner_text() for cell in row.query_selector_all("td")]
    assert cells[1:3] == [SERVED_MODEL, "the chat's web process stopped"] and cells[5] == "prefill from the tape"
    assert int(cells[3]) >= 0 and int(cells[4]) > 0, cells  # at token, pause (ms)
    page.screenshot(path=SHOTS / "console-pauses.png", full_page=True)


def check_the_answer_went_on_from_where_it_was(
    served: Served, redis_url: str, answer: int, before: str, shown: str
) -> None:
    """The page shows the answer as saved, begun with what it showed before the restart; its tokens are
    Transformers' up to where the writing was taken over, then Transformers' going on from them."""
    from django.test import override_settings

    from controlplane.chat import tape
    from controlplane.chat.models import Message
    from tests.reference import reference_generate

    def saved() -> Message:  # off Playwright's thread, where the ORM is not allowed
        return Message.objects.get(pk=answer)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        message = pool.submit(saved).result()
    assert message.status == "complete" and shown == message.content and shown.startswith(before.strip())
    with override_settings(REDIS_URL=redis_url):  # the cluster's, where its web server keeps the tape
        meta, ids = tape.read_meta(answer), tape.token_ids(tape.pieces(answer))
    (resumed_at,) = meta.resumed_at
    assert 0 <= resumed_at < len(ids) <= meta.max_tokens, (resumed_at, len(ids))
    assert ids[:resumed_at] == reference_generate(served.model_dir, meta.prompt_ids, resumed_at)
    rest = reference_generate(served.model_dir, meta.prompt_ids + ids[:resumed_at], len(ids) - resumed_at)
    assert ids[resumed_at:] == rest
