"""Coordination cost per decode layer on loopback: what the experts' round trip costs beyond the experts.

    python -m benchmarks.overhead [--model DIR] [--workers 1] [--new-tokens 64] [--json OUT]

For every decode layer main records its expert round trip (``dispatch_ms``: split the
routed rows, send them, wait, put the answers back) and the busiest worker reports its own
load wait + compute (``worker_ms``); the rest, ``dispatch_ms - worker_ms``, is the
*coordination cost*: message hops, (de)serialization and scheduling. This benchmark reports
its median and p90 over every decode layer of several greedy generations.

The measured setup gives each process a core to itself, as separate boxes would: main and
``--workers`` workers (default 1) and no shadow, a tiny random Mixtral unless ``--model``
is given, one torch thread per role. A full cluster (main, shadow, 8 workers) on a small
machine mostly measures CPU contention between its processes (the shadow computes while
main waits), which separate boxes do not have; its figure is printed too, for context only
(``--no-full`` skips it).

The figure is then broken down where it can be, at the same message sizes: main's routing
split, request build + encode, result decode and scatter + combine; the worker's request
decode and result build + encode (each timed in this process, median of many calls); the
round trip of the same messages through two ``Endpoint`` processes (protocol + transport,
no routing or compute); and the raw ZeroMQ round trip of same-size frames between two
processes, the floor any design over ZeroMQ on TCP pays: back to back, and in the measured
cluster's rhythm (the echo computes as long as the worker did, the sender as long as main
does between layers), since a process that computed or slept a while wakes up slower.

"Each process has a core to itself" holds only if nothing else runs on the machine: the
load average before and after is printed, and on a shared machine every figure is higher.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from benchmarks import provenance, substance
from inference.modelio.families import family_for
from inference.policies.depth import LINK_DEPTH
from inference.runtime.curve import EndpointKeys, new_seat_keys, role_keys
from inference.runtime.launcher import ClusterOptions, LocalCluster, free_port
from inference.runtime.metrics import BREAKDOWN, HOPS_SPLIT
from inference.runtime.protocol import decode, encode
from inference.runtime.routing import Routing
from inference.runtime.spec import DeploymentSettings
from inference.runtime.transport import Endpoint
from inference.tools.tiny import make_tiny
from inference.wire.generation import Token
from inference.wire.runtime import ExpertRequest, ExpertResult

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200, 300, 17, 23], [1, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
ACCEPTANCE_MS = 0.3
DEPLOYMENT = "overhead-bench"


@dataclass(frozen=True)
class Shape:
    """What one decode layer moves: ``top_k`` rows of ``hidden`` floats to one worker and back."""

    hidden: int
    top_k: int
    experts: int


# --- the cluster measurement -----------------------------------------------------------------


def layer_samples(reports: list[dict]) -> list[tuple[float, float]]:
    """(dispatch_ms, worker_ms) of every decode layer in ``Token`` step reports."""
    samples = []
    for report in reports:
        if report is None or report["step"] == 0:
            continue
        samples.extend((layer["dispatch_ms"], layer["worker_ms"]) for layer in report["layers"])
    return samples


def layer_parts_ms(reports: list[dict]) -> dict[str, list[float]]:
    """Per part of the round trip (`inference.runtime.metrics.BREAKDOWN`, then the hops' split,
    `HOPS_SPLIT`), its ms in every decode layer."""
    parts: dict[str, list[float]] = {name: [] for name in (*BREAKDOWN, *HOPS_SPLIT)}
    for report in reports:
        if report is None or report["step"] == 0:
            continue
        for layer in report["layers"]:
            for name in BREAKDOWN:
                parts[name].append(layer["breakdown_ms"][name])
            for name in HOPS_SPLIT:
                parts[name].append(layer["hops_split_ms"][name])
    return parts


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; ``values`` need not be sorted."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(samples: list[tuple[float, float]]) -> dict:
    coordination = [max(0.0, d - w) for d, w in samples]
    dispatch = [d for d, _ in samples]
    worker = [w for _, w in samples]
    return {
        "layers": len(samples),
        "coordination_ms_median": statistics.median(coordination),
        "coordination_ms_p90": percentile(coordination, 0.9),
        "dispatch_ms_median": statistics.median(dispatch),
        "worker_ms_median": statistics.median(worker),
    }


def run_cluster(model_dir: Path, *, workers: int, shadow: bool, new_tokens: int, prompts: list[list[int]]) -> dict:
    """Generate greedily on a local cluster and summarize its decode layers."""
    # The link's two slots whatever the group's size, as every recorded run held (inference.policies.depth).
    settings = DeploymentSettings(threads=1, max_resident_experts=LINK_DEPTH)
    options = ClusterOptions(workers=workers, shadow=shadow, settings=settings)
    reports: list[dict] = []
    # Main's time per layer outside the round trips, per generation (from its token intervals).
    gaps: list[float] = []
    with LocalCluster(model_dir, options) as cluster:
        assert cluster.client is not None
        cluster.generate(prompts[0], 4)  # warm-up: first-call allocations in every process
        for prompt in prompts:
            for event in cluster.client.stream(prompt, new_tokens, idle=cluster.check_processes):
                if isinstance(event, Token):
                    reports.append(event.step)  # type: ignore[arg-type]
                elif event.metrics.get("decode_main_between_layers_ms_median") is not None:
                    gaps.append(event.metrics["decode_main_between_layers_ms_median"])
    summary = summarize(layer_samples(reports))
    parts = layer_parts_ms(reports)
    summary.update(
        parts_ms_median={name: statistics.median(v) if v else None for name, v in parts.items()},
        parts_ms_p90={name: percentile(v, 0.9) if v else None for name, v in parts.items()},
        workers=workers,
        shadow=shadow,
        processes=workers + 1 + shadow,
        main_ms_between_layers_median=statistics.median(gaps) if gaps else 0.0,
    )
    return summary


# --- the breakdown, timed in this process -----------------------------------------------------


def time_us(fn: Callable[[], Any], iterations: int) -> float:
    """Median microseconds per call of ``fn`` (after a few warm-up calls)."""
    for _ in range(min(20, iterations)):
        fn()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sample_messages(shape: Shape) -> tuple[ExpertRequest, ExpertResult]:
    """A decode layer's request to one worker (every routed expert) and its answer."""
    experts = list(range(shape.top_k))
    request = ExpertRequest(
        request_id="r" * 12,
        step=7,
        layer=3,
        experts=experts,
        counts=[1] * shape.top_k,
        offsets=[0] * shape.top_k,
        rows=torch.randn(shape.top_k, shape.hidden),
        weights=torch.rand(shape.top_k),
    )
    result = ExpertResult(
        **request.segments(),
        output=torch.randn(shape.top_k, shape.hidden),
        wait_ms=0.01,
        compute_ms=0.05,
        hits=shape.top_k,
        misses=0,
    )
    return request, result


