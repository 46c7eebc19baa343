"""The simulator's prediction of a `benchmarks.strategies` run, made before the run, from measurements.

    python -m benchmarks.sim_prediction --validate benchmarks/results/strategies.json [--json OUT]

`predict_for_run(...)` is what `benchmarks.strategies` calls before it starts any cluster: it
measures, in under a minute, what the emulation leaves at this machine's speed (main's decode
layer, main's per-layer Python around the experts, an expert request's round trip, an expert's
compute), takes the routing of the run's own prompts from Transformers' greedy reference (the
tokens the benchmark checks every strategy against, computed before any run), and runs
`inference.sim.local`'s model of our runtime with the emulation's copy and link rates. Nothing of
a run's measurements goes in.

The per-layer costs come from a running main + one worker of the runtime on the run's checkpoint
(`measure_in_rhythm`: full cache, no shadow, no emulation, a core each), split as the step reports
split every layer. They were first timed piece by piece in tight loops; the cluster's own
breakdown (`inference.runtime.metrics.layer_breakdown`) showed each piece taking 1.5-6x as long in the
cluster as alone (right after a wait, with cold caches and the runtime's code around it), so a
model fed the tight-loop figures leaves out most of what a layer costs wherever copies do not hide
it. The prediction with the tight-loop costs is still made and recorded beside the other.

`--validate FILE` does the same for a recorded run (its emulation, pairs and workers; the
checkpoint is re-made from `benchmarks.workload.BENCH_MODEL` with the same seed) and reports each
strategy's prediction beside its recorded decode tok/s. The per-layer costs are measured *now*, so
a recorded run from another day is predicted with today's machine: this box's speed has moved by
2x between days (README, "Measured"), which is part of the error reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import provenance, substance
from benchmarks.workload import BENCH_MODEL, prompt_of
from inference.modelio.families import family_for
from inference.sim.cluster import STRATEGIES, EmulatedRates, MachineCosts, Options, Shape
from inference.sim.local import predict

# What its figures depend on beyond its own imports: the roles its local clusters run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

STEP_SAMPLES = 60


def _main_layer_model(config: dict, layers: int):
    """The checkpoint's family model with ``layers`` layers whose routed experts cost nothing: what
    main runs itself (attention, norms, the router) while the workers compute the experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**config, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for layer in model.model.layers:
        block = layer.mlp
        if hasattr(block, "experts"):

            class _Zero(torch.nn.Module):
                def forward(self, hidden_states, *args, **kwargs):
                    return torch.zeros_like(hidden_states)

            block.experts = _Zero()
    return model


def _decode_step_s(model, prompt_len: int = 32, steps: int = STEP_SAMPLES) -> float:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt_len))
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


RHYTHM_PROMPTS = 3  # generations of the in-rhythm measurement...
RHYTHM_TOKENS = 24  # ...of this many tokens each, after a warm-up


def measure_in_rhythm(model_dir: Path, config: dict) -> dict:
    """Where a decode layer's time goes in a running main + one worker of the runtime itself.

    The checkpoint's own cluster, reduced to two processes (each with a core, as on separate
    boxes): full cache (the worker holds every expert, so nothing waits for a copy), no shadow, no
    emulation, one torch thread per role. Every decode layer is split as the step reports split
    it (`inference.runtime.metrics.layer_breakdown`), and main's time between layers comes with it. What
    this measures that the same pieces timed alone in a tight loop do not: each piece right after
    the process slept through a wait, as it runs in a cluster — with a cold cache, a slower
    wake-up, and the runtime's own code around each piece.
    """
    from inference.runtime.launcher import ClusterOptions, LocalCluster
    from inference.runtime.spec import DeploymentSettings

    generator = torch.Generator().manual_seed(7)
    vocab = config["vocab_size"]
    prompts = [[1, *torch.randint(3, vocab, (15,), generator=generator).tolist()] for _ in range(RHYTHM_PROMPTS)]
    options = ClusterOptions(workers=1, shadow=False, settings=DeploymentSettings(threads=1, strategy="full-cache"))
    between, parts = [], []
    with LocalCluster(model_dir, options) as cluster:
        cluster.generate(prompts[0][:8], 4)  # warm-up: first-call allocations in both processes
        for prompt in prompts:
            metrics = cluster.generate(prompt, RHYTHM_TOKENS).metrics
            between.append(metrics["decode_main_between_layers_ms_median"])
            parts.append(metrics["decode_layer_breakdown_ms_median"])
    return {
        "main_between_layers_ms": statistics.median(between),
        "parts_ms": {name: statistics.median(p[name] for p in parts) for name in parts[0]},
        "generations": len(prompts),
        "tokens_each": RHYTHM_TOKENS,
    }


