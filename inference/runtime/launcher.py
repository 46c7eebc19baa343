"""Run a whole OD-MoE cluster on this machine: main, shadow and N workers on 127.0.0.1.

``LocalCluster`` builds the role shards, writes one spec per role, starts each role as
its own OS process (``python -m inference serve-role``), or with ``in_process`` as a thread of
this one (``inference.runtime.in_process``: the same sockets and keys, one torch import), waits
until main reports every peer ready, and then talks to main as a client. Every wait is
bounded, a role that dies is reported with the tail of its log, and closing the cluster (also
on Ctrl-C) stops every role it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inference.building.sharding import build_shards
from inference.modelio.checkpoint import Checkpoint
from inference.modelio.shards import ShardSet, shadow_dtypes_to_build
from inference.policies.strategies import predictor_for
from inference.runtime.client import GenerationError, RuntimeClient
from inference.runtime.curve import EndpointKeys, SeatKeys, client_keys, new_seat_keys, role_keys
from inference.runtime.spec import Addresses, DeploymentSettings, RoleSpec, write_private
from inference.wire.generation import Done

if TYPE_CHECKING:
    # Imported where a cluster runs its roles in threads: the roles' whole stack (Transformers
    # included, ~2 s of CPU here) is not loaded by what only needs ``free_port`` or
    # ``die_with_parent`` from this module: every agent, ``manage.py up``, the production check.
    from inference.runtime.in_process import ClusterLog, RoleThread
    from inference.runtime.zygote import ForkedRole

BIND_ATTEMPTS = 3
SPAWN_ENV = "ODMOE_ROLE_SPAWN"
SPAWNS = ("exec", "fork")


class ClusterError(RuntimeError):
    """The local cluster could not start or a generation failed; the message says why."""


@dataclass(frozen=True)
class ClusterOptions:
    workers: int = 8
    shadow: bool = True  # without a shadow, workers load reactively (no prediction)
    settings: DeploymentSettings = field(default_factory=DeploymentSettings)
    startup_timeout_s: float = 180.0
    # The roles as threads of this process (``inference.runtime.in_process``), for tests of what
    # a cluster computes; a role that must be killed, frozen or measured on its own needs a process.
    in_process: bool = False
    # How a role's process starts: "exec", a fresh ``python -m inference serve-role``; or "fork",
    # forked from a zygote that imported the role's code once (``inference.runtime.zygote``: seconds
    # of CPU less a role; its memory is not a fresh process's). Default: ODMOE_ROLE_SPAWN, else exec.
    spawn: str = field(default_factory=lambda: os.environ.get(SPAWN_ENV, "exec"))

    def __post_init__(self) -> None:
        if self.spawn not in SPAWNS:
            raise ValueError(f"spawn must be one of {', '.join(SPAWNS)}, got {self.spawn!r}")

    @property
    def runs_shadow(self) -> bool:
        """A shadow process only where it is wanted and the strategy uses its predictions."""
        return self.shadow and predictor_for(self.settings.strategy, self.settings.predictor) == "shadow"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


PORT_RANGE_ENV = "ODMOE_PORT_RANGE"


def port_range() -> tuple[int, int]:
    """Where ``free_port`` picks, both ends included: ``ODMOE_PORT_RANGE`` (``LOW-HIGH``) if set, else
    the 12000 ports below the kernel's ephemeral range. The test suite's parallel workers each set a
    slice of their own (``tests/conftest.py``), which every process they start inherits: two workers
    never pick the same port between one's probe and its bind."""
    given = os.environ.get(PORT_RANGE_ENV, "").strip()
    if given:
        try:
            low, high = (int(end) for end in given.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_RANGE_ENV}={given!r}: give LOW-HIGH, e.g. 20000-25999") from None
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"{PORT_RANGE_ENV}={given!r}: ports between 1024 and 65535, LOW first")
        return low, high
    low, _ = _ephemeral_range()
    top = max(low - 1, 2048)
    return max(1024, top - 12000), top