def stamp(msg: Any) -> list:
    return encode(msg, deployment=DEPLOYMENT, sender="main", seq=1)


def _as_received(frames: list) -> list[zmq.Frame]:
    return [zmq.Frame(bytes(f)) for f in frames]


def component_times(shape: Shape, iterations: int) -> dict[str, float]:
    """Microseconds of each per-layer step main and the worker run outside the experts."""
    torch.set_num_threads(1)
    routing = Routing("grouped")
    hidden = torch.randn(1, shape.hidden)
    index = torch.randperm(shape.experts)[: shape.top_k].reshape(1, shape.top_k)
    weights = torch.softmax(torch.randn(1, shape.top_k), dim=-1)
    routed = routing.split(hidden, index, weights)
    request, result = sample_messages(shape)
    result = msgspec.structs.replace(
        result, experts=list(routed.experts), counts=[routed.count(e) for e in routed.experts]
    )
    request_frames = _as_received(stamp(request))
    result_frames = _as_received(stamp(result))
    outputs = {e: torch.randn(routed.count(e), shape.hidden) for e in routed.experts}

    def build_and_encode_request() -> list:
        segments = [(e, 0, routed.count(e)) for e in routed.experts]
        msg = ExpertRequest(
            request_id="r" * 12,
            step=7,
            layer=3,
            experts=[e for e, _, _ in segments],
            counts=[n for _, _, n in segments],
            offsets=[o for _, o, _ in segments],
            rows=torch.cat([routed.rows[e][o : o + n] for e, o, n in segments]),
            weights=torch.cat([routed.weights[e][o : o + n] for e, o, n in segments]),
        )
        return stamp(msg)

    def scatter_and_combine() -> torch.Tensor:
        got = decode(result_frames)
        scattered = {e: torch.empty_like(routed.rows[e]) for e in routed.experts}
        start = 0
        for expert, count, offset in zip(got.experts, got.counts, got.offsets, strict=True):
            scattered[expert][offset : offset + count] = got.output[start : start + count]
            start += count
        return routing.combine(routed, outputs, torch.float32)

    return {
        "main: routing split": time_us(lambda: routing.split(hidden, index, weights), iterations),
        "main: build + encode request": time_us(build_and_encode_request, iterations),
        "main: decode result": time_us(lambda: decode(result_frames), iterations),
        "main: decode + scatter + combine": time_us(scatter_and_combine, iterations),
        "worker: decode request": time_us(lambda: decode(request_frames), iterations),
        "worker: build + encode result": time_us(lambda: stamp(result), iterations),
    }


