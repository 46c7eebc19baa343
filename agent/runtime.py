"""One runtime role this box runs for a deployment: fetch its shard, start it, watch it, stop it.

``RoleRunner`` holds at most one role process (``python -m inference serve-role``, started by
``agent.spawn``: fresh, or forked from the zygote the agents of one machine share); a box
with several GPUs runs one per GPU (``agent.roles.Roles`` keeps them). It
outlives the websocket: a link that drops and comes back finds the role still running and
reports it in the next heartbeat. Every change of state is sent up as a ``RoleState``
event; a role whose shard fails verification is never started, and a role that exits on
its own is reported ``failed`` with the tail of its log.

The runner pings its role for as long as it runs: every ``WATCH_EVERY_S`` until it is ready,
then every ``MEMORY_EVERY_S`` for its memory (resident host bytes now and at peak, GPU bytes),
which travels in the role state. A change of memory gets a ``RoleState`` of its own only when
it is worth one (``memory_changed``); smaller drifts ride with the next heartbeat.

On the box that runs main, the runner's ``main_work`` (``agent.generations.MainWork``) carries the
control plane's generations to main and applies new alignment periods; an answer whose main exits
mid-way is carried to main once the runner has started it again (``agent.migration``), not failed.

The runner talks to its role with the keys of the role seat's client (``StartRole.client_keys``,
``inference.runtime.curve``): the role admits them, and no other role does. The role's spec file
(``runtime/<deployment>/<shard>.spec.json``, readable by the agent's user only) holds the role's
secret key: it is there while the role runs, and removed when the role stops, fails to start or
fails for good, and when the agent stops; one left by an agent that was killed goes when the
next one starts (``remove_stale_specs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from agent.credentials import NodeCredential
from agent.download import fetch_shard
from agent.generations import MainWork
from agent.http import ControlPlaneError
from agent.spawn import RoleProcess, RoleSpawner
from agent.tls import ServerTrust
from inference.modelio.shards import ShardError, is_plain_file_name, is_role_dirname
from inference.runtime.client import RuntimeClient
from inference.runtime.curve import CurveError, CurveKeys, EndpointKeys, check_endpoint_keys
from inference.runtime.spec import RoleSpec, SpecError, load_spec, write_private
from inference.wire.base import WireStruct
from inference.wire.link import (
    MEMORY_FIGURES,
    RoleState,
    StartRole,
    TaskDone,
    TaskProgress,
)
from inference.wire.runtime import Pong

log = logging.getLogger(__name__)

Send = Callable[[WireStruct], Awaitable[WireStruct | None]]  # returns what it sent, if anything
WATCH_EVERY_S = 0.5
PING_TIMEOUT_S = 0.5  # a role busy with a step may answer late: the next ping asks again
# A ready role is asked for its memory this often: the heartbeat's pace. Not faster: a role
# that waits for a quiet second on its inbox (the shadow ending a request) must get one.
MEMORY_EVERY_S = 5.0
MEMORY_CHANGE_FRACTION = 0.01  # a figure must move by more than this share...
MEMORY_CHANGE_BYTES = 16 * 2**20  # ...and more than this many bytes to be sent at once
STOP_GRACE_S = 5.0
# A role that dies after it was ready is started again (main serves around a lost worker or
# shadow meanwhile), after 1, 2, 4 s; more than this many deaths within the window: failed.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
RESTART_BACKOFF_S = 1.0
LOG_TAIL_LINES = 12
PROGRESS_EVERY_S = 0.5  # how often a download reports its progress


def shard_dir(state_dir: Path, model_id: int, shard: str) -> Path:
    """Where this box keeps shard ``shard`` (main, shadow, worker-N) of model ``model_id``.

    Both come from the control plane: anything but a shard name and a model number is refused,
    so no command can point the agent outside its state directory.
    """
    if type(model_id) is not int or model_id < 0 or not is_role_dirname(shard):
        raise ValueError(f"refused shard {shard!r} of model {model_id!r}: not a shard name and model number")
    return state_dir / "shards" / str(model_id) / shard


async def fetch_with_progress(
    credential: NodeCredential,
    model_id: int,
    shard: str,
    dest: Path,
    *,
    task_id: str,
    send: Send,
    trust: ServerTrust | None = None,
) -> str:
    """Download and verify a shard into ``dest``, reporting TaskProgress and then TaskDone for
    ``task_id``; returns "" when it is there, else the reason it is not. ``trust``: the agent's
    trust in the server (``agent.tls``)."""
    loop = asyncio.get_running_loop()
    last = [0.0]

    def progress(done: int, total: int) -> None:  # runs in the download thread
        now = loop.time()
        if now - last[0] >= PROGRESS_EVERY_S or done >= total:
            last[0] = now
            asyncio.run_coroutine_threadsafe(send(TaskProgress(task_id=task_id, done=done, total=total)), loop)

    try:
        await asyncio.to_thread(fetch_shard, credential, model_id, shard, dest, progress=progress, trust=trust)
    except (ControlPlaneError, ShardError, OSError, ValueError, KeyError) as exc:
        await send(TaskDone(task_id=task_id, ok=False, detail=str(exc)))
        return str(exc)
    await send(TaskDone(task_id=task_id, ok=True, detail=str(dest)))
    return ""


def memory_of(pong: Pong) -> dict[str, int]:
    """The role's memory as ``RoleState.memory`` carries it (``MEMORY_FIGURES``)."""
    return {name: max(0, int(getattr(pong, name))) for name in MEMORY_FIGURES}


