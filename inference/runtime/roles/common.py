"""What every role process does the same way: logging, threads, device, peers, health."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from inference.runtime.frame_limit import max_frame_bytes_of
from inference.runtime.spec import RoleSpec, validate_keys
from inference.runtime.transport import Endpoint, Received
from inference.wire.runtime import Ping, Pong

log = logging.getLogger(__name__)

# glibc's M_MMAP_THRESHOLD, and the size from which every allocation gets pages of its own.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def return_freed_memory_to_the_system() -> None:
    """Make every large allocation its own mapping, released to the OS when it is freed.

    A role loads its weights tensor by tensor: it reads one, converts it, keeps the (smaller)
    result and frees the rest. glibc raises its mmap threshold after the first large free, so
    the next temporaries come from the heap, interleave with what is kept and can never be
    given back: measured on a 1.1 GB bf16 checkpoint, an nf4 shadow grew by 600 MB for a 309 MB
    model that way, and by 380 MB with a fixed threshold. Fixing it also keeps the resident
    memory a role reports honest. Linux with glibc only; elsewhere this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def setup_process(spec: RoleSpec) -> None:
    """What a role's own process sets once, before the role starts (``serve-role``): its log
    format, memory returned to the system, stacks on SIGUSR1, its intra-op threads. Roles run as
    threads of another process (``inference.runtime.in_process``) leave that process's as they are."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {spec.name} %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    return_freed_memory_to_the_system()
    # SIGUSR1 writes every thread's stack to the role's log: how a launcher shows where a role
    # that does not answer is stuck (``LocalCluster`` does it before stopping a failed cluster).
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Many roles share a small machine: one intra-op thread each unless told otherwise.
    torch.set_num_threads(spec.settings.threads)


def pick_device(setting: str) -> torch.device:
    """The role's compute device: "auto" (the first GPU, else the CPU), "cpu", "cuda" or "cuda:N".

    A CUDA device is made the process's current one with its index explicit, so that every
    kernel, stream, event and pinned copy of the role (bitsandbytes' included) lands on the GPU
    the role map gave it, and a box with several GPUs can host several roles.
    """
    if setting == "auto":
        setting = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {setting} was asked for but CUDA is not available here")
    device = torch.device("cuda", device.index or 0)
    count = torch.cuda.device_count()
    if device.index >= count:
        raise RuntimeError(f"device {setting} was asked for but this box has {count} GPU(s): cuda:0..cuda:{count - 1}")
    torch.cuda.set_device(device)
    return device


def open_endpoint(spec: RoleSpec) -> Endpoint:
    """The role's endpoint, bound to its inbox, with the emulated network link if one is set.

    With the role's keys in the spec only the principals that may talk to it get through, each
    saying only what it may (``inference.runtime.curve``, ``inference.runtime.permissions``); a frame bigger
    than the model can need disconnects its sender (``inference.runtime.frame_limit``). A spec without
    keys is refused (``SpecError``): a role never serves an unauthenticated data plane.
    """
    validate_keys(spec)
    return Endpoint(
        spec.name,
        spec.deployment,
        bind=spec.bind_address,
        link_bytes_per_s=spec.settings.link_bytes_per_s,
        link_latency_s=spec.settings.link_latency_s,
        curve=spec.curve,
        max_frame_bytes=max_frame_bytes_of(spec.shard_dir),
    )


def connect_peers(
    endpoint: Endpoint, spec: RoleSpec, *, workers: bool, shadow: bool, main: bool, watch: bool = False
) -> None:
    """Open the links this role talks over; ``watch``: report a worker's or the shadow's loss at once (main)."""
    if main and spec.role != "main":
        endpoint.connect("main", spec.addresses.main)
    if shadow and spec.addresses.shadow is not None and spec.role != "shadow":
        endpoint.connect("shadow", spec.addresses.shadow, watch=watch)
    if workers:
        for i, address in enumerate(spec.addresses.workers):
            endpoint.connect(f"worker-{i}", address, watch=watch)


def answer_ping(endpoint: Endpoint, received: Received, role: str, ready: bool, detail: str = "") -> bool:
    """Reply to a Ping on the inbox with the role's health and memory; True if ``received`` was one."""
    if isinstance(received.msg, Ping) and received.via == "inbox":
        host, peak = process_memory()
        endpoint.reply(
            received.identity,
            Pong(
                role=role,
                ready=ready,
                detail=detail,
                host_bytes=host,
                peak_host_bytes=peak,
                device_bytes=device_memory(),
                nonce=received.msg.nonce,
            ),
        )
        return True
    return False


def handle_safely(handle: Callable[[Received], None], received: Received) -> None:
    """Run a role's handler on one message; a handler error drops the message, never the role.

    A malformed or hostile message must not take a role down: the role logs what it dropped
    and from whom, and serves the next message.
    """
    try:
        handle(received)
    except Exception:
        log.exception("dropped %s from %s: handling it failed", received.msg.TYPE, received.msg.sender or received.via)


def process_memory() -> tuple[int, int]:
    """This process's resident set now and at its peak (VmRSS, VmHWM), in bytes; zeros where unknown."""
    found = {"VmRSS": 0, "VmHWM": 0}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in found:
                found[name] = int(rest.split()[0]) * 1024  # the kernel writes kB
    return found["VmRSS"], found["VmHWM"]


def device_memory() -> int:
    """Bytes this process holds on its current GPU (reserved by the caching allocator); 0 without CUDA."""
    if not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_reserved())


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS after loading (glibc's ``malloc_trim``)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeerHealth:
    """Pings linked peers until each has answered ready once."""

    def __init__(self, endpoint: Endpoint, peers: list[str], interval_s: float = 0.2) -> None:
        self.endpoint = endpoint
        self.waiting = set(peers)
        self.interval_s = interval_s
        self._last_ping = 0.0

    @property
    def ready(self) -> bool:
        return not self.waiting

    def tick(self) -> None:
        now = time.monotonic()
        if self.waiting and now - self._last_ping >= self.interval_s:
            for peer in self.waiting:
                self.endpoint.send(peer, Ping())
            self._last_ping = now

    def observe(self, received: Received) -> bool:
        """Consume a Pong from a peer; True if ``received`` was one."""
        if isinstance(received.msg, Pong) and received.via in self.endpoint.peers:
            if received.msg.ready:
                self.waiting.discard(received.via)
            return True
        return False
