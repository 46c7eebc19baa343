"""Main's work on the box that runs it: the control plane's generations, their cancels, alignment.

``MainWork`` belongs to one ``RoleRunner`` (``agent.runtime``) and acts only while that runner's
role is a ready main. It carries the control plane's generations to main (``RuntimeClient``), all at
once (main batches them), each streamed in a thread of its own, and applies new alignment periods.
An answer whose main exits mid-way is carried to main once the runner has started it again
(``agent.migration``), not failed; a cancel reaches main, or ends an answer waiting for main with
what was sent. A generation's result travels up the link with its per-step metrics cut to what the
link carries (``bounded_metrics``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec

from agent.migration import EXACT, PREFILL, Carried, ReplayDiverged, seeded
from agent.spawn import RoleProcess
from inference.runtime.client import GenerationError, RuntimeClient
from inference.runtime.curve import EndpointKeys
from inference.wire.base import WireStruct
from inference.wire.generation import Done, Failed, Generate
from inference.wire.link import RUNTIME_METRICS, ApplyAlignment, CancelGeneration, RoleState, StartRole

log = logging.getLogger(__name__)

# Generations one main streams at once: main's batch and its queue (DeploymentSettings.max_batch,
# max_waiting) say how many it takes; beyond them it answers "full" at once.
MAX_STREAMS = 128
HANDOVER_MS = 2000  # how long a one-message client may take to hand its message to main
# The most a generation's metrics may take as JSON on the link. The control plane closes a frame
# past its cap (ODMOE_MAX_REQUEST_BYTES, 16 MiB by default) with 1009, and the per-step record
# grows with layers x tokens: about 450 bytes a layer, so a 2,048-token answer of a 32-layer
# model is about 29 MB. Steps past this budget are left out of it, and counted.
MAX_METRICS_BYTES = 4 * 2**20


def bounded_metrics(metrics: dict, max_bytes: int = MAX_METRICS_BYTES) -> dict:
    """``metrics`` as a generation's result carries them up the link: whole when they fit in
    ``max_bytes`` as JSON, else with the per-step record (``per_step``, the only part that grows
    with the answer) cut to the first steps that fit, and ``per_step_omitted`` saying how many
    steps were left out. The summary figures are never cut."""
    steps = metrics.get("per_step")
    if not isinstance(steps, list) or len(json.dumps(metrics)) <= max_bytes:
        return metrics
    summary = {key: value for key, value in metrics.items() if key != "per_step"}
    budget = max_bytes - len(json.dumps({**summary, "per_step": [], "per_step_omitted": len(steps)}))
    kept: list = []
    for step in steps:
        size = len(json.dumps(step)) + 2  # the step and the separator before the next one
        if size > budget:
            break
        budget -= size
        kept.append(step)
    return {**summary, "per_step": kept, "per_step_omitted": len(steps) - len(kept)}


MAIN_EXITED = object()  # what ``_stream`` returns when main's process exited mid-answer
MAIN_BACK_S = 45.0  # how long an answer waits for main to be started again and ready: within the caller's 60 s


class MainExited(RuntimeError):
    """Main's process died while a generation waited on it."""


class Runner(Protocol):
    """What ``MainWork`` reads of the role runner it belongs to (``agent.runtime.RoleRunner``), named
    here so the runner's module imports this one and not the other way round."""

    command: StartRole | None
    state: RoleState | None
    process: RoleProcess | None
    client_keys: EndpointKeys | None

    async def send(self, message: WireStruct) -> WireStruct | None: ...

    async def set_state(
        self, state: str, detail: str = "", metrics: dict | None = None, memory: dict[str, int] | None = None
    ) -> None: ...