def hold_wake_s(
    config: dict, latency_s: float, bytes_per_s: float | None, messages: int = 200, gap_s: float = 0.002
) -> float:
    """Median of how late an emulated link hands a held message out after its delivery time.

    Two endpoints in this process, encrypted as every deployment's are, the sender's link
    emulating the run's ``latency_s`` and ``bytes_per_s``; one expert request of the checkpoint's
    size at a time, ``gap_s`` apart. The receiver holds each message until its stamp and then
    returns from a timed wait, as every role's inbox does under the emulation. A message that
    arrived after its stamp would count its transit instead; with the emulated latencies of the
    profiles (0.25 ms and more here, against a loopback hop of about 0.1 ms) none does.
    """
    from benchmarks.overhead import DEPLOYMENT, sample_messages
    from benchmarks.overhead import Shape as OverheadShape
    from inference.runtime.curve import new_seat_keys, role_keys
    from inference.runtime.launcher import free_port
    from inference.runtime.transport import Endpoint

    shape = OverheadShape(config["hidden_size"], config["num_experts_per_tok"], family_for(config).n_experts(config))
    request, _ = sample_messages(shape)
    address = f"tcp://127.0.0.1:{free_port()}"
    seats = new_seat_keys(["main", "worker-0"])
    inbox = Endpoint("worker-0", DEPLOYMENT, bind=address, curve=role_keys("worker-0", seats))
    late = []
    try:
        sender = Endpoint(
            "main", DEPLOYMENT, link_bytes_per_s=bytes_per_s, link_latency_s=latency_s, curve=role_keys("main", seats)
        )
        try:
            sender.connect("worker-0", address)
            for i in range(messages + 20):
                time.sleep(gap_s)
                sender.send("worker-0", request)
                received = inbox.recv(timeout_s=5.0)
                if received is None:
                    raise RuntimeError("the emulated link delivered nothing within 5 s")
                if i >= 20:  # after a warm-up (and the CURVE handshake)
                    late.append(time.monotonic() - received.msg.deliver_at)
        finally:
            sender.close()
    finally:
        inbox.close()
    return max(0.0, statistics.median(late))


def _too_big_for_one_worker(model_dir: Path) -> str:
    """Why `measure_in_rhythm` cannot run here ("" where it can): its one worker holds every expert."""
    from inference.modelio.checkpoint import Checkpoint, is_expert_key

    checkpoint = Checkpoint(model_dir)
    expert_bytes = sum(checkpoint.nbytes(name) for name in checkpoint if is_expert_key(name))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if expert_bytes > available // 3:
        return (
            f"the checkpoint's experts ({expert_bytes / 2**30:.1f} GiB) would not fit one worker here "
            f"({available / 2**30:.1f} GiB available): the tight-loop costs are used"
        )
    return ""


def costs_in_rhythm(rhythm: dict, top_k: int, hold_wake: float = 0.0) -> MachineCosts:
    """`MachineCosts` from `measure_in_rhythm`'s figures (pure). Main's time between layers holds its
    per-token work too (its token intervals, spread over the layers), so nothing is left per token;
    main's Python before its requests leave and after the answers come apart; the worker's load
    wait + compute is one request's ``top_k`` experts (one sequence, nothing to wait for); its own
    Python is charged after the request reaches it, the hops as the loopback round trip."""
    parts = rhythm["parts_ms"]
    return MachineCosts(
        expert_compute_s=max(parts["worker_busy"], 1e-3) / top_k / 1000,
        main_layer_s=rhythm["main_between_layers_ms"] / 1000,
        main_dispatch_s=parts["main_after_answers"] / 1000,
        round_trip_s=parts["hops"] / 1000,
        step_fixed_s=0.0,
        worker_python_s=parts["worker_python"] / 1000,
        hold_wake_s=hold_wake,
        main_before_send_s=parts["main_before_send"] / 1000,
    )