# Ports ``free_port`` has handed out in this process: a caller often picks several before binding any
# (a cluster's roles, a server and its Redis), and a probe that was free a moment ago is free again.
_HANDED_OUT: set[int] = set()
# Held while a port is picked: callers on several threads at once (the load benchmark enrolls its
# agents from a pool, each collecting an inventory of free ports) neither read the set while another
# changes it nor both take the same port.
_PICKING = threading.Lock()


def free_port() -> int:
    """A port free to listen on, chosen below the kernel's ephemeral range (or in ``port_range``'s),
    and not one this process has handed out before (until half the range has been).

    A port picked from the ephemeral range (what binding port 0 gives) can be taken by any
    outgoing connection between the pick and the role's own bind; below that range only
    another listener can take it. Safe to call from several threads at once.
    """
    with _PICKING:
        return _pick_port(*port_range())


def _pick_port(low: int, high: int) -> int:
    """``free_port``'s pick in ``low``..``high``, under ``_PICKING``."""
    handed_here = {port for port in _HANDED_OUT if low <= port <= high}
    if len(handed_here) > (high - low + 1) // 2:
        _HANDED_OUT.difference_update(handed_here)
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Children get SIGTERM if the launcher dies, so no role outlives its cluster."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalCluster:
    def __init__(
        self,
        model_dir: str | Path,
        options: ClusterOptions | None = None,
        *,
        work_dir: str | Path | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.options = options = options or ClusterOptions()
        if options.workers < 1:
            raise ClusterError(f"at least one worker is needed, got {options.workers}")
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="odmoe-"))
        self.progress = progress or (lambda line: None)
        self.deployment = f"local-{uuid.uuid4().hex[:8]}"
        # Ephemeral data-plane keys, a role pair and a client pair per seat (``inference.runtime.curve``),
        # made when the cluster starts: only this cluster's roles and clients hold them.
        self.keys: dict[str, SeatKeys] = {}
        self.processes: dict[str, subprocess.Popen | ForkedRole] = {}
        self.threads: dict[str, RoleThread] = {}
        self._thread_log: ClusterLog | None = None
        self.client: RuntimeClient | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        for attempt in range(BIND_ATTEMPTS):
            try:
                self.start()
                return self
            except ClusterError as exc:
                self.close(keep_work_dir=True, dump_stacks=True)
                # Another program took a port between our pick and the role's bind: pick again.
                if "Address already in use" not in str(exc) or attempt == BIND_ATTEMPTS - 1:
                    self.close()
                    raise
            except BaseException:
                self.close(dump_stacks=True)
                raise
        raise AssertionError("unreachable")

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(dump_stacks=exc_type is not None)

    def start(self) -> None:
        checkpoint = Checkpoint(self.model_dir)  # a bad model dir fails here, clearly
        shard_dir = self.work_dir / "shards"
        shadow_dtype = self.options.settings.shadow_dtype
        # A shadow in another dtype than the checkpoint's gets its shard converted by the shard
        # build, as a deployment's does (a reused work_dir without that shard: converted at load).
        preconvert = shadow_dtypes_to_build(checkpoint.config, shadow_dtype) if self.options.runs_shadow else ()
        codec = self.options.settings.expert_codec
        # A reused work_dir's shards are rebuilt when they store the experts otherwise than asked.
        if not (shard_dir / "shards.json").exists() or ShardSet.load(shard_dir).expert_codec != codec:
            self.progress(f"building shards for {self.options.workers} workers in {shard_dir}")
            build_shards(
                checkpoint.path, shard_dir, workers=self.options.workers, shadow_dtypes=preconvert, expert_codec=codec
            )
        self.shard_dir = shard_dir
        shadow_dir = ShardSet.load(shard_dir).shadow_for(shadow_dtype)
        addresses = Addresses(
            main=f"tcp://127.0.0.1:{free_port()}",
            workers=[f"tcp://127.0.0.1:{free_port()}" for _ in range(self.options.workers)],
            shadow=f"tcp://127.0.0.1:{free_port()}" if self.options.runs_shadow else None,
        )
        self.addresses = addresses
        roles: list[tuple[str, str, int | None, Path]] = [("main", "main", None, shard_dir / "main")]
        if self.options.runs_shadow:
            roles.append(("shadow", "shadow", None, shadow_dir))
        roles += [(f"worker-{i}", "worker", i, shard_dir / f"worker-{i}") for i in range(self.options.workers)]
        self.keys = new_seat_keys(name for name, *_ in roles)
        if self.options.in_process:
            from inference.runtime.in_process import ClusterLog, RoleThread

            if self._thread_log is None:
                self._thread_log = ClusterLog(self.work_dir / "roles.log")
        for name, role, worker, role_dir in roles:
            keys = role_keys(name, self.keys)
            spec = RoleSpec(self.deployment, role, str(role_dir), addresses, worker, self.options.settings, curve=keys)
            spec_path = self.work_dir / f"{name}.spec.json"
            write_private(spec_path, spec.to_json())
            if self.options.in_process:
                self.threads[name] = RoleThread(name, spec)
                self.threads[name].start()
            else:
                self._spawn(name, role, spec_path)
        self.client = RuntimeClient(addresses.main, self.deployment, curve=self.client_keys())
        kind = "threads of this process" if self.options.in_process else "processes"
        self.progress(f"started {len(roles)} roles as {kind}; waiting for them to be ready")
        started = time.monotonic()
        self._wait_ready()
        self.progress(f"every role ready in {time.monotonic() - started:.1f} s")

    def client_keys(self, seat: str = "main") -> EndpointKeys:
        """The keys of ``seat``'s client (main's: what this launcher and any other client of main use)."""
        if seat not in self.keys:
            raise ClusterError(f"no role {seat} in this cluster (started: {', '.join(self.keys) or 'none yet'})")
        return client_keys(seat, self.keys)

    @property
    def roles(self) -> list[str]:
        """The roles this cluster started (main, shadow if it runs one, worker-N)."""
        return [*self.processes, *self.threads]

    def restart_role(self, name: str) -> None:
        """Start role ``name`` (main, shadow, worker-N) again after it died, as its agent would.

        A worker rejoins by itself: main sees its link come back, asks whether it is ready and
        serves with it again from the next request on.
        """
        if self.options.in_process:
            raise ClusterError("roles in threads are not restarted: a test that kills roles needs processes")
        proc = self.processes.get(name)
        if proc is None:
            raise ClusterError(f"no role {name} in this cluster")
        if proc.poll() is None:
            raise ClusterError(f"{name} is still running")
        self._spawn(name, "worker" if name.startswith("worker-") else name, self.work_dir / f"{name}.spec.json")

    def _spawn(self, name: str, role: str, spec_path: Path) -> None:
        log_path = self.work_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        argv = ["serve-role", "--role", role, "--spec", str(spec_path)]
        if self.options.spawn == "fork":
            from inference.runtime.zygote import ZygoteError, kind_of, zygote

            log_path.write_bytes(b"")
            try:
                self.processes[name] = zygote(kind_of(role)).start(argv, log_path, env, Path.cwd())
                return
            except ZygoteError as exc:  # started afresh instead, as the option's default would
                self.progress(f"{name}: {exc}; starting it as a fresh process")
        log_file = open(log_path, "wb")  # noqa: SIM115 - owned by the child
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "inference", *argv],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        log_file.close()

    def _wait_ready(self) -> None:
        assert self.client is not None
        try:
            self.client.wait_ready(self.options.startup_timeout_s, check=self.check_processes)
        except TimeoutError as exc:
            raise ClusterError(str(exc)) from None

    def check_processes(self) -> None:
        """Raise ClusterError if any role has exited."""
        for name, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                raise ClusterError(f"{name} exited with code {code}:\n{self.log_tail(name)}")
        for name, thread in self.threads.items():
            ended = thread.exited()
            if ended is not None:
                raise ClusterError(f"{name} ended: {ended}\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.work_dir / ("roles.log" if name in self.threads else f"{name}.log")
        if not path.exists():
            return "(no log)"
        return "\n".join("    " + line for line in path.read_text(errors="replace").splitlines()[-lines:])

    def _threads_stopping(self) -> bool:
        """Whether role threads are still running that main's ``Shutdown`` can reach (not when
        main raised before it could pass it on: then nothing will stop them)."""
        main = self.threads.get("main")
        if main is not None and main.failure is not None:
            return False
        return any(t.is_alive() for t in self.threads.values())

    def _stop_threads(self, timeout_s: float = 5.0) -> None:
        """Wait for the role threads main's ``Shutdown`` reached; a thread cannot be killed, so one
        that did not stop (main died before it could tell it) is left to end with this process."""
        if not self._threads_stopping():
            timeout_s = 0.0
        deadline = time.monotonic() + timeout_s
        for thread in self.threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        lingering = [name for name, thread in self.threads.items() if thread.is_alive()]
        if lingering:
            self.progress(f"roles still running in threads after the shutdown: {', '.join(lingering)}")
        self.threads = {}

    def dump_stacks(self, settle_s: float = 0.5) -> None:
        """Have every live role write its threads' stacks to its log (SIGUSR1; see ``setup_process``)."""
        if self._thread_log is not None and any(t.is_alive() for t in self.threads.values()):
            self._thread_log.dump_stacks()
        alive = [proc for proc in self.processes.values() if proc.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1)
        if alive:
            time.sleep(settle_s)

    def close(self, *, keep_work_dir: bool = False, dump_stacks: bool = False) -> None:
        """Stop every role (asking main first); ``dump_stacks``: after a failure, their stacks go to their logs."""
        if dump_stacks and hasattr(signal, "SIGUSR1"):
            self.dump_stacks()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.shutdown()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and (
                any(p.poll() is None for p in self.processes.values()) or self._threads_stopping()
            ):
                time.sleep(0.05)
            self.client.close()
            self.client = None
        self._stop_threads()
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes = {}
        if self._thread_log is not None:
            self._thread_log.close()
            self._thread_log = None
        if self._own_work_dir and not keep_work_dir and not os.environ.get("ODMOE_KEEP_WORK_DIR"):
            shutil.rmtree(self.work_dir, ignore_errors=True)

    # --- talking to main ----------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        timeout_s: float | None = None,
        **kwargs,
    ) -> Done:
        """Generate through the cluster (see ``RuntimeClient.generate`` for the options).

        A worker or the shadow that dies meanwhile is served around by main (``inference.policies.failover``);
        main dying ends the generation at once with ``ClusterError``.
        """
        assert self.client is not None, "the cluster is not started"
        limit = timeout_s or (self.options.settings.timeout_s * 2 + max_new_tokens * 5)
        try:
            return self.client.generate(prompt_ids, max_new_tokens, timeout_s=limit, idle=self.check_main, **kwargs)
        except GenerationError as exc:
            self.check_main()  # a dead main is the better explanation
            raise ClusterError(f"generation failed: {exc}") from None

    def check_main(self) -> None:
        """Raise ClusterError if main has exited."""
        main = self.processes.get("main")
        if main is not None and main.poll() is not None:
            raise ClusterError(f"main exited with code {main.returncode}:\n{self.log_tail('main')}")
        thread = self.threads.get("main")
        if thread is not None and (ended := thread.exited()) is not None:
            raise ClusterError(f"main ended: {ended}\n{self.log_tail('main')}")

    def set_alignment(self, token_period: int, kv_period: int) -> None:
        assert self.client is not None
        self.client.set_alignment(token_period, kv_period)

    def cancel(self, request_id: str) -> None:
        """Stop a running generation after its current step (finish_reason "cancelled")."""
        assert self.client is not None
        self.client.cancel(request_id)
