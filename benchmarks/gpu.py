r"""The GPU check: device facts, copy bandwidth, expert compute and every strategy served, in one bounded run.

    python -m benchmarks.gpu [--device cuda:0] [--scale full|tiny] [--json OUT] [--markdown OUT]
        [--tokens N] [--workers W] [--budget-s S] [--layers N] [--in-process]

Sections, each timed, each bounded by a time limit, each recording its error and letting the
run go on (the JSON and the Markdown table are rewritten after every section, so what ran is
on disk even if the process is killed):

1. ``facts``: Python, torch, transformers, CUDA, cuDNN and driver versions, the GPU's name,
   memory and properties, and ``nvidia-smi``'s own words.
2. ``copy``: host-to-device copy GB/s of one expert's bytes (352 MB for Mixtral-8x7B in bf16) on
   a side stream, from pinned memory and, for contrast, from pageable memory; median of several
   copies timed with CUDA events.
3. ``expert``: one expert's compute time at batch 1 (``inference.runtime.experts.expert_forward`` on
   ``fuse_expert`` weights on the device), CUDA-event timed, median of many.
   ``nf4``: nf4 data quantized by the CPU (as a pre-converted shadow shard is) read by the GPU's
   kernels, and the GPU's own quantization, against the CPU's (needs bitsandbytes).
4. ``checkpoint``: a random Mixtral-8x7B-shaped checkpoint of 4 layers (``inference.tools.tiny.make_tiny``:
   hidden 4096, intermediate 14336, 8 experts, top-2, 32 heads, 8 KV heads, bf16; about 12 GB),
   written at run time on the machine that runs the check (nothing that large travels), and its
   role shards. ``staging``: worker 0's experts copied to the device by the loader from its
   page-locked "ram" store and from its "disk" store through the rotating pinned staging
   buffers (``inference.runtime.staging``): ms per expert of each, every staged copy checked bit for bit.
5. ``reference``: Transformers' greedy tokens on the same device (``reference_generate``).
6. ``cluster``: that checkpoint served by main, shadow and W workers, all on the one device
   (``LocalCluster``), with every strategy and, for odmoe, every shadow dtype that can run here
   (nf4 needs bitsandbytes; without it the run is skipped with the reason). Per run: decode and
   end-to-end tok/s, TTFT, recall, each worker's peak expert bytes (from the run's own metrics),
   each role's peak device memory (``nvidia-smi --query-compute-apps`` sampled during the run,
   pids mapped to roles), and token agreement with the reference. Right after odmoe with the bf16
   shadow, the same run with the shadow drafting ``--drafts`` tokens a pass (4 by default, 0 for
   none; ``docs/concepts/drafts.md``): its tokens must equal the reference too, and its row gives
   decode ÷ odmoe without drafts and the drafts tally (drafted, kept, tokens per pass, distinct
   experts per layer per pass).

``--scale tiny`` runs the same flow on a model with small hidden sizes in fp32, so that it
finishes on a CPU in under a minute (the test does this, with ``--in-process``: the roles as
threads, ``benchmarks.roles``); on a CPU the device-only figures (copy bandwidth, per-process
device memory) are null with the reason.

On a lent GPU machine (torch 2.11 and transformers 5.17, no pyzmq there), the runtime's wheels
travel with the tree: ``make gpu-wheels`` here fetches pyzmq and transformers 5.24 (the versions
in constraints.txt) into ``var/gpu-wheels/`` (ignored by git, 14 MB); then the device tool's ``run``
with ``carry: ["var/gpu-wheels"]``, ``timeout_s: 480`` and the command::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site var/gpu-wheels/*.whl && export PYTHONPATH=/tmp/site:. || exit; \
        set -o pipefail; PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.log

writes ``$OUT/gpu.json``, ``$OUT/gpu.md`` and ``$OUT/gpu.log`` (commit the first two under
``benchmarks/results/`` as a new ``gpu-*.json``: a recorded result is never rewritten, so the check
refuses a ``--json`` path that exists). The full scale stays inside ``--budget-s`` (420 s by default: sections
and runs that would not fit are skipped with the reason) and needs about 48 GB of disk where the
temporary folder is (``--work-dir``): the checkpoint (12 GB), the shadow's shard (12 GB) and the
workers' shards (11 GB each, as every worker of a group holds its layers' experts).
``make gpu-check`` runs it with this project's venv into a new ``benchmarks/results/gpu-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks import provenance, roles, substance
from benchmarks.strategies import copy_bound
from benchmarks.workload import prompt_of
from inference.building.sharding import build_shards
from inference.constants import MAX_DRAFT_TOKENS, SHADOW_DTYPES
from inference.policies.strategies import STRATEGIES, get_strategy
from inference.runtime.disk_store import DiskStore
from inference.runtime.experts import activation, expert_forward, fuse_expert
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.loader import ExpertLoader
from inference.runtime.spec import DeploymentSettings
from inference.runtime.store import HostMemoryStore
from inference.tools.reference import reference_generate
from inference.tools.tiny import make_tiny

FORMAT = "odmoe-gpu-check/1"
# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME
GIB = 1024**3
MIB = 1024**2
NO_DEVICE = "no CUDA device: the check ran on {device}"


@dataclass(frozen=True)
class Scale:
    """The model shape and the limits of one scale of the check."""

    model: dict
    tokens: int
    prompt_len: int
    copy_repeats: int
    expert_repeats: int
    budget_s: float  # the whole run
    limits: dict  # seconds per section; "run" is each cluster run
    min_run_s: float  # a cluster run is not started with less time left than this


SCALES = {
    # Mixtral-8x7B's layer sizes, 4 layers, bf16: each expert 3 x 4096 x 14336 x 2 B = 352 MB.
    "full": Scale(
        model=dict(
            layers=4,
            hidden=4096,
            intermediate=14336,
            experts=8,
            top_k=2,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=32000,
            shards=6,
            dtype="bfloat16",
        ),
        tokens=32,
        prompt_len=16,
        copy_repeats=10,
        expert_repeats=200,
        budget_s=420.0,
        limits=dict(
            facts=30, copy=60, expert=60, nf4=30, checkpoint=200, shards=150, staging=60, reference=120, run=150
        ),
        min_run_s=40.0,
    ),
    # The two scales are declarations, one per line: alike by shape on purpose.
    # The same flow in seconds on a CPU; fp32 so that the runtime matches Transformers exactly.
    "tiny": Scale(
        model=dict(
            layers=4,
            hidden=64,
            intermediate=128,
            experts=8,
            top_k=2,
            heads=4,
            kv_heads=2,
            head_dim=16,
            vocab=None,
            shards=1,
            dtype="float32",
        ),
        tokens=8,
        prompt_len=8,
        copy_repeats=5,
        expert_repeats=50,
        budget_s=300.0,
        limits=dict(facts=30, copy=30, expert=30, nf4=30, checkpoint=60, shards=60, staging=30, reference=60, run=90),
        min_run_s=3.0,
    ),
}
ODMOE_SHADOW_DTYPES = ("bf16", "fp16", "int8", "nf4")
DEFAULT_DRAFTS = 4  # the drafted run's draft_tokens (docs/concepts/drafts.md)
RUN_METRICS = (
    "decode_tok_s",
    "e2e_tok_s",
    "ttft_ms",
    "recall",
    "recall_per_layer",
    "prediction_coverage",
    "prediction_in_time",
    "expert_bytes",
    "worker_peak_expert_bytes",
    "worker_peak_prefill_bytes",
    "expert_loads",
    "prefetch_hits",
    "prefetch_misses",
    "wasted_loads",
    "decode_layer_dispatch_ms_median",
    "decode_layer_load_wait_ms_median",
    "decode_layer_worker_ms_median",
    "decode_layer_coordination_ms_median",
    "shadow",
    "drafts",
)


@dataclass(frozen=True)
class Run:
    """One cluster run: a strategy, its shadow's dtype (None: no shadow), the shadow's drafts a pass."""

    strategy: str
    shadow_dtype: str | None
    drafts: int = 0

    @property
    def label(self) -> str:
        label = self.strategy if self.shadow_dtype is None else f"{self.strategy}/{self.shadow_dtype}"
        return f"{label}+drafts{self.drafts}" if self.drafts else label


# The order of the cluster runs: the most telling first, so a short budget keeps them (the drafted
# run, when asked for, right after the run it is measured against).
FIRST_RUNS = (Run("odmoe", "bf16"), Run("full-cache", None), Run("reactive", None), Run("lru-offload", None))


def say(line: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {line}", flush=True)


# --- bounds --------------------------------------------------------------------------------------


class SectionTimeout(BaseException):
    """A section ran past its limit. A BaseException, so that library code's ``except Exception``
    cannot swallow it on its way out."""


class Skipped(Exception):
    """A section (or run) that does not apply here; the message says why."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``SectionTimeout`` in the main thread once ``seconds`` have passed (SIGALRM).

    Off the main thread, or where there is no SIGALRM, the block runs unbounded. An alarm set
    before (pytest-timeout's, say) is put back with what was left of it.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise SectionTimeout(f"ran past its limit of {seconds:.0f} s")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:
            left = max(old_delay - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


@dataclass
class Report:
    """What the check found so far; written to disk after every section."""

    json_path: Path | None
    markdown_path: Path | None
    deadline: float
    data: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        if self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            # Sealed at every write: the last one, at the end of the run, is what gets committed.
            self.json_path.write_text(json.dumps(provenance.sealed(self.data), indent=2, default=str) + "\n")
        if self.markdown_path is not None:
            self.markdown_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                text = markdown(self.data)
            except Exception as exc:  # the table is a view of the JSON: never let it stop the run
                text = f"(the table could not be rendered: {error_text(exc)}; the JSON has every figure)\n"
            self.markdown_path.write_text(text)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 4000 else text[:4000] + " …"


def run_section(report: Report, name: str, limit_s: float, fn: Callable[[], dict]) -> dict | None:
    """Run one section within ``limit_s`` (and what is left of the whole budget); record it.

    Returns the section's result, or None when it was skipped or failed (its entry says why).
    """
    limit = min(limit_s, report.left())
    entry: dict = {"status": None, "seconds": None, "limit_s": round(limit, 1), "result": None}
    report.data["sections"][name] = entry
    started = time.monotonic()
    say(f"{name}: start (limit {limit:.0f} s)")
    try:
        if report.left() <= 1:
            raise Skipped("the time budget is spent")
        with time_limit(limit):
            entry["result"] = fn()
        entry["status"] = "ok"
    except Skipped as exc:
        entry.update(status="skipped", reason=str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SectionTimeout too: the run goes on with the next section
        entry.update(status="error", error=error_text(exc), traceback=traceback.format_exc(limit=8)[-3000:])
    entry["seconds"] = round(time.monotonic() - started, 2)
    say(
        f"{name}: {entry['status']} in {entry['seconds']} s"
        + (f": {entry.get('error') or entry.get('reason')}" if entry["status"] != "ok" else "")
    )
    report.write()
    return entry["result"]


# --- 1. facts ------------------------------------------------------------------------------------


def run_command(args: list[str], timeout_s: float = 10.0) -> str | None:
    """A command's stdout, or None when it is absent or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def module_version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception:
        return None
    return getattr(module, "__version__", "unknown")


def bitsandbytes_status() -> tuple[str | None, str | None]:
    """(version, None) when bitsandbytes imports, else (None, why not)."""
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except Exception as exc:
        return None, f"bitsandbytes does not import: {error_text(exc)}"
    return getattr(bitsandbytes, "__version__", "unknown"), None


def versions() -> dict:
    import transformers

    zmq_version = libzmq_version = None
    with contextlib.suppress(Exception):
        import zmq

        zmq_version, libzmq_version = zmq.__version__, zmq.zmq_version()
    bnb, _ = bitsandbytes_status()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "driver": driver_version(),
        "pyzmq": zmq_version,
        "libzmq": libzmq_version,
        "safetensors": module_version("safetensors"),
        "bitsandbytes": bnb,
    }


def driver_version() -> str | None:
    out = run_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.strip().splitlines()[0] if out and out.strip() else None


def git_commit() -> str | None:
    out = run_command(["git", "rev-parse", "HEAD"])
    return out.strip() if out else None


def device_facts(device: torch.device) -> dict:
    facts: dict = {
        "versions": versions(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": git_commit(),
        "device": str(device),
        "gpu": None,
        "nvidia_smi": None,
    }
    query = run_command(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current",
            "--format=csv",
        ]
    )
    summary = run_command(["nvidia-smi"])
    facts["nvidia_smi"] = (
        {"query": query, "summary": summary}
        if query or summary
        else {"reason": "nvidia-smi is not on PATH here or failed"}
    )
    if device.type != "cuda":
        facts["gpu_reason"] = NO_DEVICE.format(device=device)
        return facts
    try:
        facts["gpu"] = gpu_properties(device)
    except Exception as exc:  # the versions above still come back
        facts["gpu_reason"] = f"the GPU could not be queried: {error_text(exc)}"
    return facts


def gpu_properties(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return {
        "name": props.name,
        "total_memory_bytes": props.total_memory,
        "total_memory_gib": round(props.total_memory / GIB, 2),
        "free_memory_bytes_at_start": free,
        "capability": f"{props.major}.{props.minor}",
        "multi_processor_count": props.multi_processor_count,
        "device_count": torch.cuda.device_count(),
        "mem_get_info_total_bytes": total,
    }


# --- 2. copy bandwidth ---------------------------------------------------------------------------


def expert_nbytes(model: dict, itemsize: int) -> int:
    return 3 * model["hidden"] * model["intermediate"] * itemsize


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """Host-to-device GB/s of ``nbytes`` on a side stream: pinned and pageable sources."""
    if device.type != "cuda":
        return {"pinned_gb_s": None, "pageable_gb_s": None, "reason": NO_DEVICE.format(device=device)}
    stream = torch.cuda.Stream(device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result: dict = {"bytes": nbytes, "repeats": repeats, "stream": "side (torch.cuda.Stream)", "timer": "CUDA events"}
    for kind in ("pinned", "pageable"):
        src = torch.ones(nbytes, dtype=torch.uint8)  # written, so every page is resident
        if kind == "pinned":
            src = src.pin_memory()
        samples = []
        for i in range(repeats + 1):  # the first copy is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            if i:
                samples.append(start.elapsed_time(end) / 1000)
        median_s = statistics.median(samples)
        result[f"{kind}_gb_s"] = nbytes / median_s / 1e9
        result[f"{kind}_ms_median"] = median_s * 1000
        result[f"{kind}_ms_all"] = [round(s * 1000, 3) for s in samples]
        del src
    del dst
    torch.cuda.empty_cache()
    return result


# --- 3. expert compute ---------------------------------------------------------------------------


def expert_compute(device: torch.device, model: dict, repeats: int) -> dict:
    """One expert at batch 1 in the checkpoint's dtype: median seconds, and the bandwidth that implies."""
    dtype = getattr(torch, model["dtype"])
    hidden, intermediate = model["hidden"], model["intermediate"]
    generator = torch.Generator(device=device).manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator, device=device) * 0.02).to(dtype)

    expert = fuse_expert(weight(intermediate, hidden), weight(hidden, intermediate), weight(intermediate, hidden))
    row = torch.randn(1, hidden, generator=generator, device=device).to(dtype)
    routing = torch.ones(1, device=device, dtype=dtype)
    act = activation("silu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a worker role computes (DeploymentSettings.threads)
    with torch.inference_mode():
        for _ in range(10):
            expert_forward(row, routing, expert, act)
        samples = []
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                expert_forward(row, routing, expert, act)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                expert_forward(row, routing, expert, act)
                samples.append(time.perf_counter() - t0)
        pipelined_s = None
        if device.type == "cuda":  # back to back, no sync between calls: no launch gaps in the figure
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                expert_forward(row, routing, expert, act)
            end.record()
            end.synchronize()
            pipelined_s = start.elapsed_time(end) / 1000 / repeats
    torch.set_num_threads(threads)
    median_s = statistics.median(samples)
    nbytes = expert.nbytes
    del expert
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "hidden": hidden,
        "intermediate": intermediate,
        "dtype": model["dtype"],
        "batch": 1,
        "expert_bytes": nbytes,
        "repeats": repeats,
        "timer": "CUDA events" if device.type == "cuda" else "time.perf_counter",
        "us_median": median_s * 1e6,
        "us_min": min(samples) * 1e6,
        "us_p90": sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e6,
        "weights_gb_s": nbytes / median_s / 1e9,  # batch 1 reads every weight once
        "us_pipelined": None if pipelined_s is None else pipelined_s * 1e6,
    }


# --- 4. checkpoint, 5. reference -----------------------------------------------------------------


def nf4_across_devices(device: torch.device) -> dict:
    """nf4 data quantized on a CPU (a shard build) read by the GPU's kernels, and quantized on the GPU.

    A pre-converted shadow shard is quantized by bitsandbytes' CPU backend on the control plane
    and dequantized by its CUDA kernels on the shadow's box: the two must agree on the packing
    (high nibble first) and the per-block absmax. Compared: the CUDA dequantization of CPU data
    against the CPU's, the fused 4-bit matmul against a matmul with the CPU-dequantized weight,
    and CUDA quantization against the CPU's bytes.
    """
    from inference.shadow import quant

    if device.type != "cuda":
        raise Skipped("needs a CUDA device: this compares CPU and GPU kernels")
    version, why_not = bitsandbytes_status()
    if why_not:
        raise Skipped(why_not)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(4096, 1000, generator=generator) * 0.02).to(torch.bfloat16)  # rows not a multiple of 64
    on_cpu = quant.quantize_weight(weight, "nf4")
    cpu_dense = quant.dequantize_weight(on_cpu, torch.float32)
    moved = quant.QuantizedWeight("nf4", on_cpu.data.to(device), on_cpu.state.to(device), on_cpu.shape)
    gpu_dense = quant.dequantize_weight(moved, torch.float32).cpu()
    x = torch.randn(1, 1000, generator=generator).to(device, torch.bfloat16)
    fused = quant.quantized_linear(x, moved).float().cpu()
    plain = torch.nn.functional.linear(x.float(), cpu_dense.to(device)).cpu()
    on_gpu = quant.quantize_weight(weight.to(device), "nf4")
    # In-features a multiple of the block (as Mixtral's 4096 and 14336): bitsandbytes' own
    # batch-1 4-bit kernel runs, where 1000 falls back to dequantize + matmul.
    wide = (torch.randn(4096, 4096, generator=generator) * 0.02).to(torch.bfloat16)
    wide_q = quant.quantize_weight(wide, "nf4")
    wide_moved = quant.QuantizedWeight("nf4", wide_q.data.to(device), wide_q.state.to(device), wide_q.shape)
    x_wide = torch.randn(1, 4096, generator=generator).to(device, torch.bfloat16)
    kernel = quant.quantized_linear(x_wide, wide_moved).float().cpu()
    wide_plain = torch.nn.functional.linear(x_wide.float(), quant.dequantize_weight(wide_q).to(device)).cpu()
    return {
        "matmul_4bit_kernel_max_abs_diff": float((kernel - wide_plain).abs().max()),
        "matmul_4bit_kernel_output_max_abs": float(wide_plain.abs().max()),
        "bitsandbytes": version,
        "dequantize_equal": bool(torch.equal(gpu_dense, cpu_dense)),
        "dequantize_max_abs_diff": float((gpu_dense - cpu_dense).abs().max()),
        "matmul_4bit_max_abs_diff": float((fused - plain).abs().max()),
        "matmul_output_max_abs": float(plain.abs().max()),
        "quantize_data_equal": bool(torch.equal(on_gpu.data.cpu(), on_cpu.data)),
        "quantize_absmax_max_diff": float((on_gpu.state.float().cpu() - on_cpu.state.float()).abs().max()),
    }