def measure_machine(
    config: dict,
    expert_compute_s: float,
    *,
    model_dir: Path | None = None,
    link_latency_s: float = 0.0,
    link_bytes_per_s: float | None = None,
) -> tuple[MachineCosts, dict]:
    """This machine's un-emulated costs at the checkpoint's shape (one thread, as a role runs).

    Each piece timed alone in a tight loop; with ``model_dir`` (the run's checkpoint) the costs
    returned are those measured in the runtime's rhythm instead (`measure_in_rhythm`, and how late
    a held message wakes its receiver on a link emulating ``link_latency_s`` and
    ``link_bytes_per_s``: `hold_wake_s`), and the tight-loop ones are kept in the record under
    ``tight_loop``. A checkpoint whose experts would not fit one worker process here keeps the
    tight-loop costs (the record says so).
    """
    from benchmarks.overhead import Shape as OverheadShape
    from benchmarks.overhead import component_times, endpoint_round_trip_us

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        small, big = 2, 6
        t_small = _decode_step_s(_main_layer_model(config, small))
        t_big = _decode_step_s(_main_layer_model(config, big))
        layer = max(0.0, (t_big - t_small) / (big - small))
        fixed = max(0.0, t_small - small * layer)
        experts = family_for(config).n_experts(config)
        shape = OverheadShape(config["hidden_size"], config["num_experts_per_tok"], experts)
        parts = component_times(shape, 300)
        dispatch = (
            parts["main: routing split"]
            + parts["main: build + encode request"]
            + parts["main: decode + scatter + combine"]
            - parts["main: decode result"]  # the round trip below decodes the result already
        ) / 1e6
        round_trip = endpoint_round_trip_us(shape, 300) / 1e6
    finally:
        torch.set_num_threads(threads)
    costs = MachineCosts(
        expert_compute_s=expert_compute_s,
        main_layer_s=layer,
        main_dispatch_s=max(0.0, dispatch),
        round_trip_s=round_trip,
        step_fixed_s=fixed,
    )
    record: dict = {"components_us": parts, "tight_loop": costs.as_dict()}
    if model_dir is not None:
        too_big = _too_big_for_one_worker(model_dir)
        if too_big:
            record["in_rhythm_skipped"] = too_big
        else:
            rhythm = measure_in_rhythm(model_dir, config)
            emulated = link_latency_s > 0 or bool(link_bytes_per_s)
            rhythm["hold_wake_s"] = hold_wake_s(config, link_latency_s, link_bytes_per_s) if emulated else 0.0
            record["in_rhythm"] = rhythm
            costs = costs_in_rhythm(rhythm, config["num_experts_per_tok"], rhythm["hold_wake_s"])
    record["seconds"] = time.perf_counter() - started
    return costs, record