def memory_changed(before: dict[str, int], after: dict[str, int]) -> bool:
    """Whether ``after`` deserves a RoleState of its own rather than the next heartbeat.

    The first figures always do; after that, a figure must move by more than 1 % and more
    than 16 MB, so allocator noise of a big role or a few pages of a small one stay quiet.
    """
    if not before:
        return bool(after)
    for name in MEMORY_FIGURES:
        old, new = before.get(name, 0), after.get(name, 0)
        if abs(new - old) > max(MEMORY_CHANGE_BYTES, MEMORY_CHANGE_FRACTION * old):
            return True
    return False


def client_keys_of(command: StartRole, spec: RoleSpec) -> EndpointKeys:
    """The keys this box's client of the role uses: the seat's client pair (``command``) and the
    role's public key (its checked ``spec``); ``CurveError`` if the pair is not a usable one."""
    pair = command.client_keys
    if set(pair) != {"public", "secret"}:
        raise CurveError('the client keys must be an object with exactly "public" and "secret"')
    assert spec.curve is not None  # load_spec refuses a spec without keys
    return check_endpoint_keys(
        EndpointKeys(CurveKeys(pair["public"], pair["secret"]), {spec.name: spec.curve.pair.public})
    )


def remove_stale_specs(state_dir: Path) -> None:
    """Remove the role spec files (each holds a role's secret key) that an agent killed before it
    could clean up left behind; its role processes died with it (``agent.spawn``)."""
    for path in (state_dir / "runtime").glob("*/*.spec.json"):
        with contextlib.suppress(OSError):
            path.unlink()


def role_name_of(spec: dict) -> str:
    """main, shadow or worker-N: which of its deployment's roles a ``StartRole`` spec describes."""
    role = str(spec.get("role", "?"))
    return f"worker-{spec.get('worker')}" if role == "worker" else role