def build_checkpoint(model_dir: Path, model: dict) -> dict:
    free = shutil.disk_usage(model_dir.parent).free
    started = time.monotonic()
    make_tiny(model_dir, seed=0, **model)
    seconds = time.monotonic() - started
    size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    return {
        "dir": str(model_dir),
        "shape": model,
        "bytes": size,
        "write_gb_s": size / seconds / 1e9 if seconds > 0 else None,
        "disk_free_bytes_before": free,
    }


def build_role_shards(model_dir: Path, shard_dir: Path, workers: int) -> dict:
    """The role shards every cluster run then reuses (``LocalCluster`` builds none where it finds them)."""
    shard_dir.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(shard_dir.parent).free
    started = time.monotonic()
    # The nf4 shadow then loads a shard quantized here, on the CPU, as a deployment's shadow does.
    preconverted = ("nf4",) if bitsandbytes_status()[1] is None else ()
    build_shards(model_dir, shard_dir, workers=workers, shadow_dtypes=preconverted)
    seconds = time.monotonic() - started
    size = sum(p.stat().st_size for p in shard_dir.rglob("*") if p.is_file())
    return {
        "dir": str(shard_dir),
        "workers": workers,
        "preconverted_shadows": list(preconverted),
        "bytes": size,
        "write_gb_s": size / seconds / 1e9,
        "disk_free_bytes_before": free,
    }