def routing_traces(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]]) -> list[dict]:
    """Per generation: the routed experts of every decode step and layer, main's next-gate guesses
    (the next layer's router on this layer's MoE input), and the experts the prompt hit, from one
    teacher-forced forward of Transformers' own greedy tokens (the run's tokens: it is exact)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").eval()
    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, args, _out, i=i: captured.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]).detach())
        )
        for i, layer in enumerate(layers)
    ]
    generations = []
    try:
        with torch.inference_mode():
            for prompt, output in zip(prompts, outputs, strict=True):
                ids = torch.tensor([prompt + output[:-1]])
                model(input_ids=ids, use_cache=False)
                inputs = dict(captured)  # calling the gates below fires the hooks again
                routed, guessed = [], []
                for i, layer in enumerate(layers):
                    _, _, idx = layer.mlp.gate(inputs[i])
                    routed.append(idx.tolist())
                    if i + 1 < len(layers):
                        _, _, nxt = layers[i + 1].mlp.gate(inputs[i])
                        guessed.append(nxt.tolist())
                n = len(prompt)
                # The first new token comes from the prefill; decode step s feeds token n + s - 1.
                positions = range(n, n + len(output) - 1)
                trace = [[sorted(set(routed[i][p])) for i in range(len(layers))] for p in positions]
                next_gate = [[[]] + [sorted(set(guessed[i - 1][p])) for i in range(1, len(layers))] for p in positions]
                prefill = [sorted({e for p in range(n) for e in routed[i][p]}) for i in range(len(layers))]
                generations.append({"trace": trace, "next_gate": next_gate, "prefill_experts": prefill})
    finally:
        for hook in hooks:
            hook.remove()
    return generations


def predict_drafts_in_engine(
    model_dir: Path,
    prompts: list[list[int]],
    outputs: list[list[int]],
    *,
    shadow_dtype: str,
    drafts: int,
    shape: Shape,
    costs: MachineCosts,
    rates: EmulatedRates,
) -> dict:
    """odmoe drafting ``drafts`` tokens a pass, predicted by main's real engine (``inference.tools.
    engine_passes``): each generation served alone in this process with a ``shadow_dtype`` copy of
    the model drafting its greedy continuation, its passes timed on the emulated cluster; the mean
    decode tok/s over the generations (as ``predict`` averages them), and what the passes kept. The
    tokens must be ``outputs``: a prediction of other tokens would predict another run."""
    import copy

    from transformers import AutoModelForCausalLM

    from inference.shadow import quant
    from inference.tools.engine_passes import record_passes, time_passes

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto", experts_implementation="eager").eval()
    shadow = copy.deepcopy(model).float()
    quant.quantize_shadow_(shadow, shadow_dtype)
    rates_each, kept, decode_passes, drafted_positions = [], 0, 0, 0
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        request = [{"id": f"g{i}", "prompt": prompt, "max_new_tokens": len(output)}]
        passes, tokens = record_passes(model, request, shadow=shadow, prefix_cache=False, draft_tokens=drafts)
        if tokens[f"g{i}"] != output:
            raise RuntimeError(f"generation {i}: the engine's tokens are not the reference's")
        timed = time_passes(passes, Options("odmoe"), shape, costs, rates)
        rates_each.append(timed["decode_tok_s"])
        decodes = [r for p in passes for r in p.decoding()]
        decode_passes += len(decodes)
        kept += sum(r.tokens for r in decodes)
        drafted_positions += sum(r.positions - 1 for r in decodes)
    return {
        "predicted_decode_tok_s": {"odmoe": statistics.fmean(rates_each)},
        "tokens_per_pass": kept / decode_passes,
        "agreement": (kept - decode_passes) / drafted_positions if drafted_positions else None,
        "shadow_dtype": shadow_dtype,
    }


def next_gate_recall(generations: list[dict]) -> float:
    hit = total = 0
    for g in generations:
        for step, guess in zip(g["trace"], g["next_gate"], strict=True):
            for real, named in zip(step[1:], guess[1:], strict=True):
                hit += len(set(real) & set(named))
                total += len(real)
    return hit / total if total else 0.0


def measure_decode(model_dir: Path, *, repeats: int = 20) -> dict:
    """An expert's coded bytes (``expert_codec="exponent-plane"``) and the median seconds this machine's CPU
    takes to decode it, on one thread as a worker's loader does: expert 0 of layer 0 of the checkpoint,
    decoded into its fused tensors as the stores do (``CodedExpert.decode``)."""
    from inference.modelio.checkpoint import Checkpoint, expert_key_name
    from inference.modelio.expert_codec import PALETTE_CODE, encode
    from inference.modelio.shards import StoredTensor
    from inference.runtime.coded_expert import CodedExpert

    checkpoint = Checkpoint(model_dir)
    tensors = [checkpoint.tensor(expert_key_name(0, 0, proj)) for proj in ("w1", "w3", "w2")]
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    blobs, codes = [], []
    for tensor in tensors:
        raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
        blob = encode(raw, names[tensor.dtype])
        blobs.append(np.frombuffer(blob, dtype=np.uint8))
        codes.append(StoredTensor(PALETTE_CODE, names[tensor.dtype], tuple(tensor.shape), raw.size, len(blob)))
    w1, _, w2 = tensors
    expert = CodedExpert((2 * w1.shape[0], w1.shape[1]), tuple(w2.shape), w1.dtype, tuple(blobs), tuple(codes))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = []
        for _ in range(repeats + 2):
            started = time.perf_counter()
            expert.decode()
            samples.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return {
        "expert_bytes": expert.nbytes,
        "stored_bytes": expert.stored_nbytes,
        "ratio": expert.stored_nbytes / expert.nbytes,
        "decode_s": statistics.median(samples[2:]),
        "decode_mb_s": expert.nbytes / statistics.median(samples[2:]) / 1e6,
    }


def rates_for(emulation: dict, config: dict, expert_bytes: int, codec: dict | None = None) -> EmulatedRates:
    """The emulation's buckets and the message sizes of the checkpoint (encoded as the runtime does); with
    ``codec`` (``measure_decode``), an expert's coded bytes on the copy and its decode here before it."""
    from benchmarks.overhead import Shape as OverheadShape
    from benchmarks.overhead import sample_messages, stamp

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    request, result = sample_messages(OverheadShape(hidden, 1, family_for(config).n_experts(config)))
    request_bytes = sum(len(bytes(f)) for f in stamp(request))
    result_bytes = sum(len(bytes(f)) for f in stamp(result))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = family_for(config).expert_intermediate(config)
    row_bytes = expert_bytes // (3 * intermediate)  # a hidden row in the weights' dtype
    elem = row_bytes // hidden
    align = layers * 2 * kv_heads * head_dim * elem + 64
    return EmulatedRates(
        copy_bytes_per_s=emulation["copy_bytes_per_s"],
        link_bytes_per_s=emulation["link_bytes_per_s"],
        link_latency_s=emulation["link_latency_s"],
        expert_bytes=expert_bytes,
        request_bytes=request_bytes,
        result_bytes=result_bytes,
        align_bytes=align,
        host_memory_bytes_per_s=emulation.get("host_memory_bytes_per_s"),
        host_flops=emulation.get("host_flops"),
        expert_flops=2.0 * 3 * hidden * family_for(config).expert_intermediate(config),
        stored_bytes=None if codec is None else codec["stored_bytes"],
        decode_s=0.0 if codec is None else codec["decode_s"],
    )