# Shaped like roles.py's Roles.__init__ on purpose: each keeps its own collaborators by name.
class RoleRunner:
    """One role process of one deployment on this box (``agent.roles.Roles`` holds them all)."""

    def __init__(
        self,
        credential: NodeCredential,
        state_dir: Path,
        send: Send,
        trust: ServerTrust | None = None,
        spawner: RoleSpawner | None = None,
    ) -> None:
        self.credential = credential
        self.state_dir = state_dir
        self.send = send  # to the control plane; drops messages while the link is down
        self.trust = trust  # how shard downloads trust the server (None: from the credential's pin)
        self.spawner = spawner or RoleSpawner()  # how its role process starts (default: fresh)
        self.state: RoleState | None = None
        self.command: StartRole | None = None
        self.process: RoleProcess | None = None
        self._work: asyncio.Task | None = None
        self._reported_memory: dict[str, int] = {}  # what the control plane last got
        self.client_keys: EndpointKeys | None = None  # the seat's client keys, once the role's spec was checked
        # Generations, cancels and alignment, when this role is main; it looks at this runner's state
        # as often as the runner looks at its role.
        self.main_work = MainWork(self, poll_s=WATCH_EVERY_S)

    # --- what the heartbeat reports ------------------------------------------------------------

    def snapshot(self) -> dict:
        if self.state is None:
            return {}
        self._reported_memory = self.state.memory
        return self.state.to_json()

    async def set_state(
        self, state: str, detail: str = "", metrics: dict | None = None, memory: dict[str, int] | None = None
    ) -> None:
        assert self.command is not None
        role = self.command.spec.get("role", "?")
        if metrics is None:
            metrics = self.state.metrics if self.state is not None and state == "ready" else {}
        if memory is None:  # a live process keeps its figures; a stopped or failed one has none
            memory = self.state.memory if self.state is not None and state in ("starting", "ready") else {}
        same = self.state is not None and (self.state.state, self.state.detail) == (state, detail)
        self.state = RoleState(
            deployment=self.command.deployment,
            role=str(role),
            role_name=role_name_of(self.command.spec),
            state=state,
            detail=detail,
            metrics=metrics,
            memory=memory,
        )
        log.log(
            logging.DEBUG if same else logging.INFO,
            "role %s of %s: %s %s",
            role,
            self.command.deployment,
            state,
            detail,
        )
        self._reported_memory = memory
        await self.send(self.state)

    # --- start and stop ------------------------------------------------------------------------

    async def start(self, command: StartRole) -> None:
        """Fetch the shard and start the role; a repeat of the current command is ignored."""
        if (
            self.command is not None
            and self.command.deployment == command.deployment
            and self.state is not None
            and self.state.state in ("fetching", "starting", "ready")
        ):
            return
        await self.stop()
        self.command, self.client_keys = command, None
        self._work = asyncio.create_task(self._run(command))

    async def stop(self, deployment: str | None = None) -> None:
        """Stop the role (only if it belongs to ``deployment``, when given)."""
        if self.command is None or (deployment is not None and self.command.deployment != deployment):
            return
        if self._work is not None:
            self._work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._work
            self._work = None
        await self._terminate()
        await self.set_state("stopped")

    async def close(self) -> None:
        """The agent is stopping: so does its role (and the role process with it)."""
        if self._work is not None:
            self._work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._work
        await self._terminate()

    async def _terminate(self) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=STOP_GRACE_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def _run(self, command: StartRole) -> None:
        spec_path: Path | None = None
        try:
            dest = await self._fetch(command)
            if dest is None:
                return
            spec_path = self._run_dir(command) / f"{command.shard}.spec.json"
            write_private(spec_path, json.dumps({**command.spec, "shard_dir": str(dest)}, indent=2))
            try:
                spec = load_spec(spec_path)  # the runtime checks it again; a bad spec is reported here, clearly
                self.client_keys = client_keys_of(command, spec)
            except SpecError as exc:
                await self.set_state("failed", f"bad role spec: {exc}")
                return
            except CurveError as exc:
                await self.set_state("failed", f"bad client keys: {exc}")
                return
            await self.set_state("starting", "waiting for the role to answer")
            await self._spawn(command, spec_path)
            await self._watch(command, spec, spec_path)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must show up as a failed role, not a silent agent
            log.exception("role of %s failed", command.deployment)
            await self.set_state("failed", f"agent error: {exc}")
        finally:
            # Stopped, failed to start or failed for good, or the agent is stopping: the role's
            # secret key leaves the disk (the process read it when it started).
            if spec_path is not None:
                with contextlib.suppress(OSError):
                    spec_path.unlink(missing_ok=True)

    async def _fetch(self, command: StartRole) -> Path | None:
        await self.set_state("fetching", f"shard {command.shard}")
        try:
            dest = shard_dir(self.state_dir, command.model_id, command.shard)
        except ValueError as exc:
            await self.set_state("failed", str(exc))
            return None
        # Alike link.py's fetch command by domain, on purpose: a role start reports its own way.
        reason = await fetch_with_progress(
            self.credential,
            command.model_id,
            command.shard,
            dest,
            task_id=command.task_id,
            send=self.send,
            trust=self.trust,
        )
        if reason:
            await self.set_state("failed", f"shard {command.shard}: {reason}")
            return None
        return dest

    def _run_dir(self, command: StartRole) -> Path:
        if not is_plain_file_name(command.deployment):  # a name from the server: never a path
            raise ValueError(f"refused deployment name {command.deployment!r}")
        path = self.state_dir / "runtime" / command.deployment
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def _spawn(self, command: StartRole, spec_path: Path) -> None:
        log_path = self._run_dir(command) / f"{command.shard}.log"
        self.process = await self.spawner.start(str(command.spec["role"]), spec_path, log_path)

    async def _watch(self, command: StartRole, spec: RoleSpec, spec_path: Path) -> None:
        """Ping the role while its process lives: for its readiness, then (less often) for its memory."""
        assert self.client_keys is not None
        probe = RuntimeClient(
            spec.bind_address,
            spec.deployment,
            role=spec.name,
            name=f"agent-probe-{command.shard}",
            curve=self.client_keys,
        )
        ping: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        asked = -MEMORY_EVERY_S
        restarts: list[float] = []  # when the role was started again, on the loop's clock
        was_ready = False
        try:
            while True:
                proc = self.process
                if proc is None or proc.returncode is not None:
                    code = proc.returncode if proc is not None else "?"
                    exited = f"the role process exited with code {code}"
                    restarts = [t for t in restarts if loop.time() - t < RESTART_WINDOW_S]
                    if not was_ready or len(restarts) >= MAX_RESTARTS:
                        await self.set_state("failed", f"{exited}:\n{self._log_tail(command)}")
                        return
                    delay = RESTART_BACKOFF_S * 2 ** len(restarts)
                    window = f"{RESTART_WINDOW_S / 60:.0f} min"
                    attempt = f"restart {len(restarts) + 1} of at most {MAX_RESTARTS} in {window}"
                    log.warning("%s of %s: %s; again in %.0f s", command.shard, command.deployment, exited, delay)
                    await self.set_state("starting", f"{exited}; starting it again ({attempt})", memory={})
                    await asyncio.sleep(delay)
                    restarts.append(loop.time())
                    was_ready = False
                    await self._spawn(command, spec_path)
                    continue
                ready = self.state is not None and self.state.state == "ready"
                was_ready = was_ready or ready
                if not ready or loop.time() - asked >= MEMORY_EVERY_S:
                    asked = loop.time()
                    ping = asyncio.ensure_future(
                        asyncio.to_thread(probe.ping, PING_TIMEOUT_S)
                    )  # blocking: off the loop
                    pong = await asyncio.shield(ping)
                    if pong is not None:
                        await self._heard(pong)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), timeout=WATCH_EVERY_S)
        finally:
            if ping is not None and not ping.done():  # stopped mid-ping: the socket is not ours to close yet
                with contextlib.suppress(Exception):
                    await ping
            probe.close()

    async def _heard(self, pong: Pong) -> None:
        """Act on the role's health answer: its readiness, and its memory."""
        current = self.state
        if current is None or current.state not in ("starting", "ready"):
            return
        memory = memory_of(pong)
        if current.state == "starting" and pong.ready:
            await self.set_state("ready", memory=memory)
        elif current.state == "starting" and pong.detail and pong.detail != current.detail:
            await self.set_state("starting", pong.detail, memory=memory)
        elif memory_changed(self._reported_memory, memory):
            await self.set_state(current.state, current.detail, memory=memory)
        else:  # kept for the next heartbeat
            self.state = msgspec.structs.replace(current, memory=memory)

    def _log_tail(self, command: StartRole) -> str:
        path = self._run_dir(command) / f"{command.shard}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        return "(no log)"