def staged_copies(device: torch.device, worker_shard: Path, slots: int) -> dict:
    """One worker's experts copied to ``device`` by the loader: from its "ram" store, page-locked
    where it lies on CUDA (copied directly); from its "disk" store through ``slots`` rotating
    staging buffers (``inference.runtime.staging``; pinned on CUDA, as many used as the 2 slots); and
    through one buffer for passes of 4, so that every read waits for the copy out of it.
    Milliseconds per expert of each (the disk reads come from the page cache: the shard was
    just written), the waits for a buffer, and every expert compared bit for bit with the RAM
    store's."""
    cuda = device.type == "cuda"
    ram = HostMemoryStore.from_shard(worker_shard, pin=cuda, verify=False)
    pairs = sorted(ram.keys())
    expert_bytes = ram.nbytes(*pairs[0])
    result: dict = {"experts": len(pairs), "expert_bytes": expert_bytes, "slots": slots, "pinned": cuda}
    disk = DiskStore(worker_shard, verify=False)
    legs = (  # (label, store, staging buffers, loader slots)
        ("ram", ram, 0, 2),
        ("disk_staged", disk, slots, 2),
        # A pass of 4 experts through 1 buffer: each read waits for the copy out of it (on CUDA).
        ("disk_one_buffer", disk, 1, 4),
    )
    with disk:
        for label, store, staging, resident_max in legs:
            loader = ExpertLoader(store, device, max_resident=resident_max, staging_slots=staging)
            try:
                keys = [(1, layer, expert) for layer, expert in pairs]
                started = time.perf_counter()
                for key in keys:
                    loader.prefetch(key)
                for key in keys:  # timed: nothing but the copies and their hand-over
                    loader.acquire(key, timeout_s=60)
                    loader.release(key)
                seconds = time.perf_counter() - started
                mismatched = 0
                for key in keys:  # checked: a second pass, each copy read back
                    loader.prefetch((2, *key[1:]))
                for _, layer, expert in keys:
                    resident, _, _ = loader.acquire((2, layer, expert), timeout_s=60)
                    want = ram.get(layer, expert)
                    got = (resident.weights.gate_up.cpu(), resident.weights.down.cpu())
                    mismatched += not (torch.equal(got[0], want.gate_up) and torch.equal(got[1], want.down))
                    loader.release((2, layer, expert))
                result[label] = {
                    "ms_per_expert": seconds / len(keys) * 1000,
                    "gb_s": expert_bytes * len(keys) / seconds / 1e9,
                    "staging_waits": loader.staging.stalls if loader.staging else None,
                    "staging_wait_ms": loader.staging.stall_ms if loader.staging else None,
                    "mismatched_experts": mismatched,
                }
            finally:
                loader.close()
    if any(result[label]["mismatched_experts"] for label, *_ in legs):
        raise RuntimeError(f"experts copied to the device differ from the store's: {result}")
    return result