def predict_strategies(
    strategies: list[str],
    shape: Shape,
    costs: MachineCosts,
    rates: EmulatedRates,
    generations: list[dict],
    *,
    hybrid: bool = False,
    drafts: tuple[int, float] | None = None,
    draft_auto: bool = False,
) -> dict[str, float | None]:
    """The local model's decode tok/s for each strategy (None for one it does not model); ``drafts``:
    (k, tokens per pass) for odmoe drafting k tokens a pass, or with ``draft_auto`` up to k as
    ``draft_policy="auto"`` picks, at the agreement under which k drafts yield those tokens."""
    predicted: dict[str, float | None] = {}
    k, tokens_per_pass = drafts or (0, 1.0)
    for strategy in strategies:
        if strategy not in STRATEGIES:
            predicted[strategy] = None
            continue
        # hybrid: the runtime applies it under every strategy
        options = Options(
            strategy, recall=1.0, hybrid=hybrid, drafts=k, tokens_per_pass=tokens_per_pass, draft_auto=draft_auto
        )
        predicted[strategy] = predict(options, shape, costs, rates, generations)
    return predicted


def predict_from_inputs(inputs: dict, strategies: list[str], *, hybrid: bool = False) -> dict[str, float | None]:
    """Re-run the prediction from a recorded ``inputs`` block (what `predict_for_run` returns)."""
    return predict_strategies(
        strategies,
        Shape(**inputs["shape"]),
        MachineCosts(**inputs["machine"]),
        EmulatedRates(**inputs["rates"]),
        inputs["generations"],
        hybrid=hybrid,
    )