# --- two-process round trips ----------------------------------------------------------------


def busy(seconds: float) -> None:
    """Keep the CPU busy for ``seconds``, as computing would (a sleep would let the core idle)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _raw_echo(address: str, reply: list[bytes], count: int, compute_s: float) -> None:
    """A ROUTER that answers each of ``count`` messages with ``reply`` (raw frames, no decoding),
    after ``compute_s`` of busy CPU."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    for _ in range(count):
        frames = sock.recv_multipart(copy=False)
        busy(compute_s)
        sock.send_multipart([frames[0], *reply], copy=False)
    sock.close()


def _endpoint_echo(address: str, hidden: int, top_k: int, count: int, keys: EndpointKeys) -> None:
    """An Endpoint that decodes each request and answers with an ``ExpertResult`` of its rows."""
    torch.set_num_threads(1)
    endpoint = Endpoint("worker-0", DEPLOYMENT, bind=address, curve=keys)
    _, result = sample_messages(Shape(hidden, top_k, top_k))
    served = 0
    while served < count:
        received = endpoint.recv(timeout_s=30.0)
        if received is None:
            break
        msg = received.msg
        assert isinstance(msg, ExpertRequest) and msg.rows is not None
        answer = ExpertResult(
            **msg.segments(),
            output=msg.rows,
            wait_ms=result.wait_ms,
            compute_ms=result.compute_ms,
            hits=result.hits,
            misses=result.misses,
        )
        endpoint.reply(received.identity, answer)
        served += 1
    endpoint.close(linger_ms=1000)


def raw_round_trip_us(shape: Shape, iterations: int, *, compute_s: float = 0.0, gap_s: float = 0.0) -> float:
    """Median round trip of same-size frames DEALER -> ROUTER -> DEALER between two processes.

    With ``compute_s`` the echo computes (busy CPU) that long before answering, and with
    ``gap_s`` the sender computes that long between round trips; both are subtracted, so
    what is left is what ZeroMQ costs in that rhythm: a process that has computed or waited
    a while wakes up slower than one in a tight ping-pong loop.
    """
    request, result = sample_messages(shape)
    request_frames = [bytes(f) for f in stamp(request)]
    reply_frames = [bytes(f) for f in stamp(result)]
    address = f"tcp://127.0.0.1:{free_port()}"
    warm = min(50, iterations)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_raw_echo, args=(address, reply_frames, iterations + warm, compute_s), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        times = []
        for i in range(iterations + warm):
            busy(gap_s)
            start = time.perf_counter()
            sock.send_multipart(request_frames, copy=False)
            sock.recv_multipart(copy=False)
            if i >= warm:
                times.append(time.perf_counter() - start - compute_s)
    finally:
        sock.close(0)
        proc.join(10)
    return statistics.median(times) * 1e6


