"""A deployment's runtime settings, declared once: each field's default, allowed values and doc.

Every place that holds a setting derives from this declaration instead of spelling it
again: the role spec (``inference.runtime.spec.RoleSpec.settings``), the memory planner's
keyword defaults (``inference.building.memory``), the control plane's ``Deployment`` model, its DRF
serializers and services, and the ``python -m inference generate`` flags. A field's
metadata (``info(name)``) says what it accepts: ``choices`` (``blank`` when "" means "the
strategy's own"), or a numeric ``minimum`` / ``maximum`` (``exclusive`` when the minimum
itself is refused), and its ``doc``. ``validate_settings`` checks a value against that
metadata, then the rules that tie fields together.

Why this way: the control plane's web and Celery processes must not import torch, and the
role spec (``inference.runtime.spec``) does; this module imports only the torch-free policy modules
(strategies, constants), so the web process can share the declaration with the runtime.
A frozen dataclass rather than a msgspec Struct: the runtime builds, copies
(``dataclasses.replace``) and serializes (``asdict``) it in many places; a spec file's fields are
checked against their hints by msgspec's validation (``check_types``), and the field metadata
carries the rest.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from inference.constants import (
    BATCH_ARITHMETICS,
    COMPUTE_DTYPES,
    DEFAULT_MAX_PER_USER,
    DEFAULT_MAX_WAITING,
    DRAFT_POLICIES,
    EXPERT_CODECS,
    EXPERT_STORES,
    EXPERTS_ARITHMETICS,
    MAX_BATCH,
    MAX_DRAFT_TOKENS,
    MAX_MIGRATIONS_LIMIT,
    REPLAY_MODES,
    SHADOW_DTYPES,
)
from inference.policies.strategies import (
    DEFAULT_STRATEGY,
    PREDICTORS,
    RUNTIME_STRATEGIES,
    expert_store_for,
    get_strategy,
    predictor_for,
)


class SpecError(ValueError):
    """A spec file (or settings) that cannot be used, with the reason."""


@dataclass(frozen=True)
class SettingInfo:
    """What one setting accepts and means (a field's metadata, with its name, type and default)."""

    name: str
    type: Any
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    blank: bool = False  # "" is accepted beside ``choices``: the strategy's own
    minimum: float | None = None
    maximum: float | None = None
    exclusive: bool = False  # the minimum itself is refused (> rather than >=)
    code: str = ""  # the module that acts on it: the reference table shows it, help texts do not

    @property
    def nullable(self) -> bool:
        return isinstance(self.type, types.UnionType) and type(None) in typing.get_args(self.type)


def setting(
    default: Any,
    doc: str,
    *,
    choices: tuple[str, ...] = (),
    blank: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive: bool = False,
    code: str = "",
) -> Any:
    """A field of ``DeploymentSettings``: its default and, in its metadata, what it accepts and means.
    ``doc`` names no file (it becomes the API's and the admin's help text, which a move must not
    change); ``code`` is the module that acts on the setting, for the reference table."""
    metadata = {
        "doc": doc,
        "choices": choices,
        "blank": blank,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive": exclusive,
        "code": code,
    }
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DeploymentSettings:
    shadow_dtype: str = setting(
        "fp32",
        "what the shadow computes in: a pre-quantized copy of the whole model (int8, nf4) or a cast (fp32, "
        "bf16, fp16); the checkpoint's own dtype needs no converted shard",
        choices=SHADOW_DTYPES,
    )
    token_period: int = setting(1, "align the shadow's token every N steps (0 never)", minimum=0)
    kv_period: int = setting(1, "align the shadow's KV cache every N steps (0 never)", minimum=0)
    device: str = setting("auto", '"auto" picks CUDA when present, else CPU; or cpu, cuda[:N]')
    dtype: str = setting(
        "auto", 'what main and workers compute in: "auto" = the checkpoint\'s dtype', choices=COMPUTE_DTYPES
    )
    max_resident_experts: int = setting(
        0,
        "experts a worker holds on its device at once (computing, copying, copied ahead); 0: its prefetch "
        "depth, from its group and the model's top-k (2 for Mixtral on groups of 2 or more), "
        "which the memory plans and the fit check reserve too",
        minimum=0,
        code="inference.policies.depth",
    )
    staging_buffers: int = setting(
        3,
        'pinned host buffers a GPU worker with the "disk" store reads each expert into on its way to the '
        "device, used in turn; a copy pass holds at most the worker's resolved depth, "
        "so no more than that many are made",
        minimum=1,
        code="inference.runtime.staging",
    )
    timeout_s: float = setting(
        60.0, "the longest any role waits for a peer before failing (seconds)", minimum=0, exclusive=True
    )
    lookahead: int = setting(2, "how many steps the shadow may run ahead of main", minimum=0)
    speculate: bool = setting(
        True,
        "when aligned every step, the shadow runs the next step on its own guess of main's token before "
        "main's alignment arrives, so early layers' predictions are out in time",
    )
    draft_tokens: int = setting(
        0,
        "tokens the shadow drafts for each decode pass of main, which main verifies in one round of expert "
        "copies and keeps while they equal its own (0: off, main decodes a token a pass). With drafts the "
        "shadow runs only as far as main asks, so speculate and lookahead do not apply; needs the shadow predictor",
        minimum=0,
        maximum=MAX_DRAFT_TOKENS,
    )
    draft_policy: str = setting(
        "fixed",
        "how many tokens a pass drafts: fixed (always draft_tokens) or auto (per pass, up to draft_tokens, the "
        "number with the most tokens per second from the measured agreement, expert overlap and costs of "
        "main's recent passes)",
        choices=DRAFT_POLICIES,
        code="inference.policies.drafting",
    )
    threads: int = setting(1, "torch intra-op threads per role process", minimum=1)
    copy_bytes_per_s: float | None = setting(
        None, "emulated host->device bandwidth; null = real copies", minimum=0, exclusive=True
    )
    experts_arithmetic: str = setting(
        "auto",
        'how main sums expert outputs: as Transformers\' grouped or eager experts do; "auto" picks grouped '
        "unless torch's grouped GEMM cannot run the model's shapes",
        choices=EXPERTS_ARITHMETICS,
    )
    prefill_chunk: int = setting(
        64, "prefill rows per expert per message (mini-batches overlap transfer and compute); 0 = whole", minimum=0
    )
    strategy: str = setting(
        DEFAULT_STRATEGY,
        "what workers keep on the device and who predicts (importance and prerouter are approximate)",
        choices=RUNTIME_STRATEGIES,
        code="inference.policies.strategies",
    )
    predictor: str = setting(
        "",
        "who names the experts to load ahead: the shadow, main's next-layer "
        "router (next-gate) or main's trained heads (prerouter); \"\" = the strategy's own",
        choices=PREDICTORS,
        blank=True,
        code="inference.policies.strategies",
    )
    importance_threshold: float = setting(
        0.3,
        "importance (approximate): a routed expert whose routing weight is below this and that no worker "
        "holds is replaced by the most similar one that is held; 0 substitutes "
        "nothing. 0.3 was chosen before anything was measured; the quality benchmark reports other values",
        minimum=0,
        maximum=1,
        code="inference.runtime.importance",
    )
    cache_experts: int = setting(2, "lru-offload, importance: experts each worker keeps per layer", minimum=0)
    link_bytes_per_s: float | None = setting(
        None, "emulated network uplink of every role (bytes/s); null = the real one", minimum=0, exclusive=True
    )
    link_latency_s: float = setting(0.0, "emulated one-way network latency of every role (seconds)", minimum=0)
    expert_store: str = setting(
        "",
        'where workers keep their experts: "ram" (read at start), "disk" (read at each load) or "hot" (read '
        'from disk, the last hot_experts kept in RAM, predicted ones pinned); "" = the strategy\'s own '
        '(prerouter: "hot", the others "ram")',
        choices=EXPERT_STORES,
        blank=True,
    )
    hot_experts: int = setting(16, "hot store: experts each worker keeps in RAM", minimum=1)
    expert_codec: str = setting(
        "none",
        'how the shard build writes the workers\' experts: "none" as the checkpoint holds them, or '
        '"exponent-plane": lossless, each weight\'s exponent bits coded in a few bits each and the rest raw '
        "(the bytes it saves per dtype: the benchmarks' expert codecs page). Workers "
        "keep and read the coded bytes and decode each expert as it is loaded, a GPU worker on its GPU after the "
        "copy carried the coded bytes. Taken by the runtime's generate and "
        "shard commands and by a deployment, whose shard build keeps a set per codec; applied on its next start",
        choices=EXPERT_CODECS,
        code="inference.modelio.expert_codec",
    )
    disk_bytes_per_s: float | None = setting(
        None,
        'emulated disk read bandwidth of the "disk" and "hot" stores; null = the real one',
        minimum=0,
        exclusive=True,
    )
    max_batch: int = setting(
        8,
        "sequences main runs at once (continuous batching)",
        minimum=1,
        maximum=MAX_BATCH,
        code="inference.runtime.batching",
    )
    max_waiting: int = setting(
        DEFAULT_MAX_WAITING, "requests main holds beyond its batch before it refuses new ones", minimum=0
    )
    # Below max_batch + max_waiting, so that one user sending many leaves room for the others: 32
    # lets an evaluation harness or a batch client send 32 at once and leaves 40 places to everyone else.
    max_per_user: int = setting(
        DEFAULT_MAX_PER_USER,
        "generations one user may have in main at once, running and waiting (more are refused as too many "
        "generations, not full); below max_batch + max_waiting, so others still get in",
        minimum=1,
    )
    replay: str = setting(
        "prefill",
        "how main's agent carries an answer across main's restart: prefill (the tokens already sent re-read "
        "as prompt in one prefill: what the model continues from them) or exact (the request run again from "
        "its start, each sent token checked and not sent twice: the undisturbed answer, at one decode step "
        "per token sent)",
        choices=REPLAY_MODES,
    )
    max_migrations: int = setting(
        1,
        "main restarts one answer is carried across (0: none; the answer ends with a retryable error, as "
        "it does past this many)",
        minimum=0,
        maximum=MAX_MIGRATIONS_LIMIT,
    )
    max_replay_tokens: int = setting(
        4096,
        "the most tokens already sent that carrying an answer across main's restart re-reads (past them, a "
        "retryable error): a prefill of that many under prefill, a decode step each under exact",
        minimum=0,
    )
    batch_arithmetic: str = setting(
        "exact",
        "how a worker computes an expert's rows of several sequences: \"exact\" (each sequence's rows on "
        'their own, so every token is its own run\'s) or "fused" (one GEMM over all of them: the weights '
        "read once, but it may round differently from one over a single row, e.g. fp32 on CPU)",
        choices=BATCH_ARITHMETICS,
    )
    prefill_step: int = setting(
        0,
        "prompt tokens a joining sequence prefills per batch step (chunked prefill); 0 = the whole prompt in "
        "one step. Not exact by construction: a prompt prefilled in pieces rounds differently from one "
        "prefilled whole (fp32 on CPU: last-token logits differ by about 4e-6)",
        minimum=0,
    )
    prefix_cache: bool = setting(
        True,
        "main and the shadow keep finished sequences' KV (blocks of 16 tokens, least recently used out, within "
        "the KV the fit check reserves) and a prompt that begins the same way prefills only the rest. "
        "Its tokens are those of Transformers continuing from that cache; a "
        "prefix computed during decode may round otherwise than the same prefix prefilled whole",
        code="inference.runtime.prefix_cache",
    )
    hybrid: bool = setting(
        False,
        "hybrid CPU/GPU execution: a worker computes a requested expert on its CPU from "
        "host memory when that finishes before its copy to the device would; exact on CPU workers, on CUDA "
        'the CPU\'s kernels may round otherwise, hence off by default. Needs the "ram" expert store',
        code="inference.policies.hybrid",
    )
    host_memory_bytes_per_s: float | None = setting(
        None, "emulated rate a worker's CPU streams weights at (bytes/s); null = measured", minimum=0, exclusive=True
    )
    host_flops: float | None = setting(
        None, "emulated FLOP/s of a worker's CPU path; null = measured", minimum=0, exclusive=True
    )


DEFAULTS = DeploymentSettings()


def info(name: str) -> SettingInfo:
    """What the setting ``name`` accepts and means; ``KeyError`` for a name that is not one."""
    return INFO[name]


def _infos() -> dict[str, SettingInfo]:
    hints = typing.get_type_hints(DeploymentSettings)
    return {
        f.name: SettingInfo(name=f.name, type=hints[f.name], default=f.default, **f.metadata)
        for f in dataclasses.fields(DeploymentSettings)
    }


INFO: dict[str, SettingInfo] = _infos()


def check_types(obj: object, where: str) -> None:
    """``SpecError`` naming the first field of the dataclass ``obj`` whose value has the wrong type."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]) or dataclasses.is_dataclass(value):
            continue  # a nested dataclass is checked on its own
        try:  # strict: a bool is no int, a str no number; an int is a float
            msgspec.convert(value, type=hints[f.name], strict=True)
        except msgspec.ValidationError as exc:
            raise SpecError(
                f"{where}{f.name} has the wrong type: {value!r:.60} (expected {hints[f.name]}: {exc})"
            ) from None


def check_max_per_user(max_per_user: int, max_batch: int, max_waiting: int) -> None:
    """``SpecError`` unless one user's bound leaves others a place: 1 <= it < max_batch + max_waiting."""
    if not 1 <= max_per_user < max_batch + max_waiting:
        raise SpecError(
            f"max_per_user must be at least 1 and below max_batch + max_waiting ({max_batch} + {max_waiting}), "
            f"so that one user leaves room for others; got {max_per_user}"
        )


def check_value(item: SettingInfo, value: Any) -> None:
    """``SpecError`` unless ``value`` is one the setting's metadata allows (its type is checked apart)."""
    if item.choices and not (value in item.choices or (item.blank and value == "")):
        raise SpecError(f"{item.name} must be one of {', '.join(item.choices)}, got {value!r}")
    if value is None or (item.minimum is None and item.maximum is None):
        return
    low, high = item.minimum, item.maximum
    if item.exclusive and low is not None and value <= low:
        null = " (or null for no emulation)" if item.nullable else ""
        raise SpecError(f"{item.name} must be > {low:g}{null}, got {value}")
    if low is not None and high is not None and not low <= value <= high:
        raise SpecError(f"{item.name} must be from {low:g} to {high:g}, got {value}")
    if low is not None and value < low:
        raise SpecError(f"{item.name} must be >= {low:g}, got {value}")


def check_drafts(draft_tokens: int, strategy: str, predictor: str) -> None:
    """``SpecError`` unless drafts are off, or the shadow predicts under an exact strategy (it drafts,
    main verifies); ``strategy`` and ``predictor`` must be valid already."""
    if draft_tokens and (predictor_for(strategy, predictor) != "shadow" or not get_strategy(strategy).exact):
        raise SpecError(
            "draft_tokens needs the shadow predictor under an exact strategy (the shadow drafts, main verifies), "
            f"not strategy {strategy!r} with predictor {predictor_for(strategy, predictor)!r}"
        )


def validate_settings(s: DeploymentSettings) -> DeploymentSettings:
    """Raise ``SpecError`` saying what is wrong with the runtime settings ``s``."""
    check_types(s, "settings.")
    check_max_per_user(s.max_per_user, s.max_batch, s.max_waiting)
    for item in INFO.values():
        check_value(item, getattr(s, item.name))
    try:
        predictor_for(s.strategy, s.predictor)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if s.hybrid and expert_store_for(s.strategy, s.expert_store) != "ram":
        raise SpecError(
            "hybrid execution computes experts from host memory and needs the ram expert store, "
            f"not {expert_store_for(s.strategy, s.expert_store)!r}"
        )
    check_drafts(s.draft_tokens, s.strategy, s.predictor)
    if s.device not in ("auto", "cpu") and not s.device.startswith("cuda"):
        raise SpecError(f"device must be auto, cpu or cuda[:N], got {s.device!r}")
    return s


# --- the reference table (docs/deployment-settings.md) ---------------------------------------


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def _accepts(item: SettingInfo) -> str:
    if item.choices:
        return ", ".join(f"`{c}`" for c in item.choices) + (' or `""`' if item.blank else "")
    if item.type is bool:
        return "true, false"
    low, high = item.minimum, item.maximum
    null = " or null" if item.nullable else ""
    if low is not None and high is not None:
        return f"{low:g} to {high:g}{null}"
    if low is not None:
        return f"{'>' if item.exclusive else '>='} {low:g}{null}"
    return "see its meaning"


def markdown_table() -> str:
    """Every setting with its default, what it accepts and what it means, as a Markdown table."""
    rows = ["| setting | default | accepts | meaning | in the code |", "|---|---|---|---|---|"]
    for item in INFO.values():
        doc = item.doc.replace("|", "\\|")
        code = f"`{item.code}`" if item.code else ""
        rows.append(f"| `{item.name}` | `{_shown(item.default)}` | {_accepts(item)} | {doc} | {code} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
