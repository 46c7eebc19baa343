"""What this box offers: CPU, RAM, disk, GPUs, the address peers should use and ports free on it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from inference.modelio.shards import MANIFEST_FILE, ShardError, expert_codec_of
from inference.runtime.launcher import free_port

FREE_PORTS = 4  # offered per heartbeat; the control plane picks a role's inbox port among them


def gpus() -> list[dict]:
    """Every GPU: CUDA index, name, total memory and, where ``nvidia-smi`` says, free memory.

    Free memory is read from ``nvidia-smi``, never through CUDA itself: asking CUDA would
    create a context on every GPU inside the long-lived agent, holding a few hundred MB of
    each for its whole life (and, on a GPU in exclusive-process mode, keeping the role
    process off it). GPUs are matched by UUID, since nvidia-smi's order is not CUDA's.
    """
    try:
        import torch
    except ImportError:
        return []
    try:
        if not torch.cuda.is_available():
            return []
        free = _free_bytes_by_uuid()
        found = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpu = {"index": index, "name": props.name, "memory_bytes": int(props.total_memory)}
            uuid = str(getattr(props, "uuid", "")).removeprefix("GPU-")
            if uuid in free:
                gpu["free_bytes"] = free[uuid]
            found.append(gpu)
        return found
    except RuntimeError:  # a broken driver: report no GPU rather than no heartbeat
        return []


FREE_MEMORY_EVERY_S = 30.0  # nvidia-smi takes a moment; free memory is a hint, not a live gauge
_free_cache: tuple[float, dict[str, int]] = (float("-inf"), {})


def _free_bytes_by_uuid() -> dict[str, int]:
    """Free memory per GPU UUID (without the ``GPU-`` prefix) from nvidia-smi, asked at most every 30 s."""
    global _free_cache
    asked, free = _free_cache
    if time.monotonic() - asked < FREE_MEMORY_EVERY_S:
        return free
    free = _ask_nvidia_smi()
    _free_cache = (time.monotonic(), free)
    return free


def _ask_nvidia_smi() -> dict[str, int]:
    """Free memory per GPU UUID from nvidia-smi; {} where it can't say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=uuid,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    free = {}
    for line in out.splitlines():
        uuid, _, mib = (part.strip() for part in line.partition(","))
        with contextlib.suppress(ValueError):
            free[uuid.removeprefix("GPU-")] = int(mib) * 1024 * 1024
    return free


def shard_bytes(state_dir: Path) -> dict[str, int]:
    """Bytes of each shard already on this box, by ``model_id/shard`` (``agent.runtime.shard_dir``).

    The control plane's fit check counts them as space a restart does not need again.
    """
    found: dict[str, int] = {}
    root = state_dir / "shards"
    try:
        for model in root.iterdir():
            for shard in model.iterdir():
                if shard.is_dir():
                    found[f"{model.name}/{shard.name}"] = sum(f.stat().st_size for f in shard.iterdir() if f.is_file())
    except OSError:
        pass  # no shards yet, or one vanished while we looked
    return found


def shard_codecs(state_dir: Path) -> dict[str, str]:
    """The expert codec each shard on this box stores its experts with, by ``model_id/shard`` as in
    ``shard_bytes``: "none", or the codec its manifest's coded tensors name (``expert_codec_of``).

    The control plane counts a worker shard as already on the box only for a deployment of the same
    codec: one of the other codec is replaced, not reused. A shard without a manifest it can read (a
    download cut short: the manifest is written last) is left out. A manifest is read again only
    when it changed (``_codec_of``): this runs on every heartbeat, on the loop that relays tokens.
    """
    found: dict[str, str] = {}
    root = state_dir / "shards"
    try:
        models = [model for model in root.iterdir() if model.is_dir()]
    except OSError:
        return found  # no shards yet
    looked: set[Path] = set()
    for model in models:
        try:
            shards = [shard for shard in model.iterdir() if shard.is_dir()]
        except OSError:
            continue  # it vanished while we looked
        for shard in shards:
            looked.add(shard / MANIFEST_FILE)
            codec = _codec_of(shard / MANIFEST_FILE)
            if codec is not None:
                found[f"{model.name}/{shard.name}"] = codec
    for gone in _codecs_read.keys() - looked:
        del _codecs_read[gone]
    return found


_codecs_read: dict[Path, tuple[tuple[int, int], str | None]] = {}  # manifest -> ((mtime_ns, size), codec)


def _codec_of(manifest_file: Path) -> str | None:
    """The codec ``manifest_file`` names for its shard's experts, or None where it cannot say;
    read again only when the file's modification time or size changed."""
    try:
        status = manifest_file.stat()
    except OSError:
        _codecs_read.pop(manifest_file, None)
        return None
    stamp = (status.st_mtime_ns, status.st_size)
    known = _codecs_read.get(manifest_file)
    if known is not None and known[0] == stamp:
        return known[1]
    codec = None
    try:
        manifest = json.loads(manifest_file.read_bytes())
        if isinstance(manifest, dict):
            codec = expert_codec_of(manifest, f"shard {manifest_file.parent}")
    except (OSError, ValueError, ShardError):
        pass  # no manifest, or one this version does not read: nothing said about it
    _codecs_read[manifest_file] = (stamp, codec)
    return codec


def ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peer_address(server_host: str) -> str:
    """The local address that routes to the control plane: what peers should dial."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((server_host, 9))  # no packet is sent for a UDP connect
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def collect(state_dir: Path, server_host: str) -> dict:
    disk = shutil.disk_usage(state_dir)
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count() or 1,
        "ram_bytes": ram_bytes(),
        "disk_free_bytes": disk.free,
        "gpus": gpus(),
        "shard_bytes": shard_bytes(state_dir),
        "shard_codecs": shard_codecs(state_dir),
        "address": peer_address(server_host),
        "free_ports": sorted({free_port() for _ in range(FREE_PORTS)}),
    }