class MainWork:
    """What the control plane asks of main, carried out on ``runner``'s role while it is a ready main."""

    def __init__(self, runner: Runner, *, poll_s: float) -> None:
        self.runner = runner  # its command, state, process and client keys are main's, when it runs main
        self.poll_s = poll_s  # how often an answer waiting for main looks at the runner's state again
        # Generations run at once (main batches them); each streams in a thread of its own.
        self._streams = ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="generation")
        self._cancelled: set[str] = set()
        self._running_generations: set[str] = set()

    def _main_client(self, deployment: str) -> RuntimeClient | None:
        command, state, keys = self.runner.command, self.runner.state, self.runner.client_keys
        if command is None or command.deployment != deployment or command.spec.get("role") != "main":
            return None
        if state is None or state.state != "ready" or keys is None:
            return None
        return RuntimeClient(command.spec["addresses"]["main"], deployment, curve=keys)

    async def apply_alignment(self, command: ApplyAlignment) -> None:
        client = self._main_client(command.deployment)
        if client is None:
            log.warning("alignment for %s ignored: this box does not run its main", command.deployment)
            return
        try:
            client.set_alignment(command.token_period, command.kv_period)
        finally:
            await asyncio.to_thread(client.close, HANDOVER_MS)

    async def generate(self, command: Generate) -> None:
        """Run one generation on main, beside any others (main batches them); events go to the control
        plane. If main's process exits mid-answer, the answer is carried to main once it is back
        (``agent.migration``): the caller sees a pause, then the rest. Whatever goes wrong here, the
        caller hears so (a retryable ``Failed``), never silence."""
        try:
            await self._generate(command)
        except Exception as exc:  # a bug must not leave the caller waiting out its timeout
            log.exception("generation %s failed in the agent", command.request_id)
            await self.runner.send(Failed(request_id=command.request_id, error=f"agent error: {exc}", retryable=True))
        finally:
            self._cancelled.discard(command.request_id)

    async def _generate(self, command: Generate) -> None:
        if command.request_id in self._cancelled:
            done = Done(request_id=command.request_id, token_ids=[], finish_reason="cancelled", metrics={})
            await self.runner.send(done)
            return
        carried = Carried(seeded(command), **self._carrying())
        request: Generate | str = carried.request
        role = self.runner.command  # the role this answer runs on: a restart of it, not another start
        while True:
            client, proc = self._main_client(command.deployment), self.runner.process
            if client is None or proc is None:
                error = f"this box does not run a ready main for deployment {command.deployment}"
                await self.runner.send(
                    carried.failed(error) if carried.resumed_at else Failed(request_id=command.request_id, error=error)
                )
                return
            self._running_generations.add(command.request_id)
            loop = asyncio.get_running_loop()
            try:
                metrics = await loop.run_in_executor(self._streams, self._stream, client, proc, request, carried, loop)
            finally:
                self._running_generations.discard(command.request_id)
                client.close()
            if metrics is not MAIN_EXITED:
                break
            if carried.spent:
                await self.runner.send(carried.finished())
                return
            request = carried.continuation()
            if isinstance(request, str):
                await self.runner.send(carried.failed(request))
                return
            log.warning(
                "main exited mid-answer %s after %d tokens: carried to main once it is back",
                command.request_id,
                len(carried.sent),
            )
            back = await self._main_back(role, command.request_id)
            if command.request_id in self._cancelled:  # cancelled while main was down: it ends with what was sent
                await self.runner.send(msgspec.structs.replace(carried.finished(), finish_reason="cancelled"))
                return
            if not back:
                await self.runner.send(
                    carried.failed(f"main's process exited mid-answer and was not back within {MAIN_BACK_S:.0f} s")
                )
                return
        if metrics is not None and self.runner.state is not None and self.runner.state.state == "ready":
            await self.runner.set_state("ready", metrics={k: metrics.get(k) for k in RUNTIME_METRICS})

    def _carrying(self) -> dict:
        """How an answer is carried across main's restart: the deployment's settings for it (``Carried``)."""
        settings = self.runner.command.spec.get("settings", {}) if self.runner.command is not None else {}
        settings = settings if isinstance(settings, dict) else {}
        mode = settings.get("replay", PREFILL)
        limits = {name: settings.get(name) for name in ("max_migrations", "max_replay_tokens")}
        return {
            "mode": mode if mode in (PREFILL, EXACT) else PREFILL,
            **{name: value for name, value in limits.items() if type(value) is int and value >= 0},
        }

    async def _main_back(self, role: StartRole | None, request_id: str) -> bool:
        """Wait for this box's agent to have started main again for ``role`` and heard it ready (False:
        it was not, in time; the role was stopped, failed or replaced meanwhile; or ``request_id`` was
        cancelled)."""
        deadline = asyncio.get_running_loop().time() + MAIN_BACK_S
        while asyncio.get_running_loop().time() < deadline:
            proc, state = self.runner.process, self.runner.state
            if request_id in self._cancelled:
                return False
            if self.runner.command is not role or state is None or state.state not in ("starting", "ready"):
                return False
            if state.state == "ready" and proc is not None and proc.returncode is None:
                return True
            await asyncio.sleep(self.poll_s)
        return False

    def _stream(
        self,
        client: RuntimeClient,
        proc: RoleProcess,
        request: Generate,
        carried: Carried,
        loop: asyncio.AbstractEventLoop,
    ) -> dict | object | None:
        """Relay one request's events, as the whole answer's; returns its metrics when it finished,
        ``MAIN_EXITED`` when main's process ``proc`` (the one the request went to) exited first."""

        def post(message: WireStruct) -> WireStruct | None:
            # No timeout: a generation's event is kept, not lost, however long the link takes to take it.
            return asyncio.run_coroutine_threadsafe(self.runner.send(message), loop).result()

        def alive() -> None:
            """Runs while the request waits on main: a main that exited (or was replaced) ends the wait."""
            if proc.returncode is not None or self.runner.process is not proc:
                raise MainExited("main's process exited mid-answer")

        try:
            # The events go up as main sent them; only a result's figures are cut to what the link carries.
            for received in client.stream_request(request, timeout_s=600.0, idle=alive):
                event = carried.renumbered(received)
                if event is None:  # replayed: the caller had it
                    continue
                if isinstance(event, Done):
                    post(msgspec.structs.replace(event, metrics=bounded_metrics(event.metrics)))
                    return event.metrics
                if isinstance(post(event), Failed):  # a token too large for the link: its generation failed there
                    client.cancel(request.request_id)
                    return None
        except MainExited:
            return MAIN_EXITED
        except ReplayDiverged as exc:
            client.cancel(request.request_id)
            post(carried.failed(str(exc)))
        except GenerationError as exc:
            refused = {"busy": exc.busy, "too_many_generations": exc.too_many_generations}
            post(Failed(request_id=request.request_id, error=str(exc), **refused))
        return None

    async def cancel(self, command: CancelGeneration) -> None:
        if len(self._cancelled) > 1000:
            self._cancelled.clear()
        # Noted whether or not main runs it now: a queued one ends before it starts, one whose main is
        # being started again ends with what was sent (the main this cancel reaches may be gone).
        self._cancelled.add(command.request_id)
        if command.request_id not in self._running_generations:
            return
        role, keys = self.runner.command, self.runner.client_keys
        if role is None or keys is None:
            return
        client = RuntimeClient(role.spec["addresses"]["main"], role.deployment, curve=keys)
        try:
            client.cancel(command.request_id)
        finally:
            await asyncio.to_thread(client.close, HANDOVER_MS)
