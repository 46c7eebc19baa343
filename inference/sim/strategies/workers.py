"""The worker side shared by the cacheless strategies: groups, per-worker PCIe, the prefetch depth's slots.

A worker copies one expert at a time over its PCIe link and holds at most ``D`` experts
(`Setup.prefetch_depth`, two at every profile's proportions: one being computed, one being
loaded), so a load can start only once the expert ``D`` loads before it is freed. Main sends each
layer's hidden state and expert ids to the layer's group; the workers answer; the layer ends when
the last answer is in.

With `Cluster.hybrid` (the runtime's `DeploymentSettings.hybrid`, `inference.policies.hybrid`), when main's request
reaches a worker each requested expert runs where it finishes first: on the GPU once its copy is
done, or on the worker's CPU straight from host memory (its bytes over `Profile.host_memory`'s rate,
or its FLOPs over `Profile.host_cpu_flops` if that is longer); a copy that had not started by then
is dropped, which frees the worker's PCIe link for the next one.
"""

from __future__ import annotations

from collections import deque

from inference.policies.hybrid import HostRates, cpu_seconds
from inference.sim.sources import value
from inference.sim.strategies.base import Setup, kv_cache_bytes, tokens_per_expert


class WorkerPool:
    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.costs = setup.costs
        workers = setup.cluster.workers
        self.placement = setup.placement
        self.pcie_free = [0.0] * workers
        # Per worker, the compute-done times of its last D experts, oldest first.
        self.freed = [deque([0.0] * setup.prefetch_depth) for _ in range(workers)]
        self.loads = 0
        self.wasted_loads = 0
        self.misses = 0
        self.cpu_experts = 0

    def group_workers(self, layer: int) -> list[int]:
        return list(self.placement.workers_for_layer(layer))

    def _plan_load(self, worker: int, earliest: float) -> tuple[float, float]:
        start = max(earliest, self.pcie_free[worker], self.freed[worker][0])
        return start, start + self.costs.expert_load()

    def _load(self, worker: int, earliest: float) -> float:
        _, done = self._plan_load(worker, earliest)
        self.pcie_free[worker] = done
        self.loads += 1
        return done

    def cpu_expert_time(self, tokens: int = 1) -> float:
        """An expert computed on the worker's CPU from host memory (hybrid execution)."""
        c = self.costs
        profile = c.profile
        link = profile.host_to_device.rate(c.ideal)
        host = HostRates(profile.host_memory.rate(c.ideal), profile.host_cpu_flops, link)
        return cpu_seconds(c.model.expert_bytes(), c.model.expert_flops(tokens), host)

    def serve_layer(
        self,
        layer: int,
        experts: list[int],
        routed: float,
        predicted: list[int] | None,
        predicted_at: float | None,
        rows: dict[int, int] | None = None,
        positions: int = 1,
        guessed_at: list[float] | None = None,
    ) -> float:
        """Time main has every expert answer of `layer`; `routed` is when main's router decided.
        A drafted pass sends ``positions`` rows, and each expert computes the ``rows`` that chose it
        one call each (their own one-row segments; 1 where not given); ``guessed_at``, when given,
        is when each guess of ``predicted`` reached the group (``predicted_at``: the first of them),
        a guess that comes after main's routing counting as none."""
        c = self.costs
        members = self.group_workers(layer)
        hidden = c.model.hidden_bytes(positions)
        arrive = routed + c.message(hidden, count=len(members))
        use_prediction = predicted is not None and predicted_at is not None and predicted_at < arrive
        if use_prediction and guessed_at is not None:
            assert predicted is not None
            timed = [(at, guess) for at, guess in zip(guessed_at, predicted, strict=True) if at < arrive]
            predicted, guessed_at = [guess for _, guess in timed], [at for at, _ in timed]
        hybrid = self.setup.cluster.hybrid
        cpu_time = self.cpu_expert_time(1) if hybrid else 0.0
        cpu_free = {w: arrive for w in members}  # each worker's CPU runs its CPU experts one after another
        ready: dict[int, tuple[int, float]] = {}  # expert -> (worker, loaded at)
        answers = []
        # Not the runtime's dealing, on purpose (figures recorded with it): the runtime deals the
        # *sorted* predicted experts round-robin (`inference.policies.assignment.prefetch_assignment`)
        # and main sends a missed expert to the group's least-loaded worker (`assign_experts`);
        # this pool deals the guesses in the shadow's order and a miss to a worker with no right
        # guess. The count of loads per worker is alike; which worker's queue they join is not,
        # which moves the paper testbed's odmoe decode by a few tenths of a percent.
        if use_prediction:
            for index, guess in enumerate(predicted):
                worker = members[index % len(members)]
                at = guessed_at[index] if guessed_at is not None else predicted_at
                start, done = self._plan_load(worker, at)
                needed = guess in experts and guess not in ready
                # Hybrid here sets the CPU's finish against the GPU's (copy + compute); the runtime
                # (`inference.policies.hybrid.split`) sets it against the copy's end alone.
                if hybrid and needed and start > arrive:
                    gpu_done = max(done, arrive) + c.expert_call(1)
                    if cpu_free[worker] + cpu_time < gpu_done:  # not started yet: dropped, computed on the CPU
                        cpu_free[worker] += cpu_time
                        answers.append(cpu_free[worker])
                        ready[guess] = (worker, -1.0)
                        self.cpu_experts += 1
                        continue
                done = self._load(worker, at)
                if needed:
                    ready[guess] = (worker, done)
                else:
                    self.wasted_loads += 1
        missing = [e for e in experts if e not in ready]
        self.misses += len(missing) if use_prediction else 0
        busy = {worker for worker, _ in ready.values()}
        spare = [w for w in members if w not in busy] + members
        for index, expert in enumerate(missing):
            worker = spare[index % len(spare)]
            if hybrid:
                _, done = self._plan_load(worker, arrive)
                if cpu_free[worker] + cpu_time < done + c.expert_call(1):
                    cpu_free[worker] += cpu_time
                    answers.append(cpu_free[worker])
                    ready[expert] = (worker, -1.0)
                    self.cpu_experts += 1
                    continue
            ready[expert] = (worker, self._load(worker, arrive))
        for expert, (worker, loaded) in ready.items():
            if loaded < 0:
                continue  # computed on the CPU above
            done = max(loaded, arrive) + c.expert_call(1) * (rows or {}).get(expert, 1)
            self.freed[worker].popleft()
            self.freed[worker].append(done)
            answers.append(done)
        return max(answers) + c.message(hidden, count=len(answers))


