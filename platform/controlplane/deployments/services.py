"""Writes of the deployments app: create a deployment with its role map, change its settings.

Starting, stopping and following a running deployment live in ``lifecycle``. A deployment
whose nodes cannot hold their roles (``inference.building.memory``: RAM, GPU memory, disk, from the
checkpoint's tensor sizes) is refused when created and again when started, before anything
is built or downloaded, with each node's shortfall. Main's and the shadow's memory include a KV
cache per sequence: the deployment's ``max_batch`` sequences for main, as many for the shadow
that follows them (``inference.building.memory.shadow_max_states``), each at the full
``inference.building.memory.DEFAULT_CONTEXT_TOKENS``.

A deployment has a shadow seat only when its predictor (``Deployment.predictor``, "" = the
strategy's own; ``inference.policies.strategies.predictor_for``) is the shadow: odmoe with
``next-gate``, lru-offload, and the strategies that load nothing ahead (full-cache,
reactive) run on main and workers alone, and their memory plan has no shadow to fit.

A deployment's ``max_per_user`` bounds the generations one user has in main at once (main
queues a user's requests past its batch up to it, ``inference.runtime.batching.admission``); it must be
below ``max_batch`` + main's queue (``max_waiting``), so one user leaves others room.

A deployment's ``expert_codec`` is how its workers' shards store the experts. Its fit check
counts a worker's experts as that shard set stores them (``inference.building.tensor_sizes.with_stored_experts``)
once the set is built (by an earlier start, or another deployment of the model with the same
workers and codec); before then at the most the code can make of them whatever the weights
(``inference.building.tensor_sizes.with_coded_bound``: each tensor's raw rest plus its exponent plane's
zstandard frame at zstd's compress bound, a little over the raw size), with the decoded experts a
coded worker holds in flight in its RAM either way.

Every keyword default of a setting here is the declaration's (``inference.settings.DEFAULTS``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from controlplane.artifacts.models import ModelArtifact
from controlplane.artifacts.services import ModelError, built_set, check_registered, shard_dir_for
from controlplane.nodes.inventory import doctor_problems
from controlplane.nodes.models import Node, NodeStatus
from inference import sim
from inference.building.fit import Placed, check_plan_fit
from inference.building.memory import MemoryPlan, kv_text, memory_from_checkpoint, memory_from_config
from inference.modelio.checkpoint import Checkpoint, CheckpointError
from inference.modelio.shards import shadow_dtypes_to_build
from inference.policies.alignment import validate_periods
from inference.policies.strategies import needed_files, predictor_for
from inference.settings import (
    DEFAULTS,
    DeploymentSettings,
    SpecError,
    check_drafts,
    check_max_per_user,
    check_value,
    info,
)
from inference.sim.hardware import DEFAULT_PROFILE
from inference.sim.strategies.base import SIMULATED_SHADOW_DTYPE

from .models import ACTIVE, SETTINGS_COLUMNS, Deployment, DeploymentNode
from .roles import RoleError, RoleMap, check_roles, fixed_seats, needs_shadow, parse_seat, seats_of, suggest_roles

DEFAULT_MAX_BATCH = DEFAULTS.max_batch
DEFAULT_MAX_PER_USER = DEFAULTS.max_per_user


class DeploymentError(ValueError):
    """A deployment cannot be created or changed as asked; the message says why."""


class DeploymentDoesNotFit(DeploymentError):
    """A node cannot hold its role; the message names each node, resource and shortfall."""


def check_predictor(strategy: str, predictor: str = "") -> bool:
    """Refuse a predictor ``strategy`` cannot take; whether the deployment has a shadow seat."""
    try:
        return needs_shadow(strategy, predictor)
    except ValueError as exc:
        raise DeploymentError(str(exc)) from None


def suggest_for(
    *,
    model: ModelArtifact,
    node_ids: list[str],
    settings: DeploymentSettings = DEFAULTS,
    memory: MemoryPlan | None = None,
) -> RoleMap:
    """The suggested role map: only one whose nodes hold their roles' memory under the deployment's
    ``settings`` (main's KV caches for its ``max_batch``).

    A shadow seat only where the predictor is the shadow (``check_predictor``).
    """
    shadow = check_predictor(settings.strategy, settings.predictor)
    nodes = _nodes(node_ids)
    top_k = int(model.summary.get("top_k", 2))
    workers = len(seats_of({str(n.pk): n.inventory for n in nodes})) - fixed_seats(shadow)
    if memory is None and workers > 0:
        memory = memory_plan(model=model, workers=workers, settings=settings, shadow=shadow)
    try:
        return suggest_roles(
            {str(n.pk): n.inventory for n in nodes},
            top_k=top_k,
            memory=memory,
            names={str(n.pk): n.name for n in nodes},
            shadow=shadow,
        )
    except (RoleError, ValueError) as exc:
        raise DeploymentError(str(exc)) from None


def without_shadow(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` less its shadow role: what a deployment without a shadow seat needs."""
    return dataclasses.replace(plan, roles=tuple(r for r in plan.roles if r.role != "shadow"))


def memory_plan(*, model: ModelArtifact, workers: int, settings: DeploymentSettings, shadow: bool = True) -> MemoryPlan:
    """Memory per role of ``model`` with ``workers`` workers under the deployment's ``settings``, from
    its checkpoint's tensor sizes.

    Main's KV caches are for ``max_batch`` sequences at once, the shadow's for as many
    (``inference.building.role_memory.shadow_max_states(max_batch)``); without a shadow seat
    (``shadow`` false) the plan has no shadow role. With an ``expert_codec`` whose set for these
    workers is built, the workers' experts are counted as it stores them (``coded_set``); before it
    is built, at the bound of what the code stores (``with_coded_bound``).
    """
    try:
        shards = coded_set(model, workers, settings.expert_codec)
        plan = memory_from_checkpoint(model.path, workers=workers, settings=settings, shards=shards)
    except (CheckpointError, ValueError) as exc:
        raise DeploymentError(f"cannot size the roles of {model.name}: {exc}") from None
    return plan if shadow else without_shadow(plan)


def coded_set(model: ModelArtifact, workers: int, expert_codec: str) -> Path | None:
    """The built shard set of ``model`` for ``workers`` workers whose experts ``expert_codec`` codes, if any:
    where the memory plan reads each coded expert's stored bytes. None without a code, or before it is built."""
    if expert_codec == "none":
        return None
    out = shard_dir_for(model, workers, expert_codec)
    return out if built_set(out, workers=workers, expert_codec=expert_codec) is not None else None


def check_fits(
    *, model: ModelArtifact, settings: DeploymentSettings, seats: dict[str, tuple[Node, int | None]]
) -> MemoryPlan:
    """Refuse a role map (role name -> (node, GPU index or None)) where a node cannot hold its roles
    under the deployment's ``settings``.

    Roles on one node share its RAM and disk. A shard already on a node (its agent reports
    ``shard_bytes``) needs no new disk space; a worker's only where its agent reports it stored with
    the deployment's ``expert_codec`` (``shard_codecs``). Main holds a KV cache for each of the
    deployment's ``max_batch`` sequences, the shadow for as many (``shadow_max_states``). A map
    without a shadow seat is checked without one: the plan it returns has no shadow role. A
    worker's experts count as the deployment's ``expert_codec`` stores them where that set is built,
    and at the most it can store them before.
    """
    workers = sum(1 for role in seats if role.startswith("worker-"))
    plan = memory_plan(model=model, workers=workers, settings=settings, shadow="shadow" in seats)
    shadow_dtype, expert_codec = settings.shadow_dtype, settings.expert_codec
    present = {}
    # The shadow fetches its shard converted to its dtype (shadow-nf4...) unless that is the checkpoint's own.
    converted = "shadow" in seats and shadow_dtypes_to_build(Checkpoint(model.path).config, shadow_dtype)
    shadow_shard = f"shadow-{shadow_dtype}" if converted else "shadow"
    for role, (node, _) in seats.items():
        inventory = node.inventory if isinstance(node.inventory, dict) else {}
        on_disk, codecs = inventory.get("shard_bytes"), inventory.get("shard_codecs")
        shard = f"{model.pk}/{shadow_shard if role == 'shadow' else role}"
        # A worker shard stored with another codec is replaced, not reused; an agent that does not
        # say (one older than the report) has its worker shards counted as not there.
        held = codecs.get(shard) if isinstance(codecs, dict) else None
        if role.startswith("worker-") and held != expert_codec:
            continue
        if isinstance(on_disk, dict) and isinstance(on_disk.get(shard), int):
            present[role] = on_disk[shard]
    placed = {role: Placed(node.name, node.inventory, gpu) for role, (node, gpu) in seats.items()}
    problems = check_plan_fit(plan, placed, present=present)
    if problems:
        raise DeploymentDoesNotFit(
            f"{model.name} does not fit on these nodes: " + "; ".join(p.message for p in problems)
        )
    return plan


@transaction.atomic
def create_deployment(
    *,
    name: str,
    model: ModelArtifact,
    node_ids: list[str],
    roles: RoleMap | None = None,
    created_by: AbstractBaseUser | None = None,
    **settings: Any,
) -> Deployment:
    """A draft deployment of ``model`` on ``node_ids``; roles suggested unless given.

    ``settings`` are its setting columns by name (``SETTINGS_COLUMNS``), the declaration's default
    for each one not given; a name that is not a column is a ``TypeError``.
    Only a model whose registration finished: not one still downloading, nor one that failed.
    Only a ``predictor`` the strategy takes ("" = its own); the role map has a shadow seat
    exactly when that predictor is the shadow.
    """
    # Checked against the model, their declarations and each other, then stored as they are.
    unknown = sorted(set(settings) - set(SETTINGS_COLUMNS))
    if unknown:
        raise TypeError(f"create_deployment() takes the settings of SETTINGS_COLUMNS, not {', '.join(unknown)}")
    settings = {column: settings.get(column, getattr(DEFAULTS, column)) for column in SETTINGS_COLUMNS}
    shadow = _check_settings(model, settings)
    nodes = list(Node.objects.select_for_update().filter(pk__in=node_ids))
    _check_nodes(nodes, node_ids)
    runtime = DeploymentSettings(**settings)
    roles = roles or suggest_for(model=model, node_ids=node_ids, settings=runtime)
    try:
        check_roles(roles, {str(n.pk): n.inventory for n in nodes}, shadow=shadow)
        by_id = {str(n.pk): n for n in nodes}
        seats = {role: parse_seat(text) for role, text in roles.seats().items()}
    except RoleError as exc:
        raise DeploymentError(str(exc)) from None
    check_fits(model=model, settings=runtime, seats={role: (by_id[node], gpu) for role, (node, gpu) in seats.items()})
    try:
        with transaction.atomic():
            deployment = Deployment.objects.create(name=name, model=model, **settings, created_by=created_by)
    except IntegrityError:
        raise DeploymentError(f"a deployment named {name!r} already exists") from None
    _add_members(deployment, seats)
    return deployment


def _check_settings(model: ModelArtifact, settings: dict[str, Any]) -> bool:
    """Refuse a model or settings (by column name) a deployment of it cannot have; whether it has a
    shadow seat."""
    strategy, predictor = settings["strategy"], settings["predictor"]
    try:
        check_registered(model)
        validate_periods(settings["token_period"], settings["kv_period"])
        for needed, command in needed_files(strategy, predictor):
            if not (Path(model.path) / needed).is_file():
                what = strategy if not predictor else f"{strategy} with the {predictor} predictor"
                raise ValueError(
                    f"{what} needs the model's {needed}: run `{command} {model.path}` on the control plane, then deploy"
                )
        shadow = needs_shadow(strategy, predictor)
        for name, value in settings.items():
            check_value(info(name), value)
        check_drafts(settings["draft_tokens"], strategy, predictor)
        check_max_per_user(settings["max_per_user"], settings["max_batch"], DEFAULTS.max_waiting)
    except (ModelError, SpecError, ValueError) as exc:
        raise DeploymentError(str(exc)) from None
    return shadow


def _add_members(deployment: Deployment, seats: dict[str, tuple[str, int | None]]) -> None:
    """Store ``deployment``'s members: each role (a worker with its index) on its seat's node and GPU."""
    members = []
    for role_name, (node, gpu) in seats.items():
        role, _, index = role_name.partition("-")
        worker_index = int(index) if index else None
        members.append(
            DeploymentNode(deployment=deployment, node_id=node, role=role, worker_index=worker_index, gpu=gpu)
        )
    DeploymentNode.objects.bulk_create(members)


def _nodes(node_ids: list[str]) -> list[Node]:
    nodes = list(Node.objects.filter(pk__in=node_ids))
    _check_nodes(nodes, node_ids)
    return nodes


def _check_nodes(nodes: list[Node], node_ids: list[str]) -> None:
    if len(set(node_ids)) != len(node_ids):
        raise DeploymentError("a node is listed twice")
    missing = set(node_ids) - {str(n.pk) for n in nodes}
    if missing:
        raise DeploymentError(f"unknown nodes: {', '.join(sorted(missing))}")
    draining = [n.name for n in nodes if n.status == NodeStatus.DRAINING]
    if draining:
        raise DeploymentError(f"draining nodes cannot join a deployment: {', '.join(draining)}")
    unfit = {n.name: doctor_problems(n.inventory) for n in nodes}
    unfit = {name: problems for name, problems in unfit.items() if problems}
    if unfit:  # a node that cannot serve is never given a role
        listed = "; ".join(f"{name}: {', '.join(problems)}" for name, problems in sorted(unfit.items()))
        raise DeploymentError(f"nodes whose doctor failed cannot take a role ({listed}); fix them or leave them out")
    check_nodes_free(nodes)


def check_nodes_free(nodes: list[Node], *, exclude: Deployment | None = None) -> None:
    """Refuse nodes that already serve another active deployment: one deployment per node."""
    others = DeploymentNode.objects.filter(node__in=nodes, deployment__status__in=ACTIVE)
    if exclude is not None:
        others = others.exclude(deployment=exclude)
    busy = others.select_related("node", "deployment").first()
    if busy is not None:
        raise DeploymentError(f"node {busy.node.name} is already in active deployment {busy.deployment.name}")


# Why an estimate takes no expert codec. The simulator of the hardware profiles (inference/sim) charges
# each expert load as the whole expert over the profile's host-to-GPU link. On a CUDA worker a coded
# expert is decoded on the host and then copied whole (docs/concepts/coded-experts.md), so the copy is
# the same, but its decode on the worker's CPU comes first, and no profile has a decode rate for its
# CPU: benchmarks.sim_prediction.measure_decode measures this machine's, which the emulation's local
# model (inference.sim.local) charges and a profile's testbed is not.
ESTIMATE_CODEC_REFUSAL = (
    'no estimate for expert_codec "{codec}": on a GPU worker each coded expert is decoded on its CPU before '
    "it is copied whole, and the simulator has no measured decode rate for any hardware profile's CPU, so it "
    'would predict the uncoded deployment; estimate with expert_codec "none" (a coded deployment\'s memory '
    "is checked when it is created and started)"
)


def estimate(
    *,
    workers: int,
    model: ModelArtifact | None = None,
    profile: str = DEFAULT_PROFILE,
    strategy: str = DEFAULTS.strategy,
    predictor: str = DEFAULTS.predictor,
    shadow_dtype: str = SIMULATED_SHADOW_DTYPE,  # not the deployments' fp32: the simulator has no fp32 shadow
    input_tokens: int = 128,
    output_tokens: int = 128,
    max_batch: int = DEFAULTS.max_batch,
    expert_codec: str = DEFAULTS.expert_codec,
    draft_tokens: int = DEFAULTS.draft_tokens,
    draft_policy: str = DEFAULTS.draft_policy,
    draft_agreement: float | None = None,
) -> dict:
    """The cluster simulator's prediction for a planned deployment (``inference.sim.estimate``).

    ``memory`` holds the memory per role (``inference.building.memory``), from the checkpoint's
    tensor sizes when ``model`` is given (Mixtral-8x7B in bf16 otherwise), with main's KV
    caches for ``max_batch`` sequences (the shadow's for as many): what creating and
    starting a deployment with that ``max_batch`` check. A ``predictor`` other than the
    shadow leaves the shadow out of ``memory`` (the deployment has no shadow seat);
    ``predictor`` in the answer is the resolved one (None: the strategy loads nothing ahead).
    The simulator itself models each strategy with its own predictor.

    ``expert_codec`` other than "none" is refused (``ESTIMATE_CODEC_REFUSAL`` says why), not
    estimated as if uncoded. ``draft_tokens`` above 0 needs ``draft_agreement``, the chance each draft
    equals main's token: the simulator takes it as given (``inference.sim.estimate``).
    """
    if expert_codec != "none":
        try:
            check_value(info("expert_codec"), expert_codec)  # an unknown one: the declaration's message
        except SpecError as exc:
            raise DeploymentError(str(exc)) from None
        raise DeploymentError(ESTIMATE_CODEC_REFUSAL.format(codec=expert_codec))
    try:
        resolved = predictor_for(strategy, predictor)
        check_drafts(draft_tokens, strategy, predictor)
    except (ValueError, SpecError) as exc:
        raise DeploymentError(str(exc)) from None
    sizes: str | dict = "mixtral-8x7b"
    checkpoint: Checkpoint | None = None
    if model is not None:
        try:
            checkpoint = Checkpoint(model.path)
            sizes = checkpoint.config
        except CheckpointError as exc:
            raise DeploymentError(f"cannot read {model.name}'s config: {exc}") from None
    top_k = int(sizes.get("num_experts_per_tok", 2)) if isinstance(sizes, dict) else 2
    try:
        # Keyword-argument call whose names line up with client.py's Generate(...), by shape only.
        result = sim.estimate(
            model=sizes,
            profile=profile,
            workers=workers,
            group_size=max(1, min(top_k, workers)),
            shadow_dtype=shadow_dtype,
            strategy=strategy,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            draft_tokens=draft_tokens,
            draft_policy=draft_policy,
            draft_agreement=draft_agreement,
        )
        runtime = DeploymentSettings(shadow_dtype=shadow_dtype, strategy=strategy, max_batch=max_batch)
        if checkpoint is not None:
            memory = memory_from_checkpoint(checkpoint, workers=workers, settings=runtime)
        else:
            memory = memory_from_config(sizes, workers=workers, dtype="bfloat16", settings=runtime)
    except (CheckpointError, ValueError) as exc:
        raise DeploymentError(f"no estimate: {exc}") from None
    shown = memory.to_dict()
    if resolved != "shadow":
        shown = without_shadow(memory).to_dict() | {"kv_cache": f"main's {kv_text(max_batch, memory.context_tokens)}"}
    return result | {"predictor": resolved, "memory": shown}