def endpoint_round_trip_us(shape: Shape, iterations: int) -> float:
    """Median round trip of an ``ExpertRequest`` and its ``ExpertResult`` through two Endpoints."""
    request, _ = sample_messages(shape)
    address = f"tcp://127.0.0.1:{free_port()}"
    warm = min(50, iterations)
    ctx = multiprocessing.get_context("spawn")
    seats = new_seat_keys(["main", "worker-0"])  # CURVE and every message's checks, as every data plane runs
    proc = ctx.Process(
        target=_endpoint_echo,
        args=(address, shape.hidden, shape.top_k, iterations + warm, role_keys("worker-0", seats)),
        daemon=True,
    )
    proc.start()
    endpoint = Endpoint("main", DEPLOYMENT, curve=role_keys("main", seats))
    endpoint.connect("worker-0", address)
    try:
        times = []
        for i in range(iterations + warm):
            start = time.perf_counter()
            endpoint.send("worker-0", request)
            received = endpoint.recv(timeout_s=30.0)
            if received is None:
                raise RuntimeError("the echo endpoint did not answer")
            if i >= warm:
                times.append(time.perf_counter() - start)
    finally:
        endpoint.close()
        proc.join(10)
    return statistics.median(times) * 1e6


# --- report --------------------------------------------------------------------------------


def read_shape(model_dir: Path) -> Shape:
    config = json.loads((model_dir / "config.json").read_text())
    experts = family_for(config).n_experts(config)
    return Shape(config["hidden_size"], config["num_experts_per_tok"], experts)


def measure(model_dir: Path, *, workers: int, new_tokens: int, full: bool, full_tokens: int, iterations: int) -> dict:
    shape = read_shape(model_dir)
    load_before = os.getloadavg()[0]
    measured = run_cluster(model_dir, workers=workers, shadow=False, new_tokens=new_tokens, prompts=PROMPTS)
    breakdown = component_times(shape, iterations)
    figures: dict[str, Any] = {
        "setup": (
            f"main + {workers} worker(s), no shadow, 1 torch thread per role, {os.cpu_count()} CPU cores, "
            f"tcp on 127.0.0.1"
        ),
        "shape": {"hidden": shape.hidden, "top_k": shape.top_k, "experts": shape.experts},
        "measured": measured,
        "breakdown_us": breakdown,
        "endpoint_round_trip_us": endpoint_round_trip_us(shape, iterations),
        "raw_zmq_round_trip_us": raw_round_trip_us(shape, iterations),
        "raw_zmq_round_trip_in_rhythm_us": raw_round_trip_us(
            shape,
            min(iterations, 500),
            compute_s=measured["worker_ms_median"] / 1000,
            gap_s=measured["main_ms_between_layers_median"] / 1000,
        ),
        "acceptance_ms": ACCEPTANCE_MS,
        "passes": measured["coordination_ms_median"] <= ACCEPTANCE_MS,
        "oversubscribed": workers + 1 > (os.cpu_count() or 1),
        "load_average": [load_before, os.getloadavg()[0]],
    }
    if full:
        figures["full_cluster"] = run_cluster(
            model_dir, workers=8, shadow=True, new_tokens=full_tokens, prompts=PROMPTS[:1]
        )
    return figures


PART_NAMES = {
    "main_before_send": "main: routing split, plan, build + encode + send the requests",
    "hops": "hops both ways: framing and decoding, CURVE, ZeroMQ, wake-ups, both receive loops",
    "worker_python": "worker: its own Python around the load wait + compute",
    "worker_busy": "worker: load wait + compute",
    "main_after_answers": "main: scatter + combine the answers",
    "receiving": "... of the hops, in the receiving processes: decoding, other messages first (both sides)",
    "between_sockets": "... of the hops, between the sockets: encryption, ZeroMQ, the kernel, wake-ups",
}


