"""Every number the simulator uses, with its unit, where it comes from and why it is there.

Nothing here was fitted to the OD-MoE paper's table: hardware figures come from vendor specs or
standards, implementation efficiencies from published measurements of *other* systems or from our
own measurements on this repository's CI box (`python -m inference.sim.measure`, recorded below with
the date), routing statistics from the Mixtral and OD-MoE papers. `derived(...)` values say how they
were computed from the others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Source:
    value: float
    unit: str
    source: str
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


GB = 1e9
MB = 1e6

# ---- GPUs -----------------------------------------------------------------------------------------
_GPUS = {
    "rtx3090_memory_bandwidth": Source(
        936 * GB, "B/s", "NVIDIA RTX 3090 spec: GDDR6X 19.5 Gbps x 384-bit = 936 GB/s", "decode is memory-bound"
    ),
    "rtx3090_fp16_tensor_flops": Source(
        71e12,
        "FLOP/s",
        "NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16 tensor with FP32 accumulate, dense (142 sparse); "
        "35.6 TFLOPS is the non-tensor FP32/FP16 rate. PyTorch fp16 GEMMs accumulate in FP32.",
        "prefill GEMMs are compute-bound",
    ),
    "rtx3090_memory": Source(24 * 2**30, "B", "NVIDIA RTX 3090 spec: 24 GB GDDR6X", "capacity checks"),
    "rtx3080_memory_bandwidth": Source(760 * GB, "B/s", "NVIDIA RTX 3080 (10 GB) spec: 19 Gbps x 320-bit", "decode"),
    "rtx3080_fp16_tensor_flops": Source(
        59.5e12, "FLOP/s", "NVIDIA GA102 whitepaper, RTX 3080: FP16 tensor, FP32 accumulate, dense", "prefill"
    ),
    "rtx3080_memory": Source(10 * 2**30, "B", "NVIDIA RTX 3080 spec: 10 GB GDDR6X", "capacity checks"),
    "orin_memory_bandwidth": Source(
        204.8 * GB, "B/s", "NVIDIA Jetson AGX Orin 64GB datasheet: 256-bit LPDDR5, 204.8 GB/s", "decode"
    ),
    "orin_fp16_tensor_flops": Source(
        42.5e12,
        "FLOP/s",
        "derived: Jetson AGX Orin 64GB datasheet GPU 170 sparse INT8 TOPS -> 85 dense INT8 -> 42.5 dense FP16",
        "prefill",
    ),
    "orin_memory": Source(64 * 2**30, "B", "Jetson AGX Orin 64GB datasheet (unified CPU/GPU memory)", "capacity"),
    "orin_unified_copy_bandwidth": Source(
        102.4 * GB,
        "B/s",
        "derived: unified LPDDR5, an expert 'load' is a device copy that reads and writes: 204.8 / 2",
        "edge boxes have no PCIe hop; loading still moves the bytes once",
    ),
    "a100_80gb_memory_bandwidth": Source(
        2039 * GB, "B/s", "NVIDIA A100 80GB SXM datasheet", "denominator of the gpt-fast MBU below"
    ),
}

# ---- links ------------------------------------------------------------------------------------------
_LINKS = {
    "pcie4_x16_peak": Source(
        31.5 * GB, "B/s", "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b encoding", "roofline host->GPU copy"
    ),
    "pcie4_x16_pinned_effective": Source(
        25 * GB,
        "B/s",
        "CUDA bandwidthTest host->device from pinned memory on PCIe 4.0 x16 RTX 30-series boards, "
        "commonly reported 24-26 GB/s (TLP/DLLP overhead takes ~15-20 % of 31.5)",
        "what an expert copy from pinned host RAM achieves",
    ),
    "pcie4_x16_copy_latency": Source(
        10e-6, "s", "CUDA memcpy/launch latency order of magnitude (NVIDIA bandwidthTest small sizes)", "per copy"
    ),
    "nvme_ssd_seq_read": Source(
        3.5 * GB,
        "B/s",
        "Samsung 970 EVO Plus (PCIe 3.0 x4 NVMe) data sheet: sequential read up to 3,500 MB/s",
        "a worker's disk expert store reads each expert from its local SSD at every load",
    ),
    "ddr4_3200_dual_channel_peak": Source(
        51.2 * GB,
        "B/s",
        "JEDEC DDR4-3200: 3200 MT/s x 8 bytes x 2 channels (a desktop board of the kind a 3090 sits in)",
        "roofline rate at which a worker's CPU reads an expert from host memory to compute it there",
    ),
    "ddr4_3200_dual_channel_effective": Source(
        40 * GB,
        "B/s",
        "ASSUMED (no measurement of the paper's hosts): STREAM-style read bandwidth of dual-channel "
        "DDR4-3200 desktops is commonly reported at 35-45 GB/s, ~80 % of the 51.2 GB/s peak; 40",
        "a batch-1 expert computed on the worker's CPU reads its weights once at this rate (hybrid execution)",
    ),
    "desktop_cpu_fp32_flops": Source(
        0.9e12,
        "FLOP/s",
        "derived: an 8-core AVX2 desktop CPU at 3.5 GHz, 2 FMA units x 8 fp32 lanes x 2 FLOP = 32 FLOP/cycle/core",
        "the compute bound of an expert on the worker's CPU when many rows share it (prefill, batches)",
    ),
    "orin_cpu_memory_effective": Source(
        102.4 * GB,
        "B/s",
        "ASSUMED: the Orin's CPU cluster reads the shared 204.8 GB/s LPDDR5 at about half its peak",
        "hybrid execution on the edge profile",
    ),
    "orin_cpu_fp32_flops": Source(
        0.42e12,
        "FLOP/s",
        "derived: Jetson AGX Orin 64GB datasheet, 12 Cortex-A78AE cores at 2.2 GHz, "
        "4 NEON FMA lanes x 2 pipes x 2 FLOP",
        "hybrid execution on the edge profile",
    ),
    "ethernet_1g_peak": Source(125 * MB, "B/s", "IEEE 802.3ab line rate 1 Gb/s", "roofline network"),
    "ethernet_1g_effective": Source(
        117.6 * MB,
        "B/s",
        "derived: TCP goodput with 1500-byte MTU = 1e9/8 x 1448/1538 (TCP/IP+timestamps, Ethernet framing, "
        "preamble, inter-frame gap)",
        "payload rate of a saturated 1 GbE link",
    ),
    "ethernet_1g_latency": Source(
        100e-6,
        "s",
        "one-way small-message latency on a switched 1 GbE LAN: ping RTT is typically 0.1-0.3 ms",
        "each hop of a hidden state pays it",
    ),
    "ethernet_10g_effective": Source(1176 * MB, "B/s", "derived as for 1 GbE, x10", "profile 3090-pcie4-10gbe"),
    "ethernet_10g_peak": Source(1250 * MB, "B/s", "IEEE 802.3 10GBASE-T line rate", "roofline network"),
    "ethernet_10g_latency": Source(50e-6, "s", "typical 10 GbE one-way latency with kernel TCP", "per hop"),
    "wifi6_effective": Source(
        75 * MB,
        "B/s",
        "Wi-Fi 6 (802.11ax) 2x2 80 MHz: PHY 1.2 Gb/s, real-world single-client TCP ~500-700 Mb/s",
        "edge profile",
    ),
    "wifi6_peak": Source(150 * MB, "B/s", "802.11ax 2x2 80 MHz PHY rate 1201 Mb/s", "roofline network"),
    "wifi6_latency": Source(1.5e-3, "s", "Wi-Fi LAN ping RTT typically 2-5 ms; half of ~3 ms", "per hop"),
    "message_cpu_overhead": Source(
        50e-6,
        "s",
        "assumed: pyzmq multipart send or receive of a small header + one raw frame plus Python framing; "
        "ZeroMQ's own latency tests put the library at tens of microseconds",
        "per message, on each side, adjusted model only",
    ),
}

# ---- implementation efficiency ------------------------------------------------------------------------------
_GPT_FAST_EAGER_TOK_S = 25.5
_EFFICIENCY = {
    "gpt_fast_compiled_mbu": Source(
        1397.31 * GB / (2039 * GB),
        "fraction",
        "derived: gpt-fast README, Llama-2-7B fp16 on A100-80GB: 104.9 tok/s at 1397.31 GB/s achieved, "
        "over the 2039 GB/s peak",
        "fraction of memory roofline that PyTorch/cuBLAS decode kernels reach at batch 1 (no CPU overhead left)",
    ),
    "gpt_fast_eager_tok_s": Source(
        _GPT_FAST_EAGER_TOK_S,
        "tok/s",
        "PyTorch blog 'Accelerating Generative AI with PyTorch II: GPT, Fast' (2023): eager Llama-2-7B on "
        "A100-80GB starts at 25.5 tok/s and is 'heavily CPU overhead bound'",
        "anchor for eager-PyTorch CPU time per decoder layer on a GPU server",
    ),
    "eager_dense_layer_cpu": Source(
        1 / _GPT_FAST_EAGER_TOK_S / 32,
        "s",
        "derived: 1 / 25.5 tok/s / 32 layers (the GPU part, ~9.5 ms/token compiled, is hidden under CPU time)",
        "CPU launch time of one eager Llama-style block (norms, attention, MLP) on a GPU server",
    ),
    "hf_mistral_layer_cpu_here": Source(
        0.638e-3,
        "s",
        "measured 2026 on this repo's CI box (AMD EPYC, 2 threads, torch 2.13 CPU, transformers 5.24): tiny "
        "MistralForCausalLM, one decode layer (python -m inference.sim.measure)",
        "scales CPU times measured here to a GPU server (eager_dense_layer_cpu / this)",
    ),
    "hf_mistral_ops_per_layer": Source(
        74, "ops", "measured as above (aten ops one decode layer dispatches); re-measured 2026-12-02: 74", "per-op cost"
    ),
    # Transformers' Mixtral MoE block, re-measured here instead of derived from another family's
    # benchmark: `MixtralExperts.forward` (transformers 5.24, experts_implementation="eager", the only
    # implementation of Transformers 4.x) loops over the *hit* experts only, each behind a
    # `torch.where` (a host sync on a GPU). A decode token hits top_k experts, so the layer's aten ops
    # with top-1 and top-2 routing split the block's CPU time into a fixed part and a part per hit expert.
    "hf_mixtral_ops_per_layer_top1": Source(
        102,
        "ops",
        "measured 2026-12-02 on this repo's CI box (torch 2.13 CPU, transformers 5.24, eager experts): tiny "
        "MixtralForCausalLM with num_experts_per_tok=1, aten ops per decode layer "
        "(inference.sim.measure.ops_per_layer)",
        "Mixtral's layer with one expert hit",
    ),
    "hf_mixtral_ops_per_layer_top2": Source(
        125,
        "ops",
        "measured as above with num_experts_per_tok=2 (Mixtral's own top-2)",
        "Mixtral's layer with two experts hit: 23 ops per hit expert, 5 ops beyond the Mistral layer's 74 fixed",
    ),
    "hf_mixtral_step_fixed_here": Source(
        0.583e-3,
        "s",
        "measured as above: per-forward time of the tiny MixtralForCausalLM outside its layers "
        "(embedding, masks, final norm, LM head)",
        "per-token fixed CPU time",
    ),
    "assumed_prefill_mfu": Source(
        0.5,
        "fraction",
        "ASSUMED (no independent measurement at hand): cuBLAS fp16 GEMMs reach 60-80 % of tensor peak on "
        "large shapes; prefill shapes here are small (16-128 rows, expert slices of a few tokens), so half",
        "prefill GEMM efficiency; affects TTFT only",
    ),
    "pytorch_ops_per_expert_call": Source(
        6, "ops", "count of the expert FFN: linear, chunk, silu, mul, linear, scale", "worker-side CPU per expert"
    ),
    "cuda_context_memory": Source(
        0.5 * GB,
        "B",
        "CUDA context + cuBLAS workspace + PyTorch caching-allocator slack of one process, commonly 0.3-0.6 GB "
        "in nvidia-smi",
        "memory per GPU process",
    ),
}

# ---- routing and prediction ---------------------------------------------------------------------------
_ROUTING = {
    "mixtral_repeat_any_layer0": Source(
        0.48,
        "fraction",
        "Mixtral of Experts (Jiang et al. 2024, arXiv 2401.04088) Sec. 5 / Table 5: share of consecutive "
        "tokens that get the same expert as first or second choice, layer 0, mean over The Pile subsets "
        "(random top-2 of 8 gives 46 %)",
        "temporal locality drives LRU hit rates",
    ),
    "mixtral_repeat_any_layer15": Source(0.63, "fraction", "same table, layer 15 (61.6-67.0 %)", "locality"),
    "mixtral_repeat_any_layer31": Source(0.51, "fraction", "same table, layer 31 (44.5-53.6 %)", "locality"),
    "odmoe_recall_fp16": Source(
        0.9994, "fraction", "OD-MoE paper (arXiv, Wang et al. 2025): shadow aligned every step", "recall"
    ),
    "odmoe_recall_int8": Source(0.9734, "fraction", "OD-MoE paper, int8 shadow aligned every step", "recall"),
    "odmoe_recall_nf4": Source(0.9567, "fraction", "OD-MoE paper, nf4 shadow aligned every step", "recall"),
    "mixtral_offloading_cache_per_layer": Source(
        4,
        "experts",
        "dvmazur/mixtral-offloading demo notebook: offload_per_layer = 4 of 8 on a 16 GB card (5 for 12 GB); "
        "a 24 GB 3090 can hold at least that",
        "LRU cache size C for lru-offload",
    ),
    "mixtral_offloading_expert_bits": Source(
        3.02,
        "bit/weight",
        "derived: their HQQ expert config nbits=2, group_size=16, zero and scale quantized to 8 bit "
        "(meta group 128): 2 + 16/16 + 32/(16*128)",
        "bytes moved per expert load in lru-offload",
    ),
    "mixtral_offloading_copies_per_miss": Source(
        2,
        "copies",
        "dvmazur/mixtral-offloading src/expert_cache.py ExpertCache._swap: a miss swaps the evicted expert out "
        "(device -> pinned host) and the needed one in (pinned host -> device), both copy_(non_blocking=True) "
        "on the current stream, which the expert kernels use too",
        "a miss moves an expert's bytes twice over PCIe, serialised with the layer's compute",
    ),
    "mixtral_offloading_published_tok_s_low": Source(
        2.0,
        "tok/s",
        "Eliseev & Mazur 2023 (arXiv 2312.17238), as summarised (abstract / third-party summaries; their Table 2 "
        "not re-read): 2-3 tok/s on low-tier GPUs (RTX 3060, RTX 3080 Mobile), about 2 on a Colab T4, "
        "0.6 with naive offloading",
        "published absolute figure to check lru-offload against (not used by the model)",
    ),
    "mixtral_offloading_published_tok_s_high": Source(
        3.0, "tok/s", "same summary: the upper end of 2-3 tok/s", "published absolute figure (not used by the model)"
    ),
    "mixtral_offloading_attention_bits": Source(
        4.25, "bit/weight", "derived: HQQ attention config nbits=4, group_size=64: 4 + 16/64", "attention bytes"
    ),
    "speculative_prefetch_recall": Source(
        0.85,
        "fraction",
        "Eliseev & Mazur 2023 (arXiv 2312.17238) Fig. 2 right: recall of guessing the next layer's experts "
        "from the next gate on the current hidden state, 1 layer ahead, 2 experts (reported 80-90 %); "
        "note their released repo lists speculative prefetching as not yet available (README, 'Work in progress'), "
        "so the paper-testbed model runs without it and reports it as a what-if",
        "prefetch hits in lru-offload",
    ),
}

CONSTANTS: dict[str, Source] = {**_GPUS, **_LINKS, **_EFFICIENCY, **_ROUTING}


def value(name: str) -> float:
    return CONSTANTS[name].value


def constants_table() -> dict[str, dict]:
    """All constants as JSON-able dicts, for reports."""
    return {name: source.as_dict() for name, source in CONSTANTS.items()}
