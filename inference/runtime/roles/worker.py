"""The worker role: keep owned experts in host memory or on disk, load the predicted ones just in time.

Predictions (from the shadow, or from main's next-layer router under ``lru-offload``)
queue loads; main's requests name the experts really routed to this worker, whose rows
are computed as soon as each expert is on the device, after which it is freed — or kept
in the device cache under a caching strategy (``inference.policies.strategies``). Stale prefetches
(a layer already served, a wrong prediction) are dropped when main's request for that
layer shows what was really needed. With hybrid execution (``Settings.hybrid``,
``inference.policies.hybrid``) an expert whose copy would finish later than the worker's CPU could
compute it from host memory runs on the CPU instead, beside the device's experts; under a
cacheless strategy that loads ahead, a planned share of the group's (step, layer)s is not
copied at all and runs on the CPUs when main's request comes (``planned_on_cpu``), the share
found from the decode tokens' periods main stamps on its requests (``ShareController``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import torch

from inference.modelio.shards import verify_shard
from inference.policies.depth import resolve_depth
from inference.policies.hybrid import (
    HostRates,
    ShareController,
    cpu_seconds,
    expert_flops,
    planned_on_cpu,
    predicted_share,
    share_delay,
    split,
)
from inference.policies.placement import placement_from_dict
from inference.policies.strategies import (
    expert_store_for,
    get_strategy,
    home_experts,
    prefetch_on_prediction,
    prefill_prefetch,
)
from inference.runtime.cache import DeviceCache
from inference.runtime.experts import activation, expert_forward
from inference.runtime.loader import ExpertLoader, Key, Resident, measure_host_rates
from inference.runtime.roles.common import answer_ping, handle_safely, open_endpoint, release_free_heap, setup_process
from inference.runtime.spec import RoleSpec, compute_dtype
from inference.runtime.store import HotSetStore, open_store
from inference.runtime.transport import Received
from inference.wire.runtime import (
    Begin,
    End,
    ExpertRequest,
    ExpertResult,
    Prediction,
    SequenceJoin,
    SequenceLeave,
    Shutdown,
    WorkerStats,
)

log = logging.getLogger(__name__)

MAX_JOINED = 1024  # sequences of one session a worker remembers (main runs far fewer at once)
# (step, layer) pairs with predictions not yet served: the shadow runs a few steps ahead, a
# chunked prefill's pieces some more; beyond this it is a peer flooding the worker.
MAX_PREDICTED = 16384


def session_step(source: str, step: int, session: str, joined: dict[str, int]) -> int | None:
    """The session step a prediction from ``source`` for its ``step`` is for, or None: main's
    own guesses come in session steps, the shadow's in a joined sequence's steps; with no
    session running (a late one for a session that ended, or a peer's stray) it is for none."""
    if not session:
        return None
    if source == session:
        return step
    if source in joined:
        return joined[source] + step
    return None


def received_ms(ready_at: float, answered_at: float, now: float) -> float:
    """A request's time at this worker before its handling (ms, ``time.monotonic()`` seconds in):
    from when it was there (``ready_at``, `Received`) or, if later, when the worker sent its
    previous answer, to ``now``. The previous request's handling is in that answer's
    ``handled_ms``; counting it here again would count it twice in main's hops. 0 without a time."""
    if not ready_at:
        return 0.0
    return max(0.0, now - max(ready_at, answered_at)) * 1000


class WorkerRole:
    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec
        self.device = setup_process(spec)
        manifest = verify_shard(spec.shard_dir, expect_role="worker", expect_worker=spec.worker)
        self.index: int = spec.worker  # type: ignore[assignment]
        self.placement = placement_from_dict(manifest["placement"])
        if self.placement.n_workers != len(spec.addresses.workers):
            raise RuntimeError(
                f"shard was built for {self.placement.n_workers} workers, the peer table has "
                f"{len(spec.addresses.workers)}"
            )
        self.members = self.placement.groups[self.placement.group_of_worker(self.index)]
        self.group_layers = self.placement.decode_layers(self.index)
        self.decode_layers = set(self.group_layers)
        config = _read_config(spec.shard_dir)
        self.act_fn = activation(config.get("hidden_act", "silu"))
        self.store_kind = expert_store_for(spec.settings.strategy, spec.settings.expert_store)
        on_gpu = self.device.type == "cuda"
        # The "ram" store is page-locked where it lies and a "hot" one's experts are pinned as
        # they are read (a hit is then copied with no memcpy first), both copied from directly; a
        # "disk" store's are read into the loader's rotating pinned staging buffers on their way.
        staged = on_gpu and self.store_kind == "disk"
        self.store = open_store(
            self.store_kind,
            spec.shard_dir,
            pin=on_gpu and not staged,
            verify=False,  # verified just above, with this worker's identity
            read_bytes_per_s=spec.settings.disk_bytes_per_s,
            dtype=compute_dtype(spec.settings.dtype, config),
            hot_experts=spec.settings.hot_experts,
        )
        release_free_heap()
        # A hot store keeps predicted experts in RAM (pins) and counts its disk reads.
        self.hot = self.store if isinstance(self.store, HotSetStore) else None
        self.store_keys = self.store.keys()
        self.hidden = int(config["hidden_size"])
        any_key = next(iter(self.store_keys))
        self.expert_bytes = self.store.nbytes(*any_key)
        self.strategy = get_strategy(spec.settings.strategy)
        cache = {"all": DeviceCache(None), "lru": DeviceCache(spec.settings.cache_experts)}.get(self.strategy.cache)
        self.loader = ExpertLoader(
            self.store,
            self.device,
            max_resident=resolve_depth(spec.settings.max_resident_experts, self.placement.top_k, len(self.members)),
            copy_bytes_per_s=spec.settings.copy_bytes_per_s,
            cache=cache,
            staging_slots=spec.settings.staging_buffers if staged else 0,
        )
        if self.strategy.cache == "all":
            self.loader.preload(home_experts(self.placement, self.index))
        self.intermediate = int(self.store.get(*any_key).down.shape[1])  # down is [H, I]
        self.rates = self._host_rates() if spec.settings.hybrid else None
        # The host CPU's own queue of experts: one thread, beside the device's work on this one.
        self.host = ThreadPoolExecutor(1, thread_name_prefix="host-experts") if self.rates else None
        self.cpu_experts = 0  # experts of this session computed on the CPU
        # Of the group's (step, layer)s, the share whose predicted experts are left uncopied and
        # computed on the CPUs (hybrid execution under a cacheless strategy that loads ahead),
        # found from the decode tokens' periods main stamps on its requests: the session step of
        # the last token's first request to the group.
        self.share_control = self._share_control()
        self.token_mark: int | None = None
        # Per planned (session step, layer): the predicted experts this worker would have loaded.
        self.planned: dict[tuple[int, int], set[int]] = {}
        self.endpoint = open_endpoint(spec)
        self.request_id = ""  # main's session: one or more sequences batched, in lockstep
        self.joined: dict[str, int] = {}  # a sequence of the session -> the session step of its prefill
        # The first session step of the session's one sequence: once others have left, the step
        # from which every worker of the group knows it (``on_leave``); 0 before any left.
        self.alone_from = 0
        # Per (session step, layer), what each source predicted (main, or the shadow per sequence).
        self.predicted: dict[tuple[int, int], dict[str, list[int]]] = {}
        self.flooded = 0  # predictions dropped this session because too many layers ahead were predicted
        self.served: tuple[int, int] = (-1, -1)  # the last (step, layer) main asked for
        self.held: dict[Key, Resident] = {}  # experts on the device until the layer's final request
        self.answered_at = 0.0  # when the last answer left (time.monotonic()): `received_ms`
        # A hot store's pins (inference.policies.hotset): per (session step, layer), the predicted experts
        # it keeps in RAM until main has served that layer.
        self.pins: dict[tuple[int, int], set[int]] = {}
        self.store_counts_at_begin = (0, 0)  # a hot store's (reads, hits) when the session began
        log.info(
            "worker %d ready: %d experts (%s store) on %s, decode layers %s, strategy %s (%d on the device)",
            self.index,
            len(self.store.keys()),
            self.store_kind,
            self.device,
            sorted(self.decode_layers),
            self.strategy.name,
            len(cache) if cache is not None else 0,
        )

    def run(self) -> None:
        try:
            while True:
                received = self.endpoint.recv(timeout_s=1.0)
                if received is None:
                    continue
                if isinstance(received.msg, Shutdown):
                    return
                handle_safely(self.handle, received)
        finally:
            if self.host is not None:
                self.host.shutdown(wait=True)
            self.loader.close()
            self.endpoint.close()

    def handle(self, received: Received) -> None:
        msg = received.msg
        if answer_ping(self.endpoint, received, self.spec.name, ready=True):
            return
        if isinstance(msg, Begin):
            self.begin(msg)
        elif isinstance(msg, SequenceJoin):
            self.on_join(msg)
        elif isinstance(msg, SequenceLeave):
            self.on_leave(msg)
        elif isinstance(msg, Prediction):
            self.on_prediction(msg)
        elif isinstance(msg, ExpertRequest):
            self.on_request(msg, received.identity, received.ready_at)
        elif isinstance(msg, End):
            self.end(msg, received.identity)
        else:
            log.warning("dropped unexpected %s from %s", msg.TYPE, msg.sender)

    def begin(self, msg: Begin) -> None:
        self._release_held()
        self.loader.discard(lambda key: False)
        self.loader.reset_stats()
        self.store_counts_at_begin = self._store_counts()
        self.cpu_experts = 0
        self.request_id = msg.request_id
        self._forget_session()
        self.served = (-1, -1)
        for layer, expert in prefill_prefetch(self.strategy, self.placement, self.index):
            self.loader.prefetch((0, layer, expert))

    def on_join(self, msg: SequenceJoin) -> None:
        if msg.request_id != self.request_id or msg.first_step < 0:
            return
        if len(self.joined) >= MAX_JOINED and msg.sequence not in self.joined:
            self.joined.pop(next(iter(self.joined)))  # the oldest: long gone, or a peer flooding us
        self.joined[msg.sequence] = msg.first_step

    def on_leave(self, msg: SequenceLeave) -> None:
        """A sequence left, the session goes on: its predictions are dropped, and with one sequence
        left the group may plan layers on its CPUs again, from a step every worker of it agrees
        on. Main sends the leave before its next step, as it would a share's period, so by the
        step ``share_delay`` gives after the last no worker has planned a later one as batched."""
        if msg.request_id != self.request_id or msg.sequence not in self.joined or msg.last_step < 0:
            return
        del self.joined[msg.sequence]
        for sources in self.predicted.values():
            sources.pop(msg.sequence, None)  # a sequence that stopped early: its shadow ran on
        if len(self.joined) == 1:
            self.alone_from = max(self.alone_from, msg.last_step + share_delay(self.spec.settings.lookahead))
            if self.share_control is not None:
                log.info("worker %d: one sequence again, planned from session step %d", self.index, self.alone_from)

    def on_prediction(self, msg: Prediction) -> None:
        """Load ahead what the batch's predictions for a layer name together.

        Main's own guesses come in session steps; the shadow's per sequence, in the
        sequence's steps, which its join places in the session.
        """
        step = session_step(msg.request_id, msg.step, self.request_id, self.joined)
        if step is None:
            return
        if msg.layer not in self.decode_layers or (step, msg.layer) <= self.served:
            return  # not a layer of ours, or main has already served it: the prediction came too late
        if any((msg.layer, e) not in self.store_keys for e in msg.experts):
            log.warning("dropped a prediction for layer %d naming experts this worker lacks", msg.layer)
            return
        if (step, msg.layer) not in self.predicted and len(self.predicted) >= MAX_PREDICTED:
            self.flooded += 1
            if self.flooded == 1:  # once per session: a flooding peer must not flood the log too
                log.warning("dropping predictions beyond %d predicted layers ahead (a peer flooding?)", MAX_PREDICTED)
            return
        sources = self.predicted.setdefault((step, msg.layer), {})
        sources[msg.request_id] = msg.experts  # a newer prediction from the same source replaces its older one
        union = sorted(set().union(*sources.values()))
        mine = set(prefetch_on_prediction(self.strategy, union, self.members, self.index))
        if self._alone(step) and planned_on_cpu(
            step, msg.layer, self.group_layers, self.placement.n_groups, self.cpu_share(step)
        ):
            self.planned[(step, msg.layer)] = mine  # computed on the CPU when main asks: nothing to copy
            mine = set()
        self._pin(step, msg.layer, mine)
        self.loader.discard(lambda key: (key[0], key[1]) != (step, msg.layer) or key[2] in mine)
        for expert in sorted(mine):
            self.loader.prefetch((step, msg.layer, expert))

    def on_request(self, msg: ExpertRequest, identity: bytes, ready_at: float = 0.0) -> None:
        started = time.perf_counter()
        # How long the request was here before this: decoding, checks, other messages first.
        waited_here_ms = received_ms(ready_at, self.answered_at, time.monotonic())
        if not self.request_id or msg.request_id != self.request_id:
            log.warning("dropped a request for %r while serving %r", msg.request_id, self.request_id)
            return
        problem = self._malformed(msg)
        if problem:
            log.warning("dropped a malformed request for step %s layer %s: %s", msg.step, msg.layer, problem)
            return
        here = (msg.step, msg.layer)
        if here > self.served:
            self._release_held()  # a new layer: nothing of the previous one stays on the device
            self.served = here
            for key in [k for k in self.predicted if k <= here]:
                del self.predicted[key]
            self._unpin_through(here)
        planned = set()
        for key in [k for k in self.planned if k <= here]:
            experts = self.planned.pop(key)
            if key == here:
                planned = experts
        if planned:  # the layer's other requests (more sequences' rows) find the same plan
            self.planned[here] = planned
        wanted = set(msg.experts)
        self.loader.discard(lambda key: (key[0], key[1]) > here or ((key[0], key[1]) == here and key[2] in wanted))
        if msg.layer == self.group_layers[0]:
            self._mark_token(msg.step, msg.previous_step_s)
        if msg.experts:
            self._compute(msg, identity, planned, started, waited_here_ms)

    def _malformed(self, msg: ExpertRequest) -> str:
        """What is wrong with ``msg``, or "": checked before anything is loaded or computed."""
        n = len(msg.experts)
        if len(msg.counts) != n or len(msg.offsets) != n:
            return "experts, counts and offsets differ in length"
        missing = [e for e in msg.experts if (msg.layer, e) not in self.store_keys]
        if missing:
            return f"experts {missing} of layer {msg.layer} are not this worker's"
        if any(c < 1 for c in msg.counts) or any(o < 0 for o in msg.offsets):
            return "counts must be positive and offsets non-negative"
        if not math.isfinite(msg.previous_step_s) or msg.previous_step_s < 0:
            return f"the previous step's time is {msg.previous_step_s}, not a finite number of seconds"
        rows = sum(msg.counts)
        if n and (msg.rows is None or msg.weights is None):
            return "rows or weights are missing"
        if n and (msg.rows.dim() != 2 or msg.rows.shape[0] != rows or msg.rows.shape[1] != self.hidden):
            return f"rows are {tuple(msg.rows.shape)}, expected ({rows}, {self.hidden})"
        if n and tuple(msg.weights.shape) != (rows,):
            return f"weights are {tuple(msg.weights.shape)}, expected ({rows},)"
        return ""

    def _compute(
        self, msg: ExpertRequest, identity: bytes, planned: set[int], started: float, waited_here_ms: float
    ) -> None:
        assert msg.rows is not None and msg.weights is not None
        rows = msg.rows.to(self.device)
        weights = msg.weights.to(self.device)
        wait_ms = compute_ms = 0.0
        hits = misses = 0
        units = self._units(msg)
        spans = []
        start = 0
        for _, count in units:
            spans.append(slice(start, start + count))
            start += count
        on_cpu = self._on_cpu(msg, units, planned)
        outputs: list[torch.Tensor | Future[torch.Tensor]] = []
        for (expert, _), span in zip(units, spans, strict=True):
            if expert in on_cpu:
                assert self.host is not None  # only hybrid execution puts experts on the CPU
                outputs.append(self.host.submit(self._on_host, msg, expert, span))
            else:
                outputs.append(rows[:0])  # filled in below, on the device
        for i, ((expert, _), span) in enumerate(zip(units, spans, strict=True)):
            if expert in on_cpu:
                continue
            key: Key = (msg.step, msg.layer, expert)
            if key not in self.held:
                resident, predicted, waited = self.loader.acquire(key, timeout_s=self.spec.settings.timeout_s)
                self.held[key] = resident
                wait_ms += waited
                predicted = predicted or expert in planned  # planned on the CPU, but its copy came first
                hits += predicted
                misses += not predicted
            computing = time.perf_counter()
            outputs[i] = expert_forward(rows[span], weights[span], self.held[key].weights, self.act_fn)
            compute_ms += (time.perf_counter() - computing) * 1000
            if msg.final and all(e != expert for e, _ in units[i + 1 :]):
                self._release_held({key})  # its last rows are done: free it before loading the next
        waiting = time.perf_counter()
        done = [out.result() if isinstance(out, Future) else out for out in outputs]
        # The answer goes to the host here rather than in the encoder: on a device that waits for
        # the kernels queued above, so that compute_ms and handled_ms hold them (on CPU a no-op).
        output = (torch.cat(done) if len(done) > 1 else done[0]).cpu()
        compute_ms += (time.perf_counter() - waiting) * 1000  # the CPU's experts not done beside the device's
        result = ExpertResult(
            request_id=msg.request_id,
            step=msg.step,
            layer=msg.layer,
            experts=msg.experts,
            counts=msg.counts,
            offsets=msg.offsets,
            output=output,
            wait_ms=wait_ms,
            compute_ms=compute_ms,
            hits=hits + on_cpu.predicted,
            misses=misses + len(on_cpu) - on_cpu.predicted,
            handled_ms=(time.perf_counter() - started) * 1000,
            received_ms=waited_here_ms,
        )
        self.endpoint.reply(identity, result)
        self.answered_at = time.monotonic()

    def _on_cpu(self, msg: ExpertRequest, units: list[tuple[int, int]], planned: set[int]) -> CpuExperts:
        """The request's experts to compute on the CPU (hybrid execution), their copies dropped.

        ``planned``: the experts this worker was predicted to load for the layer but left on the
        CPU's plan; one of them computed on the CPU was predicted (a hit), though never copied."""
        chosen = CpuExperts()
        if self.rates is None:
            return chosen
        rows: dict[int, int] = {}
        segments: dict[int, int] = {}  # units of one expert: on the CPU each reads its weights again
        for expert, count in units:
            rows[expert] = rows.get(expert, 0) + count
            segments[expert] = segments.get(expert, 0) + 1
        keys: list[Key] = [(msg.step, msg.layer, e) for e in rows if (msg.step, msg.layer, e) not in self.held]
        if not keys:
            return chosen
        states = self.loader.copy_states(keys)
        per_row = expert_flops(self.hidden, self.intermediate, 1)
        nbytes = {k: self.store.nbytes(k[1], k[2]) for k in keys}
        candidates = [(nbytes[k] * segments[k[2]], rows[k[2]] * per_row, states[k]) for k in keys]
        copy_s = nbytes[keys[0]] / self.rates.copy_bytes_per_s
        for key, take in zip(keys, split(candidates, copy_s, self.rates), strict=True):
            if take:
                chosen.add(key[2])
                chosen.predicted += states[key].where in ("loading", "queued") or key[2] in planned
        if chosen:
            here = (msg.step, msg.layer)
            self.loader.discard(lambda key: key[:2] != here or key[2] not in chosen)
            self.cpu_experts += len(chosen)
        return chosen

    def _on_host(self, msg: ExpertRequest, expert: int, span: slice) -> torch.Tensor:
        """One expert's rows computed on this host's CPU from its weights in host memory."""
        assert msg.rows is not None and msg.weights is not None and self.rates is not None
        started = time.perf_counter()
        rows = msg.rows[span]
        out = expert_forward(rows, msg.weights[span], self.store.get(msg.layer, expert), self.act_fn)
        if self.spec.settings.host_memory_bytes_per_s:
            # Emulated host: the CPU path takes what the profile's DRAM (or CPU) would.
            floor = cpu_seconds(
                self.store.nbytes(msg.layer, expert),
                expert_flops(self.hidden, self.intermediate, rows.shape[0]),
                self.rates,
            )
            left = floor - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)
        return out.to(self.device)

    def cpu_share(self, step: int) -> Fraction:
        """The share of the group's (step, layer)s planned on the CPUs at session step ``step``."""
        return self.share_control.share_at(step) if self.share_control else Fraction(0)

    def _share_control(self) -> ShareController | None:
        """The planned share's controller (``inference.policies.hybrid.ShareController``), its ceiling from
        this worker's rates: none without hybrid execution, or under a strategy that caches or
        loads nothing ahead."""
        if self.rates is None or self.strategy.cache != "none" or self.strategy.predictor is None:
            return None
        cpu = cpu_seconds(self.expert_bytes, expert_flops(self.hidden, self.intermediate, 1), self.rates)
        ceiling = predicted_share(self.expert_bytes / self.rates.copy_bytes_per_s, cpu, self.placement.n_groups)
        log.info("worker %d: up to %s of the group's decode layers may be planned on the CPUs", self.index, ceiling)
        return ShareController(ceiling, delay=share_delay(self.spec.settings.lookahead))

    def _mark_token(self, step: int, previous_step_s: float) -> None:
        """Main's first request to the group for session step ``step``: the previous decode
        token's period, as main stamped it, goes to the share's controller. One no decode step
        can take (every layer waits at most ``timeout_s``) is a peer's invention and is left out,
        by every worker of the group alike."""
        mark, self.token_mark = self.token_mark, step
        longest = self.spec.settings.timeout_s * self.placement.n_layers
        if self.share_control is None or mark is None or not self._alone(mark) or not 0 < previous_step_s <= longest:
            return
        first_step = next(iter(self.joined.values()))  # the sequence's prefill
        if mark == step - 1 and mark > first_step:  # two decode tokens in a row
            before = self.share_control.share
            self.share_control.observe(mark, previous_step_s)
            share = self.share_control.share
            if share != before:
                log.info(
                    "worker %d: %s of the group's decode layers planned on the CPUs from session step %d",
                    self.index,
                    share,
                    self.share_control.effective,
                )

    def _alone(self, step: int) -> bool:
        """Whether session step ``step`` runs the session's one sequence (as every worker knows
        it), the only steps a share is planned for and measured on: batched rows make the CPU
        slower than the share was found for."""
        return len(self.joined) == 1 and step >= self.alone_from

    def _host_rates(self) -> HostRates:
        """The rates hybrid execution decides with: the emulated ones, else measured here at start."""
        settings = self.spec.settings
        given = (settings.host_memory_bytes_per_s, settings.host_flops, settings.copy_bytes_per_s)
        if all(given):  # emulated: nothing to measure
            rates = HostRates(*given)  # type: ignore[arg-type]
        else:
            measured = measure_host_rates(self.store, self.device, self.act_fn)
            rates = HostRates(
                memory_bytes_per_s=settings.host_memory_bytes_per_s or measured.memory_bytes_per_s,
                flops=settings.host_flops or measured.flops,
                copy_bytes_per_s=settings.copy_bytes_per_s or measured.copy_bytes_per_s,
            )
        log.info(
            "worker %d: hybrid execution, the CPU reads experts at %.0f MB/s and does %.1f GFLOP/s; "
            "copies run at %.0f MB/s",
            self.index,
            rates.memory_bytes_per_s / 1e6,
            rates.flops / 1e9,
            rates.copy_bytes_per_s / 1e6,
        )
        return rates

    def _units(self, msg: ExpertRequest) -> list[tuple[int, int]]:
        """(expert, rows) computed in one go: each segment (exact), or under ``fused`` batch
        arithmetic the consecutive segments of one expert (every sequence's rows) together."""
        segments = list(zip(msg.experts, msg.counts, strict=True))
        if self.spec.settings.batch_arithmetic != "fused":
            return segments
        units: list[tuple[int, int]] = []
        for expert, count in segments:
            if units and units[-1][0] == expert:
                units[-1] = (expert, units[-1][1] + count)
            else:
                units.append((expert, count))
        return units

    def _store_counts(self) -> tuple[int, int]:
        """A hot store's experts read from disk and served from RAM so far ((0, 0) for another store)."""
        return (self.hot.reads, self.hot.hits) if self.hot is not None else (0, 0)

    def _pin(self, step: int, layer: int, experts: set[int]) -> None:
        """Keep a hot store's predicted experts in RAM until the layer is served (the pin bonus)."""
        if self.hot is None:
            return
        pinned = self.pins.setdefault((step, layer), set())
        for expert in sorted(experts - pinned):
            self.hot.pin(layer, expert)
        pinned |= experts

    def _unpin_through(self, here: tuple[int, int]) -> None:
        for key in [k for k in self.pins if k <= here]:
            assert self.hot is not None  # only a hot store has pins
            for expert in self.pins.pop(key):
                self.hot.unpin(key[1], expert)

    def _clear_pins(self) -> None:
        self.pins.clear()
        if self.hot is not None:
            self.hot.clear_pins()

    def _release_held(self, keys: set[Key] | None = None) -> None:
        for key in list(self.held):
            if keys is None or key in keys:
                del self.held[key]
                self.loader.release(key)

    def end(self, msg: End, identity: bytes) -> None:
        self._release_held()
        self.loader.discard(lambda key: False)
        stats = self.loader.stats
        reads, hits = (now - then for now, then in zip(self._store_counts(), self.store_counts_at_begin, strict=True))
        self.endpoint.reply(
            identity,
            WorkerStats(
                request_id=msg.request_id,
                worker=self.index,
                expert_bytes=self.expert_bytes,
                peak_decode_bytes=stats.peak_bytes["decode"],
                peak_prefill_bytes=stats.peak_bytes["prefill"],
                loads=stats.loads,
                hits=stats.hits,
                misses=stats.misses,
                wasted_loads=stats.wasted_loads,
                load_ms=stats.load_ms,
                disk_reads=reads,
                hot_hits=hits,
                cpu_experts=self.cpu_experts,
            ),
        )
        self.request_id = ""
        self._forget_session()

    def _forget_session(self) -> None:
        """What a session learnt of its sequences, predictions and plans: dropped at its begin and end."""
        self.joined.clear()
        self.alone_from = 0
        self.predicted.clear()
        self.planned.clear()
        self.token_mark = None
        if self.share_control is not None:
            self.share_control.new_session()
        self._clear_pins()
        self.flooded = 0


class CpuExperts(set[int]):
    """The experts of one request computed on the CPU, and how many of them had been predicted."""

    predicted: int = 0


def _read_config(shard_dir: str) -> dict:
    with open(Path(shard_dir) / "config.json") as f:
        return json.load(f)


def serve(spec: RoleSpec) -> None:
    WorkerRole(spec).run()