def prefill_on_workers(setup: Setup, prompt_tokens: int, *, preload: bool, chunks: int = 4) -> float:
    """Prefill with every expert of a layer spread over all workers (no prediction needed).

    With `preload`, workers stream their experts of the next layers as soon as a slot is free (all
    experts are needed); otherwise a load starts when main's router has decided. The prompt is cut into
    `chunks` mini-batches so that sending, computing and answering overlap (assumption: 4).
    """
    c = setup.costs
    m = c.model
    workers = setup.cluster.workers
    place = setup.placement
    split = tokens_per_expert(prompt_tokens, m.experts, m.top_k)
    pcie_free = [0.0] * workers
    freed = [deque([0.0] * setup.prefetch_depth) for _ in range(workers)]
    now = 0.0
    for _layer in range(m.layers):
        routed = now + c.attention_layer(prompt_tokens, prompt_tokens)
        hit = [n for n in split if n > 0]
        sent = c.message(m.hidden_bytes(sum(hit)) / len(hit), count=len(hit))
        answers = []
        for expert, tokens in enumerate(hit):  # the experts hit are 0 .. len(hit) - 1 (tokens_per_expert)
            worker = place.prefill_worker(expert)
            earliest = 0.0 if preload else routed
            start = max(earliest, pcie_free[worker], freed[worker][0])
            loaded = start + c.expert_load()
            pcie_free[worker] = loaded
            compute = c.expert_call(tokens)
            stages = [sent, compute, sent]
            overlap = max(stages) + (sum(stages) - max(stages)) / chunks
            done = max(loaded + compute, routed + overlap)
            freed[worker].popleft()
            freed[worker].append(done)
            answers.append(done)
        now = max(answers)
    return now + c.head()


def worker_memory(setup: Setup, context_tokens: int, experts_resident: int) -> dict[str, float]:
    c = setup.costs
    m = c.model
    main = m.non_expert_params * 2 + kv_cache_bytes(c, context_tokens) + value("cuda_context_memory")
    memory = {"main": main}
    per_worker = experts_resident * m.expert_bytes() + value("cuda_context_memory")
    for worker in range(setup.cluster.workers):
        memory[f"worker{worker}"] = per_worker
    return memory