def predict_for_run(
    emulation: dict,
    config: dict,
    expert_bytes: int,
    *,
    workers: int,
    strategies: list[str],
    model_dir: Path,
    prompts: list[list[int]],
    outputs: list[list[int]],
    cache_experts: int = 2,
    max_resident: int = 2,
    hybrid: bool = False,
    machine: MachineCosts | None = None,
    measurement: dict | None = None,
    codec: dict | None = None,
    drafts: tuple[int, float] | None = None,
    draft_auto: bool = False,
    shadow_dtype: str | None = None,
) -> dict:
    """{strategy: predicted decode tok/s} for a `benchmarks.strategies` run, plus what it rests on.

    ``drafts`` (k, tokens per pass, measured before the run): odmoe drafting k tokens a pass; with
    ``draft_auto``, up to k as ``draft_policy="auto"`` picks (``inference.sim.local.AutoPasses``).
    With a fixed k and ``shadow_dtype``, main's real engine predicts it too, its shadow a copy in
    that dtype (``predict_drafts_in_engine``: ``engine_driven``).

    ``codec`` (``measure_decode``): the workers' experts are coded; each load is charged its decode here
    and its coded bytes on the emulated copy.

    ``emulation`` is `Emulation.as_dict()`; ``outputs`` are Transformers' greedy tokens for
    ``prompts`` (the benchmark's ``expected``); strategies the local model does not cover (the
    approximate ones) get None. ``machine`` and ``measurement`` are what `measure_machine`
    returned (measured here when not given). Where the costs were measured in the runtime's
    rhythm, the prediction with the tight-loop costs is made too (the model before it used them).
    """
    if machine is None:
        machine, measurement = measure_for_run(emulation, config, model_dir)
    costs, measured = machine, measurement or {}
    generations = routing_traces(model_dir, prompts, outputs)
    rates = rates_for(emulation, config, expert_bytes, codec)
    shape = run_shape(config, workers=workers, max_resident=max_resident, cache_experts=cache_experts)

    def strategies_at(at: MachineCosts) -> dict[str, float | None]:
        """The run's prediction at the per-layer costs ``at``."""
        return predict_strategies(
            strategies, shape, at, rates, generations, hybrid=hybrid, drafts=drafts, draft_auto=draft_auto
        )

    predicted = strategies_at(costs)
    tight = measured.get("tight_loop") if "in_rhythm" in measured else None
    driven = None
    if drafts is not None and not draft_auto and shadow_dtype is not None:
        driven = predict_drafts_in_engine(
            model_dir,
            prompts,
            outputs,
            shadow_dtype=shadow_dtype,
            drafts=drafts[0],
            shape=shape,
            costs=costs,
            rates=rates,
        )
    return {
        "predicted_decode_tok_s": predicted,
        "predicted_decode_tok_s_tight_loop_costs": None if tight is None else strategies_at(MachineCosts(**tight)),
        "inputs": {
            "shape": dataclasses.asdict(shape),
            "rates": dataclasses.asdict(rates),
            "machine": costs.as_dict(),
            "generations": generations,
        },
        "engine_driven": driven,
        "machine": costs.as_dict(),
        "measurement": measured,
        "next_gate_recall": next_gate_recall(generations),
        "assumptions": prediction_assumptions(measured, tight, codec=codec, drafts=drafts),
    }


def measure_for_run(emulation: dict, config: dict, model_dir: Path) -> tuple[MachineCosts, dict]:
    """`measure_machine` for a run on ``emulation`` (`Emulation.as_dict()`): at its expert compute
    time here, in the runtime's rhythm on ``model_dir``, a held message woken on its emulated link."""
    return measure_machine(
        config,
        emulation["expert_compute_here_s"],
        model_dir=model_dir,
        link_latency_s=emulation["link_latency_s"],
        link_bytes_per_s=emulation.get("link_bytes_per_s"),
    )


def run_shape(config: dict, *, workers: int, max_resident: int, cache_experts: int) -> Shape:
    """The simulated cluster of a run: the checkpoint's layers, experts and top-k on ``workers``
    workers, each holding ``max_resident`` experts at once (``cache_experts`` per layer cached)."""
    return Shape(
        layers=config["num_hidden_layers"],
        experts=family_for(config).n_experts(config),
        top_k=config["num_experts_per_tok"],
        workers=workers,
        max_resident=max_resident,
        cache_experts=cache_experts,
    )