def render(figures: dict) -> str:
    m = figures["measured"]
    lines = [
        f"Measured setup: {figures['setup']}; {m['layers']} decode layers.",
        "Each process has a core to itself, as on separate boxes."
        if not figures["oversubscribed"]
        else "WARNING: more processes than cores; the figure includes CPU contention.",
        "1-minute load average before / after the measurement: {:.2f} / {:.2f} (other load inflates every "
        "figure)".format(*figures["load_average"]),
        "",
        "| per decode layer | median (ms) | p90 (ms) |",
        "|---|---:|---:|",
        f"| coordination = round trip - busiest worker | {m['coordination_ms_median']:.3f} | "
        f"{m['coordination_ms_p90']:.3f} |",
        f"| main's expert round trip (dispatch) | {m['dispatch_ms_median']:.3f} | |",
        f"| busiest worker: load wait + compute | {m['worker_ms_median']:.3f} | |",
        "",
        "| the round trip in the cluster, by part (main's clock; the worker's parts are those of the worker "
        "main waited for last) | median (ms) |",
        "|---|---:|",
    ]
    parts = m["parts_ms_median"]
    order = [n for name in BREAKDOWN for n in ((name, *HOPS_SPLIT) if name == "hops" else (name,))]
    lines += [f"| {PART_NAMES[name]} | {parts[name]:.3f} |" for name in order if parts.get(name) is not None]
    lines += [
        "",
        "| breakdown (same message sizes, each timed alone in a tight loop) | median (µs) |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {us:.1f} |" for name, us in figures["breakdown_us"].items()]
    lines += [
        f"| round trip through two Endpoint processes (protocol + transport) | "
        f"{figures['endpoint_round_trip_us']:.1f} |",
        f"| raw ZeroMQ round trip, same-size frames, two processes, back to back (floor) | "
        f"{figures['raw_zmq_round_trip_us']:.1f} |",
        f"| ... the same in the cluster's rhythm: the echo computes {m['worker_ms_median']:.3f} ms, the sender "
        f"{m['main_ms_between_layers_median']:.3f} ms between layers (floor of the measured setup) | "
        f"{figures['raw_zmq_round_trip_in_rhythm_us']:.1f} |",
        "",
        f"acceptance: median coordination <= {figures['acceptance_ms']} ms per layer: "
        f"{'PASS' if figures['passes'] else 'FAIL'}",
    ]
    full = figures.get("full_cluster")
    if full:
        lines += [
            "",
            f"For context, the full cluster on this machine (main + shadow + {full['workers']} workers = "
            f"{full['processes']} processes on {os.cpu_count()} cores, mostly CPU contention): coordination "
            f"median {full['coordination_ms_median']:.3f} ms, p90 {full['coordination_ms_p90']:.3f} ms per layer "
            f"({full['layers']} decode layers).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Mixtral checkpoint directory (default: a tiny random one)")
    parser.add_argument("--workers", type=int, default=1, help="workers in the measured setup (default 1)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=2000, help="repetitions of each timed step")
    parser.add_argument("--no-full", dest="full", action="store_false", help="skip the full-cluster context run")
    parser.add_argument("--full-tokens", type=int, default=32, help="new tokens of the full-cluster run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    with tempfile.TemporaryDirectory(prefix="odmoe-overhead-") as tmp:
        model_dir = args.model or make_tiny(Path(tmp) / "model", seed=0)
        figures = measure(
            model_dir,
            workers=args.workers,
            new_tokens=args.new_tokens,
            full=args.full,
            full_tokens=args.full_tokens,
            iterations=args.iterations,
        )
    print(render(figures))
    if args.json:
        provenance.write(args.json, figures, begun, "torch", "pyzmq", "msgspec", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
