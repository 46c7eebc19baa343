"""The worker's role: its loop, its messages, and the loads and computing they lead to.

Predictions (from the shadow, or from main's next-layer router under ``lru-offload``)
queue loads; main's requests name the experts really routed to this worker, whose rows
are computed as soon as each expert is on the device, after which it is freed — or kept
in the device cache under a caching strategy (``inference.policies.strategies``). Stale prefetches
(a layer already served, a wrong prediction) are dropped when main's request for that
layer shows what was really needed. With hybrid execution (``DeploymentSettings.hybrid``,
``inference.policies.hybrid``) an expert whose copy would finish later than the worker's CPU could
compute it from host memory runs on the CPU instead, beside the device's experts; under a
cacheless strategy that loads ahead, a planned share of the group's (step, layer)s is not
copied at all and runs on the CPUs when main's request comes (``planned_on_cpu``), the share
found from the decode tokens' periods main stamps on its requests (``ShareController``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction

import torch

from inference.modelio.shards import verify_shard
from inference.policies.hybrid import expert_flops, planned_on_cpu, share_delay
from inference.policies.loads import Key, keep_on_prediction, keep_on_request
from inference.policies.placement import placement_from_dict
from inference.policies.strategies import (
    expert_store_for,
    get_strategy,
    home_experts,
    prefetch_on_prediction,
    prefill_prefetch,
)
from inference.runtime.experts import activation, expert_forward
from inference.runtime.loader import Resident
from inference.runtime.roles.common import answer_ping, handle_safely, open_endpoint, pick_device
from inference.runtime.roles.worker import cpu_path
from inference.runtime.roles.worker.requests import last_use, malformed, received_ms, spans_of, units_of
from inference.runtime.roles.worker.session import MAX_PREDICTED, Session
from inference.runtime.roles.worker.stats import HotPins, session_stats
from inference.runtime.roles.worker.storage import device_cache, make_loader, open_worker_store, read_config
from inference.runtime.spec import RoleSpec
from inference.runtime.transport import Received
from inference.wire.runtime import (
    Begin,
    End,
    ExpertRequest,
    ExpertResult,
    Prediction,
    Predictions,
    SequenceJoin,
    SequenceLeave,
    Shutdown,
)

log = logging.getLogger(__name__)


class WorkerRole:
    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec
        self.device = pick_device(spec.settings.device)
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
        config = read_config(spec.shard_dir)
        self.act_fn = activation(config.get("hidden_act", "silu"))
        self.store_kind = expert_store_for(spec.settings.strategy, spec.settings.expert_store)
        self.store = open_worker_store(spec, config, self.device)
        self.pins = HotPins(self.store)
        self.store_keys = self.store.keys()
        self.hidden = int(config["hidden_size"])
        any_key = next(iter(self.store_keys))
        self.expert_bytes = self.store.nbytes(*any_key)
        self.strategy = get_strategy(spec.settings.strategy)
        cache = device_cache(self.strategy.cache, spec.settings.cache_experts)
        self.loader = make_loader(spec, self.store, self.device, self.placement, len(self.members), cache)
        if self.strategy.cache == "all":
            self.loader.preload(home_experts(self.placement, self.index))
        self.intermediate = int(self.store.get(*any_key).down.shape[1])  # down is [H, I]
        self._setup_hybrid()
        self.endpoint = open_endpoint(spec)
        self.session = Session()
        self.held: dict[Key, Resident] = {}  # experts on the device until the layer's final request
        self.answered_at = 0.0  # when the last answer left (time.monotonic()): `received_ms`
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

    def _setup_hybrid(self) -> None:
        """Hybrid execution's rates, the host CPU's queue of experts and the planned share's controller."""
        settings = self.spec.settings
        self.rates = (
            cpu_path.host_rates(settings, self.store, self.device, self.act_fn, self.index) if settings.hybrid else None
        )
        # The host CPU's own queue of experts: one thread, beside the device's work on this one.
        self.host = ThreadPoolExecutor(1, thread_name_prefix="host-experts") if self.rates else None
        self.cpu_experts = 0  # experts of this session computed on the CPU
        # Of the group's (step, layer)s, the share whose predicted experts are left uncopied and
        # computed on the CPUs (hybrid execution under a cacheless strategy that loads ahead),
        # found from the decode tokens' periods main stamps on its requests.
        self.share_control = cpu_path.share_control_for(
            self.rates,
            self.strategy,
            self.expert_bytes,
            expert_flops(self.hidden, self.intermediate, 1),
            self.placement.n_groups,
            share_delay(settings.lookahead),
            self.index,
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
            self.session.join(msg)
        elif isinstance(msg, SequenceLeave):
            self.on_leave(msg)
        elif isinstance(msg, Prediction):
            self.on_prediction(msg)
        elif isinstance(msg, Predictions):
            for prediction in msg.items:
                self.on_prediction(prediction)
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
        self.pins.mark_begin()
        self.cpu_experts = 0
        self.session.start(msg.request_id)
        self._forget_session()
        for layer, expert in prefill_prefetch(self.strategy, self.placement, self.index):
            self.loader.prefetch((0, layer, expert))

    def on_leave(self, msg: SequenceLeave) -> None:
        """A sequence left, the session goes on: its predictions are dropped, and with one sequence
        left the group may plan layers on its CPUs again, from a step every worker of it agrees
        on. Main sends the leave before its next step, as it would a share's period, so by the
        step ``share_delay`` gives after the last no worker has planned a later one as batched."""
        alone = self.session.leave(msg, share_delay(self.spec.settings.lookahead))
        if alone and self.share_control is not None:
            log.info("worker %d: one sequence again, planned from session step %d", self.index, self.session.alone_from)

    def on_prediction(self, msg: Prediction) -> None:
        """Load ahead what the batch's predictions for a layer name together.

        Main's own guesses come in session steps; the shadow's per sequence, in the
        sequence's steps, which its join places in the session.
        """
        step = self.session.step_of(msg.request_id, msg.step)
        if step is None:
            return
        here = (step, msg.layer)
        if msg.layer not in self.decode_layers or here <= self.session.served:
            return  # not a layer of ours, or main has already served it: the prediction came too late
        if any((msg.layer, e) not in self.store_keys for e in msg.experts):
            log.warning("dropped a prediction for layer %d naming experts this worker lacks", msg.layer)
            return
        if self.session.full(here):
            if self.session.flooded == 1:  # once per session: a flooding peer must not flood the log too
                log.warning("dropping predictions beyond %d predicted layers ahead (a peer flooding?)", MAX_PREDICTED)
            return
        union = self.session.predict(here, msg.request_id, msg.experts)
        mine = set(prefetch_on_prediction(self.strategy, union, self.members, self.index))
        if self.session.alone(step) and planned_on_cpu(
            step, msg.layer, self.group_layers, self.placement.n_groups, self.cpu_share(step)
        ):
            self.session.planned[here] = mine  # computed on the CPU when main asks: nothing to copy
            mine = set()
        self.pins.pin(step, msg.layer, mine)
        self.loader.discard(keep_on_prediction(here, mine))
        for expert in sorted(mine):
            self.loader.prefetch((step, msg.layer, expert))

    def on_request(self, msg: ExpertRequest, identity: bytes, ready_at: float = 0.0) -> None:
        started = time.perf_counter()
        # How long the request was here before this: decoding, checks, other messages first.
        waited_here_ms = received_ms(ready_at, self.answered_at, time.monotonic())
        if not self.session.request_id or msg.request_id != self.session.request_id:
            log.warning("dropped a request for %r while serving %r", msg.request_id, self.session.request_id)
            return
        problem = malformed(msg, self.store_keys, self.hidden)
        if problem:
            log.warning("dropped a malformed request for step %s layer %s: %s", msg.step, msg.layer, problem)
            return
        here = (msg.step, msg.layer)
        if self.session.advance(here):
            self._release_held()  # a new layer: nothing of the previous one stays on the device
            self.pins.unpin_through(here)
        planned = self.session.take_plan(here)
        wanted = set(msg.experts)
        self.loader.discard(keep_on_request(here, wanted))
        if msg.layer == self.group_layers[0]:
            longest = self.spec.settings.timeout_s * self.placement.n_layers
            cpu_path.mark_token(self.session, self.share_control, msg.step, msg.previous_step_s, longest, self.index)
        if msg.experts:
            self._compute(msg, identity, planned, started, waited_here_ms)

    def _compute(
        self, msg: ExpertRequest, identity: bytes, planned: set[int], started: float, waited_here_ms: float
    ) -> None:
        assert msg.rows is not None and msg.weights is not None
        rows = msg.rows.to(self.device)
        weights = msg.weights.to(self.device)
        wait_ms = compute_ms = 0.0
        hits = misses = 0
        units = units_of(msg, self.spec.settings.batch_arithmetic)
        spans = spans_of(units)
        on_cpu = self._on_cpu(msg, units, planned)
        outputs: list[torch.Tensor | Future[torch.Tensor]] = []
        for (expert, _), span in zip(units, spans, strict=True):
            if expert in on_cpu:
                outputs.append(self._submit_host(msg, expert, span))
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
            if msg.final and last_use(units, i):
                self._release_held({key})  # its last rows are done: free it before loading the next
        waiting = time.perf_counter()
        done = [out.result() if isinstance(out, Future) else out for out in outputs]
        # The answer goes to the host here rather than in the encoder: on a device that waits for
        # the kernels queued above, so that compute_ms and handled_ms hold them (on CPU a no-op).
        output = (torch.cat(done) if len(done) > 1 else done[0]).cpu()
        compute_ms += (time.perf_counter() - waiting) * 1000  # the CPU's experts not done beside the device's
        result = ExpertResult(
            **msg.segments(),
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

    def _on_cpu(self, msg: ExpertRequest, units: list[tuple[int, int]], planned: set[int]) -> cpu_path.CpuExperts:
        """The request's experts to compute on the CPU (hybrid execution), their copies dropped."""
        if self.rates is None:
            return cpu_path.CpuExperts()
        keys_of: dict[int, Key] = {}
        for expert, _ in units:
            key = (msg.step, msg.layer, expert)
            if key not in self.held:
                keys_of.setdefault(expert, key)
        if not keys_of:
            return cpu_path.CpuExperts()
        keys = list(keys_of.values())
        states = self.loader.copy_states(keys)
        nbytes = {k: self.store.nbytes(k[1], k[2]) for k in keys}
        per_row = expert_flops(self.hidden, self.intermediate, 1)
        chosen = cpu_path.choose_on_cpu(units, keys_of, states, nbytes, per_row, self.rates, planned)
        if chosen:
            here = (msg.step, msg.layer)
            self.loader.discard(lambda key: key[:2] != here or key[2] not in chosen)
            self.cpu_experts += len(chosen)
        return chosen

    def _submit_host(self, msg: ExpertRequest, expert: int, span: slice) -> Future[torch.Tensor]:
        """One expert's rows, queued on this host's CPU (hybrid execution only)."""
        assert self.host is not None and self.rates is not None  # only hybrid execution puts experts on the CPU
        return self.host.submit(
            cpu_path.compute_on_host,
            msg,
            expert,
            span,
            self.store,
            self.act_fn,
            self.rates,
            self.spec.settings,
            self.device,
            (self.hidden, self.intermediate),
        )

    def cpu_share(self, step: int) -> Fraction:
        """The share of the group's (step, layer)s planned on the CPUs at session step ``step``."""
        return cpu_path.cpu_share(self.share_control, step)

    def _release_held(self, keys: set[Key] | None = None) -> None:
        for key in list(self.held):
            if keys is None or key in keys:
                del self.held[key]
                self.loader.release(key)

    def end(self, msg: End, identity: bytes) -> None:
        self._release_held()
        self.loader.discard(lambda key: False)
        stats = session_stats(
            msg.request_id, self.index, self.expert_bytes, self.loader.stats, self.pins, self.cpu_experts
        )
        self.endpoint.reply(identity, stats)
        self.session.end()
        self._forget_session()

    def _forget_session(self) -> None:
        """What a session learnt beyond its own bookkeeping (``Session.forget``): the planned
        share's measurements and the hot store's pins, dropped at its begin and end."""
        if self.share_control is not None:
            self.share_control.new_session()
        self.pins.clear()


def serve(spec: RoleSpec) -> None:
    WorkerRole(spec).run()