def prediction_assumptions(
    measured: dict, tight: dict | None, *, codec: dict | None, drafts: tuple[int, float] | None
) -> list[str]:
    """What a `predict_for_run` prediction assumes, in words: where its per-layer costs come from
    (``tight``: the tight-loop costs kept beside the in-rhythm ones), coded experts, drafts."""
    return [
        "odmoe's shadow has the model's own precision (recall 1); one token ahead",
        "each role computes on a core of its own: CPU contention between roles is not modelled",
        "per-layer costs measured at prediction time; the run may see the machine in another state",
        "per-layer costs measured in a main + one worker of the runtime (its rhythm), not in the run's cluster"
        if tight is not None
        else measured.get("in_rhythm_skipped") or "per-layer costs timed piece by piece in tight loops",
        *(
            []
            if codec is None
            else ["coded experts: each load is its decode on this CPU (measured alone, one thread) then its copy"]
        ),
        *(
            []
            if drafts is None
            else [
                f"drafts: {drafts[0]} a pass, {drafts[1]:.2f} tokens a pass as measured before the run "
                "(benchmarks.draft_agreement, roles in-process); a rejected draft routes as the next token"
            ]
        ),
    ]


def validate(recorded: Path, *, strategies: list[str] | None = None) -> dict:
    """Predict a recorded `benchmarks.strategies` JSON's run and compare with what it measured."""
    from inference.modelio.checkpoint import Checkpoint, expert_key_name
    from inference.tools.reference import reference_generate
    from inference.tools.tiny import make_tiny

    run = json.loads(recorded.read_text())
    names = strategies or [s for s in run["strategies"] if s in STRATEGIES]
    with tempfile.TemporaryDirectory(prefix="odmoe-simpred-") as tmp:
        model_dir = make_tiny(Path(tmp) / "model", seed=0, **BENCH_MODEL)
        checkpoint = Checkpoint(model_dir)
        config = checkpoint.config
        expert_bytes = sum(checkpoint.nbytes(expert_key_name(0, 0, p)) for p in ("w1", "w2", "w3"))
        pairs = [tuple(p) for p in run["pairs"]]
        prompts = [prompt_of(n_in, config["vocab_size"], seed=i) for i, (n_in, _) in enumerate(pairs)]
        outputs = [reference_generate(model_dir, p, n) for p, (_, n) in zip(prompts, pairs, strict=True)]
        prediction = predict_for_run(
            run["emulation"],
            config,
            expert_bytes,
            workers=run["workers"],
            strategies=names,
            model_dir=model_dir,
            prompts=prompts,
            outputs=outputs,
        )
    rows = {}
    for name in names:
        measured = run["strategies"][name]["decode_tok_s"]
        pred = prediction["predicted_decode_tok_s"][name]
        pair_rates = [p["decode_tok_s"] for p in run["strategies"][name]["pairs"]]
        rows[name] = {
            "measured_decode_tok_s": measured,
            "sim_predicted_decode_tok_s": pred,
            "error": (pred - measured) / measured,
            "measured_pair_spread": (max(pair_rates) - min(pair_rates)) / measured,
        }
    return {"recorded": str(recorded), "strategies": rows, **prediction}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", type=Path, required=True, help="a benchmarks.strategies JSON")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    result = validate(args.validate)
    print("| strategy | measured decode tok/s | predicted | error |\n|---|---:|---:|---:|")
    for name, row in result["strategies"].items():
        print(
            f"| {name} | {row['measured_decode_tok_s']:.2f} | {row['sim_predicted_decode_tok_s']:.2f} "
            f"| {row['error']:+.0%} |"
        )
    print(f"machine: {json.dumps(result['machine'])}", file=sys.stderr)
    if args.json:  # the machine's measured costs under their own name: "machine" is provenance's
        costs = {("machine_costs" if key == "machine" else key): value for key, value in result.items()}
        provenance.write(args.json, costs, begun, "torch", "transformers", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