def existing_checkpoint(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return {"dir": str(model_dir), "given": True, "config": config}


def release_reference_model() -> None:
    """Drop the reference model that ``reference_generate`` keeps loaded, and its device memory."""
    from inference.tools import reference

    with contextlib.suppress(AttributeError):
        reference._load.cache_clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reference_tokens(model_dir: Path, prompt: list[int], tokens: int, device: torch.device) -> dict:
    try:
        started = time.monotonic()
        ids = reference_generate(model_dir, prompt, tokens, device=str(device), dtype="auto")
        seconds = time.monotonic() - started
    finally:
        release_reference_model()
    return {"prompt": prompt, "token_ids": ids, "seconds_with_load": seconds, "device": str(device)}


def agreement(tokens: list[int], reference: list[int] | None) -> dict:
    if reference is None:
        return {"exact": None, "reason": "no reference tokens (the reference section did not finish)"}
    matching = sum(a == b for a, b in zip(tokens, reference, strict=False))
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    if first is None and len(tokens) != len(reference):
        first = min(len(tokens), len(reference))
    return {
        "exact": tokens == reference,
        "matching": matching,
        "of": len(reference),
        "share": matching / len(reference) if reference else None,
        "first_mismatch": first,
    }


# --- 6. cluster ----------------------------------------------------------------------------------


class DeviceMemorySampler:
    """Each GPU process's memory and the device's used memory, sampled during a run, peaks kept.

    Two ``nvidia-smi ... -lms N`` processes write a line per process (and one for the device)
    every N ms into ``folder``, read when the block ends: no thread in this process, which forks
    the role processes meanwhile, and nothing is lost to a sampler's own stalls.
    """

    def __init__(self, device: torch.device, folder: Path, interval_ms: int = 200) -> None:
        self.index = str(device.index or 0)
        self.folder = folder
        self.interval_ms = interval_ms
        self.smi = shutil.which("nvidia-smi") is not None
        self.procs: dict[str, subprocess.Popen] = {}
        self.peak_by_pid: dict[int, int] = {}
        self.device_used: list[int] = []

    def queries(self) -> dict[str, list[str]]:
        common = ["-i", self.index, "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]
        return {
            "apps": ["nvidia-smi", "--query-compute-apps=pid,used_memory", *common],
            "device": ["nvidia-smi", "--query-gpu=index,memory.used", *common],
        }

    def __enter__(self) -> DeviceMemorySampler:
        if self.smi:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Line-buffered where coreutils' stdbuf is: each sample reaches the file as it is taken.
            line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
            for name, command in self.queries().items():
                with open(self.folder / f"nvidia-smi-{name}.csv", "wb") as out:
                    self.procs[name] = subprocess.Popen(
                        [*line_buffered, *command], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                    )
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGINT)  # what it loops until, exiting cleanly with its output flushed
        # Alike LocalCluster.close's wait-then-kill by domain: each stops its own processes its own way.
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in self.procs:
            self.parse(name, (self.folder / f"nvidia-smi-{name}.csv").read_text(errors="replace"))

    def parse(self, name: str, text: str) -> None:
        for line in text.splitlines():
            parts = [part.strip() for part in line.split(",")]
            if len(parts) != 2 or not (parts[0].isdigit() and parts[1].isdigit()):
                continue  # a header, "[N/A]", or a message such as "No devices were found"
            key, used = int(parts[0]), int(parts[1]) * MIB
            if name == "apps":
                self.peak_by_pid[key] = max(self.peak_by_pid.get(key, 0), used)
            else:
                self.device_used.append(used)

    def report(self, pids: dict[str, int]) -> dict:
        per_role = {name: self.peak_by_pid.get(pid) for name, pid in pids.items()}
        out = {
            "per_role_peak_bytes": per_role,
            "device_used_before_bytes": self.device_used[0] if self.device_used else None,
            "device_used_peak_bytes": max(self.device_used, default=None),
            # This process (the check itself) and any other program on the GPU.
            "other_pids_peak_bytes": {str(pid): b for pid, b in self.peak_by_pid.items() if pid not in pids.values()},
            "samples": len(self.device_used),
            "interval_ms": self.interval_ms,
            "source": " ".join(self.queries()["apps"]),
        }
        if not self.smi:
            out["reason"] = "nvidia-smi is not on PATH: no device memory figures"
        elif not any(v is not None for v in per_role.values()):
            out["reason"] = (
                "nvidia-smi listed none of the role pids (a container's pid namespace hides them?): "
                "see other_pids_peak_bytes and device_used_peak_bytes"
            )
        return out


def shadow_skip_reason(dtype: str) -> str | None:
    if dtype == "nf4":
        _, why = bitsandbytes_status()
        return why
    return None


def plan_runs(strategies: list[str], shadow_dtypes: list[str], drafts: int = 0) -> list[Run]:
    """Every run to serve, the most telling first: each strategy with each shadow dtype it takes, and
    odmoe with the bf16 shadow drafting ``drafts`` tokens a pass right after odmoe/bf16 (none for 0)."""
    wanted = [
        Run(s, d) for s in strategies for d in (shadow_dtypes if get_strategy(s).predictor == "shadow" else [None])
    ]
    first = [run for run in FIRST_RUNS if run in wanted]
    if drafts and Run("odmoe", "bf16") in wanted:
        first.insert(first.index(Run("odmoe", "bf16")) + 1, Run("odmoe", "bf16", drafts))
    return first + [run for run in wanted if run not in first]


def serve_once(
    model_dir: Path,
    work_dir: Path,
    planned: Run,
    args: argparse.Namespace,
    prompt: list[int],
    reference: list[int] | None,
    startup_timeout_s: float,
) -> dict:
    """One cluster, one warm-up and one measured generation; the figures of that generation."""
    device = torch.device(args.device)
    strategy, shadow_dtype = planned.strategy, planned.shadow_dtype
    settings = DeploymentSettings(
        device=args.device,
        strategy=strategy,
        shadow_dtype=shadow_dtype or "bf16",
        dtype="auto",
        draft_tokens=planned.drafts,
    )
    options = ClusterOptions(  # fresh processes, as deployments run them: each role's memory its own
        workers=args.workers,
        settings=settings,
        startup_timeout_s=startup_timeout_s,
        in_process=args.in_process,
        spawn="exec",
    )
    cluster = LocalCluster(model_dir, options, work_dir=work_dir, progress=lambda line: say(f"  {line}"))
    sampler = DeviceMemorySampler(device, work_dir / "memory") if device.type == "cuda" else None
    timings: dict = {}
    try:
        with contextlib.ExitStack() as stack:
            if sampler is not None:
                stack.enter_context(sampler)
            started = time.monotonic()
            stack.enter_context(cluster)
            timings["startup_s"] = time.monotonic() - started
            pids = {name: proc.pid for name, proc in cluster.processes.items()}
            started = time.monotonic()
            say("  warm-up generation")
            cluster.generate(prompt[: max(1, len(prompt) // 2)], 4)  # warm-up: first-call work in every role
            timings["warmup_s"] = time.monotonic() - started
            say(f"  measured generation of {args.tokens} tokens")
            started = time.monotonic()
            done = cluster.generate(prompt, args.tokens)
            timings["generate_s"] = time.monotonic() - started
    finally:
        cluster.close()  # again, in case a time limit cut the first close short
    metrics = {key: done.metrics.get(key) for key in RUN_METRICS}
    if get_strategy(strategy).predictor is None:
        metrics["recall"] = None  # nothing predicts: the metric would only count misses
    worker_peaks = done.metrics.get("worker_peak_expert_bytes") or {}
    if sampler is not None:
        memory = sampler.report(pids)
    else:
        memory = {"per_role_peak_bytes": None, "reason": NO_DEVICE.format(device=device)}
    return {
        "strategy": strategy,
        "shadow_dtype": shadow_dtype,
        "draft_tokens": planned.drafts,
        "workers": args.workers,
        "prompt_tokens": len(prompt),
        "token_ids": done.token_ids,
        "finish_reason": done.finish_reason,
        "agreement": agreement(done.token_ids, reference),
        "peak_expert_bytes_per_worker": max(worker_peaks.values()) if worker_peaks else None,
        "device_memory": memory,
        "timings": {k: round(v, 3) for k, v in timings.items()},
        **metrics,
    }


def serve_all(
    report: Report,
    model_dir: Path,
    work_dir: Path,
    args: argparse.Namespace,
    scale: Scale,
    prompt: list[int],
    reference: list[int] | None,
) -> dict:
    result: dict = {"workers": args.workers, "tokens": args.tokens, "runs": [], "skipped": []}
    report.data["sections"]["cluster"]["result"] = result
    durations: list[float] = []
    for planned in plan_runs(args.strategies, args.shadow_dtypes, args.drafts):
        label = planned.label
        why = shadow_skip_reason(planned.shadow_dtype) if planned.shadow_dtype else None
        needed = max([scale.min_run_s, *durations])
        if why is None and report.left() < needed:
            why = f"the time budget is spent ({report.left():.0f} s left, a run takes about {needed:.0f} s)"
        if why is not None:
            result["skipped"].append({"run": label, "reason": why})
            say(f"cluster {label}: skipped: {why}")
            report.write()
            continue
        limit = min(scale.limits["run"], report.left())
        say(f"cluster {label}: start (limit {limit:.0f} s)")
        for path in work_dir.glob("*.log"):  # each run's roles write their logs here afresh
            path.unlink()
        started = time.monotonic()
        try:
            with time_limit(limit):
                run = serve_once(model_dir, work_dir, planned, args, prompt, reference, startup_timeout_s=limit)
            run["status"] = "ok"
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a failed run is recorded; the next one still runs
            run = {
                "strategy": planned.strategy,
                "shadow_dtype": planned.shadow_dtype,
                "draft_tokens": planned.drafts,
                "status": "error",
                "error": error_text(exc),
            }
            # Where the check was, and where each role was: a role that was still alive wrote
            # its threads' stacks into its log as the cluster closed (LocalCluster.dump_stacks).
            run["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
            run["logs"] = {path.stem: log_tail(path, lines=120) for path in sorted(work_dir.glob("*.log"))}
        run["run"] = label
        run["seconds"] = round(time.monotonic() - started, 2)
        durations.append(run["seconds"])
        result["runs"].append(run)
        if run["status"] == "ok":
            say(
                f"cluster {label}: decode {run['decode_tok_s']:.2f} tok/s, TTFT {run['ttft_ms']:.0f} ms, "
                f"agreement {fmt_agreement(run['agreement'])}, {run['seconds']} s"
            )
        else:
            say(f"cluster {label}: error after {run['seconds']} s: {run['error']}")
        report.write()
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    full = next((r for r in ok if r["strategy"] == "full-cache"), None)
    for r in ok:
        r["decode_vs_full_cache"] = r["decode_tok_s"] / full["decode_tok_s"] if full and full["decode_tok_s"] else None
        plain = next(
            (p for p in ok if r.get("draft_tokens") and p["run"] == Run("odmoe", r["shadow_dtype"]).label), None
        )
        r["decode_vs_no_drafts"] = (
            r["decode_tok_s"] / plain["decode_tok_s"] if plain and plain["decode_tok_s"] else None
        )
    result["all_exact"] = bool(ok) and all(r["agreement"].get("exact") for r in ok)
    result["failed"] = [r["run"] for r in result["runs"] if r["status"] != "ok"]
    return result


def log_tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def odmoe_ceiling(data: dict, model: dict, workers: int) -> dict | None:
    """odmoe's copy-bound tok/s from the measured pinned bandwidth (``benchmarks.strategies.copy_bound``)."""
    copy = section_result(data["sections"], "copy")
    if not copy.get("pinned_gb_s"):
        return None
    nbytes = expert_nbytes(model, getattr(torch, model["dtype"]).itemsize)
    bound = copy_bound(model["layers"], model["top_k"], workers, nbytes, copy["pinned_gb_s"] * 1e9)
    return bound | {"expert_bytes": nbytes}


# --- Markdown ------------------------------------------------------------------------------------


def fmt(value: object, spec: str = ".2f", none: str = "–") -> str:
    if value is None:
        return none
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def fmt_agreement(a: dict) -> str:
    if a.get("exact") is None:
        return "–"
    return "exact" if a["exact"] else f"{a['matching']}/{a['of']} (first diff at {a['first_mismatch']})"


def cell(text: str, limit: int = 200) -> str:
    """``text`` on one line fit for a table cell: its first and last lines (a log's tail ends in the error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    short = " … ".join(lines[:1] + lines[1:][-1:])
    short = short.replace("|", "\\|")
    return short if len(short) <= limit else short[: limit - 1] + "…"


def fmt_bytes(value: int | None) -> str:
    return "–" if value is None else f"{value / GIB:.2f} GiB"


def section_result(sections: dict, name: str) -> dict:
    """A section's result, or an empty dict when it has none (skipped, failed or not run)."""
    return (sections.get(name) or {}).get("result") or {}


def markdown_heading(data: dict) -> list[str]:
    """The page's title and the versions it ran with."""
    v = data.get("versions") or {}
    return [
        f"# odmoe GPU check ({data.get('scale')} scale, {data.get('device')})",
        "",
        f"{data.get('started')}; torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"CUDA {v.get('cuda')}, driver {v.get('driver')}, pyzmq {v.get('pyzmq')}, "
        f"bitsandbytes {v.get('bitsandbytes')}; GPU {data.get('gpu_name') or '–'}",
        "",
    ]


def section_table(sections: dict, cluster: dict) -> list[str]:
    """The sections' table: each one's status, seconds and error or reason (the cluster's: its failed runs)."""
    lines = [
        "| section | status | seconds | note |",
        "|---|---|---:|---|",
    ]
    for name, entry in sections.items():
        note = entry.get("error") or entry.get("reason") or ""
        if name == "cluster" and cluster.get("failed"):
            note = f"failed: {', '.join(cluster['failed'])}"
        lines.append(f"| {name} | {entry.get('status')} | {fmt(entry.get('seconds'), '.1f')} | {cell(note)} |")
    return lines


def copy_line(copy: dict) -> str:
    """The host-to-device copy bandwidth, or why there is none."""
    if copy.get("reason"):
        return f"Host→device copy: {copy['reason']}"
    return (
        f"Host→device copy of {fmt(copy.get('bytes'), ',')} B on a side stream: pinned "
        f"{fmt(copy.get('pinned_gb_s'))} GB/s, pageable {fmt(copy.get('pageable_gb_s'))} GB/s "
        f"(median of {copy.get('repeats')}, CUDA events)"
    )


def staging_line(staging: dict) -> str:
    """The loader's copies of worker 0's experts from its RAM store and through its staging buffers."""
    ram, staged, one = staging["ram"], staging["disk_staged"], staging["disk_one_buffer"]
    return (
        f"The loader's copies of {staging['experts']} experts of {staging['expert_bytes']:,} B: from the "
        f"{'page-locked ' if staging['pinned'] else ''}RAM store {ram['ms_per_expert']:.2f} ms each "
        f"({ram['gb_s']:.2f} GB/s), from the disk store through {staging['slots']} staging buffers "
        f"{staged['ms_per_expert']:.2f} ms each ({staged['gb_s']:.2f} GB/s, {staged['staging_waits']} waits "
        f"for a buffer), through one buffer {one['ms_per_expert']:.2f} ms each ({one['staging_waits']} waits); "
        f"staged copies that differ from the store: {staged['mismatched_experts'] + one['mismatched_experts']}"
    )


def expert_line(expert: dict) -> str:
    """One expert's compute time at batch 1."""
    pipelined = expert.get("us_pipelined")
    return (
        f"One expert at batch 1 ({expert.get('dtype')}, hidden {expert.get('hidden')}, intermediate "
        f"{expert.get('intermediate')}): {fmt(expert.get('us_median'), '.1f')} µs median"
        + (f", {pipelined:.1f} µs back to back" if pipelined is not None else "")
        + f" ({fmt(expert.get('weights_gb_s'), '.3g')} GB/s of weights; {expert.get('timer')})"
    )


def nf4_line(nf4: dict) -> str:
    """How the CPU's nf4 data reads on the GPU, and whether the GPU quantizes to the same bytes."""
    return (
        f"nf4 quantized on the CPU, read on the GPU: dequantization equal {nf4['dequantize_equal']} "
        f"(max diff {nf4['dequantize_max_abs_diff']:.3g}), 4-bit matmul max diff "
        f"{nf4['matmul_4bit_max_abs_diff']:.3g} (outputs up to {nf4['matmul_output_max_abs']:.3g}), "
        f"batch-1 kernel max diff {nf4['matmul_4bit_kernel_max_abs_diff']:.3g} "
        f"(outputs up to {nf4['matmul_4bit_kernel_output_max_abs']:.3g}); "
        f"quantized on the GPU: same bytes {nf4['quantize_data_equal']}"
    )


def figure_lines(sections: dict, cluster: dict) -> list[str]:
    """A line for each device figure measured: the copies, the loader's, one expert, nf4 and odmoe's ceiling."""
    copy, staging = section_result(sections, "copy"), section_result(sections, "staging")
    expert, nf4 = section_result(sections, "expert"), section_result(sections, "nf4")
    lines = [copy_line(copy)] if copy else []
    if staging:
        lines.append(staging_line(staging))
    if expert:
        lines.append(expert_line(expert))
    if nf4:
        lines.append(nf4_line(nf4))
    if cluster.get("ceiling"):
        c = cluster["ceiling"]
        lines.append(
            f"odmoe's copy-bound ceiling at the measured pinned bandwidth: {c['tok_s']:.1f} tok/s "
            f"({c['loads_per_worker_per_token']:g} loads per worker per token at {c['load_ms']:.2f} ms)"
        )
    return lines


def run_row(r: dict) -> str:
    """One cluster run's row of the runs' table; a failed run's names its error."""
    if r.get("status") != "ok":
        return f"| {r['run']} | error: {cell(r.get('error', ''))} | | | | | | | |"
    memory = r["device_memory"].get("per_role_peak_bytes")
    per_role = (
        ", ".join(f"{k} {fmt_bytes(b)}" for k, b in memory.items()) if memory else r["device_memory"].get("reason", "")
    )
    return (
        f"| {r['run']} | {fmt(r['decode_tok_s'])} | {fmt(r.get('decode_vs_full_cache'))} | "
        f"{fmt(r['e2e_tok_s'])} | {fmt(r['ttft_ms'], '.0f')} | {fmt(r['recall'], '.1%')} | "
        f"{fmt_agreement(r['agreement'])} | {fmt(r['peak_expert_bytes_per_worker'], ',')} | {per_role} |"
    )


def run_table(cluster: dict) -> list[str]:
    """The cluster runs' table, one row a run; nothing when there were none."""
    if not cluster.get("runs"):
        return []
    return [
        "",
        f"Served on one device, {cluster.get('workers')} workers, {cluster.get('tokens')} new tokens:",
        "",
        "| run | decode tok/s | ÷ full cache | e2e tok/s | TTFT ms | recall | agreement "
        "| peak expert bytes / worker | peak device memory per role |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ] + [run_row(r) for r in cluster["runs"]]


def run_notes(cluster: dict) -> list[str]:
    """A note on each drafted run's drafts and on each skipped run's reason."""
    lines: list[str] = []
    for r in cluster.get("runs", []):
        d = r.get("drafts") if r.get("status") == "ok" else None
        if d:
            lines.append(
                f"\n{r['run']}: decode {fmt(r.get('decode_vs_no_drafts'))}× odmoe/{r['shadow_dtype']} without drafts; "
                f"{d['accepted']} of {d['drafted']} drafts kept over {d['passes']} passes, "
                f"{fmt(d['tokens_per_pass'])} tokens per decode pass, "
                f"{fmt(d['distinct_experts'])} distinct experts per layer per pass"
            )
    for s in cluster.get("skipped", []):
        lines.append(f"\nskipped {s['run']}: {s['reason']}")
    return lines


def markdown(data: dict) -> str:
    """The report as Markdown: the sections' table, the device's figures, the cluster runs and the total time."""
    sections = data.get("sections", {})
    lines = markdown_heading(data)
    cluster = section_result(sections, "cluster")
    lines += section_table(sections, cluster)
    lines.append("")
    lines += figure_lines(sections, cluster)
    lines += run_table(cluster)
    lines += run_notes(cluster)
    lines.append(f"\ntotal {fmt(data.get('total_seconds'), '.1f')} s")
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=default_device, help=f"default here: {default_device}")
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--json", type=Path, help="write the JSON here (and the Markdown beside it, as .md)")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table here")
    parser.add_argument("--tokens", type=int, help="new tokens per measured generation (default: by scale)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default: by scale)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes; every role shares the one device")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--shadow-dtypes", default=",".join(ODMOE_SHADOW_DTYPES), help="odmoe runs, one per dtype")
    parser.add_argument("--budget-s", type=float, help="the whole run's time limit (default: by scale)")
    parser.add_argument("--model", type=Path, help="serve this checkpoint instead of building one")
    parser.add_argument("--work-dir", type=Path, help="where the checkpoint and shards go (default: a temp dir)")
    parser.add_argument("--layers", type=int, help="decoder layers of the built checkpoint (default: by scale)")
    parser.add_argument(
        "--drafts",
        type=int,
        default=DEFAULT_DRAFTS,
        help=f"odmoe/bf16 again, the shadow drafting this many tokens a pass (default {DEFAULT_DRAFTS}; 0: none)",
    )
    roles.add_argument(parser)
    args = parser.parse_args(argv)
    scale = SCALES[args.scale]
    args.tokens = args.tokens or scale.tokens
    args.prompt_len = args.prompt_len or scale.prompt_len
    args.budget_s = args.budget_s or scale.budget_s
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.shadow_dtypes = [d for d in args.shadow_dtypes.split(",") if d]
    if set(args.strategies) - set(STRATEGIES):
        parser.error(f"unknown strategies {sorted(set(args.strategies) - set(STRATEGIES))}; known: {STRATEGIES}")
    if set(args.shadow_dtypes) - set(SHADOW_DTYPES):
        parser.error(f"unknown shadow dtypes {sorted(set(args.shadow_dtypes) - set(SHADOW_DTYPES))}")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if not 0 <= args.drafts <= MAX_DRAFT_TOKENS:
        parser.error(f"--drafts must lie in [0, {MAX_DRAFT_TOKENS}]")
    if args.json is not None and args.json.exists():
        parser.error(f"{args.json} exists: a recorded result is never rewritten; give this run a new file")
    if args.tokens < 2 or args.prompt_len < 2 or args.workers < 1:
        parser.error("--tokens and --prompt-len must be >= 2 and --workers >= 1")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.markdown is None and args.json is not None:
        args.markdown = args.json.with_suffix(".md")
    return args


def start_report(args: argparse.Namespace, model: dict, started: float) -> Report:
    """The run's report before any section: what was asked for, and where and from what code it runs."""
    report = Report(args.json, args.markdown, deadline=started + args.budget_s)
    report.data = {
        "format": FORMAT,
        "roles": roles.kind(args),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "scale": args.scale,
        "device": args.device,
        "budget_s": args.budget_s,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": model,
        "versions": None,
        "gpu_name": None,
        "sections": {},
        "total_seconds": None,
    }
    begun = report.data["started"]
    report.data |= provenance.record(begun, "torch", "transformers")  # command, commit, dirty, machine...
    report.data["code"] = substance.code_record(DEPENDS_ON)  # what a later change stales it by
    return report


def device_sections(report: Report, device: torch.device, model: dict, scale: Scale) -> None:
    """Sections 1 to 3: the device's facts, its copy bandwidth, one expert's compute and nf4 across devices."""
    facts = run_section(report, "facts", scale.limits["facts"], lambda: device_facts(device))
    if facts:
        report.data["versions"] = facts["versions"]
        report.data["gpu_name"] = (facts.get("gpu") or {}).get("name")
        report.data["machine"]["gpu"] = report.data["gpu_name"] or NO_DEVICE.format(device=device)
    itemsize = getattr(torch, model["dtype"]).itemsize
    run_section(
        report,
        "copy",
        scale.limits["copy"],
        lambda: copy_bandwidth(device, expert_nbytes(model, itemsize), scale.copy_repeats),
    )
    run_section(report, "expert", scale.limits["expert"], lambda: expert_compute(device, model, scale.expert_repeats))
    run_section(report, "nf4", scale.limits["nf4"], lambda: nf4_across_devices(device))


def checkpoint_sections(
    report: Report, args: argparse.Namespace, scale: Scale, device: torch.device, model_dir: Path, cluster_dir: Path
) -> tuple[list[int], dict | None]:
    """Sections on a checkpoint: its role shards, worker 0's staged copies and the reference; (prompt, reference)."""
    run_section(
        report,
        "shards",
        scale.limits["shards"],
        lambda: build_role_shards(model_dir, cluster_dir / "shards", args.workers),
    )
    run_section(
        report,
        "staging",
        scale.limits["staging"],
        lambda: staged_copies(device, cluster_dir / "shards" / "worker-0", DeploymentSettings.staging_buffers),
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = prompt_of(args.prompt_len, vocab, seed=0)
    reference = run_section(
        report,
        "reference",
        scale.limits["reference"],
        lambda: reference_tokens(model_dir, prompt, args.tokens, device),
    )
    return prompt, reference


def served_sections(
    report: Report, args: argparse.Namespace, scale: Scale, model: dict, device: torch.device, work_dir: Path
) -> None:
    """Sections 4 to 6 in ``work_dir``: the checkpoint, what is made of it, and the cluster serving it."""
    model_dir = args.model or work_dir / "model"
    if args.model:
        checkpoint = run_section(
            report, "checkpoint", scale.limits["checkpoint"], lambda: existing_checkpoint(model_dir)
        )
    else:
        checkpoint = run_section(
            report, "checkpoint", scale.limits["checkpoint"], lambda: build_checkpoint(model_dir, model)
        )
    cluster_dir = work_dir / "cluster"
    reference = None
    if checkpoint:
        prompt, reference = checkpoint_sections(report, args, scale, device, model_dir, cluster_dir)
    else:
        for name in ("shards", "staging", "reference"):
            report.data["sections"][name] = {"status": "skipped", "reason": "no checkpoint"}

    def cluster() -> dict:
        if not checkpoint:
            raise Skipped("no checkpoint (the checkpoint section failed)")
        result = serve_all(
            report,
            model_dir,
            cluster_dir,
            args,
            scale,
            prompt,
            reference["token_ids"] if reference else None,
        )
        result["ceiling"] = odmoe_ceiling(report.data, model, args.workers) if not args.model else None
        return result

    # Each run carries its own time limit; the section's is only the rest of the budget.
    run_section(report, "cluster", report.left() + 1, cluster)


def exit_status(data: dict) -> int:
    """1 when a section or a cluster run failed, else 0."""
    statuses = [entry.get("status") for entry in data["sections"].values()]
    failed_runs = section_result(data["sections"], "cluster").get("failed")
    return 1 if "error" in statuses or failed_runs else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = SCALES[args.scale]
    model = dict(scale.model) | ({"layers": args.layers} if args.layers else {})
    device = torch.device(args.device)
    started = time.monotonic()
    report = start_report(args, model, started)
    say(f"{args.scale} scale on {args.device}, budget {args.budget_s:.0f} s, output {args.json}")
    if device.type == "cuda" and not torch.cuda.is_available():
        say(f"{args.device} was asked for but CUDA is not available here")

    device_sections(report, device, model, scale)

    own_work_dir = args.work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="odmoe-gpu-check-")) if own_work_dir else args.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        served_sections(report, args, scale, model, device, work_dir)
    finally:
        if own_work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        report.data["total_seconds"] = round(time.monotonic() - started, 2)
        report.data["ended"] = provenance.now()
        report.write()
    say(f"done in {report.data['total_seconds']} s")
    print(markdown(report.data), flush=True)
    return exit_status(report.data)


if __name__ == "__main__":
    raise SystemExit(main())
