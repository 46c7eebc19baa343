"""A deployment: one model served by a set of nodes in main / shadow / worker roles.

Its settings columns take their defaults and allowed values from the one declaration,
``inference.settings.DeploymentSettings``.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from controlplane.artifacts.models import ModelArtifact
from controlplane.nodes.models import Node
from inference.constants import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_MIGRATIONS_LIMIT
from inference.policies.strategies import predictor_for
from inference.settings import DEFAULTS, DeploymentSettings, SpecError, check_drafts, info


def choices(name: str) -> list[tuple[str, str]]:
    """A setting's allowed values (``inference.settings``) as a column's choices."""
    return [(c, c) for c in info(name).choices]


# The runtime settings a deployment keeps as its own columns (the rest are the declaration's defaults,
# but ``device``, which each role's node decides: ``lifecycle.role_device``).
SETTINGS_COLUMNS = (
    "shadow_dtype",
    "token_period",
    "kv_period",
    "strategy",
    "predictor",
    "max_batch",
    "max_per_user",
    "expert_codec",
    "draft_tokens",
    "draft_policy",
    "replay",
    "max_migrations",
    "max_replay_tokens",
)
# One user's bound leaves others a place in main: below max_batch + main's queue (``max_waiting``).
MAX_PER_USER = MAX_BATCH + DEFAULTS.max_waiting - 1


class DeploymentStatus(models.TextChoices):
    DRAFT = "draft", "draft (not started)"
    DEPLOYING = "deploying", "deploying"
    READY = "ready", "ready"
    DEGRADED = "degraded", "degraded"
    STOPPED = "stopped", "stopped"
    FAILED = "failed", "failed"


ACTIVE = (DeploymentStatus.DRAFT, DeploymentStatus.DEPLOYING, DeploymentStatus.READY, DeploymentStatus.DEGRADED)
RUNNING = (DeploymentStatus.DEPLOYING, DeploymentStatus.READY, DeploymentStatus.DEGRADED)


class MemberState(models.TextChoices):
    """How one node's role is doing, as its agent reports it (``inference.wire.link.ROLE_STATES``)."""

    PENDING = "pending", "pending"
    FETCHING = "fetching", "fetching its shard"
    STARTING = "starting", "starting"
    READY = "ready", "ready"
    FAILED = "failed", "failed"
    STOPPED = "stopped", "stopped"
    OFFLINE = "offline", "node offline"


class Role(models.TextChoices):
    MAIN = "main", "main"
    SHADOW = "shadow", "shadow"
    WORKER = "worker", "worker"


class Deployment(models.Model):
    name = models.CharField(max_length=100, unique=True)
    model = models.ForeignKey(ModelArtifact, on_delete=models.PROTECT, related_name="deployments")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.DRAFT)
    status_reason = models.TextField(blank=True)
    # The setting columns, declarations one per line: alike each other by shape, on purpose.
    shadow_dtype = models.CharField(max_length=8, choices=choices("shadow_dtype"), default=DEFAULTS.shadow_dtype)
    token_period = models.PositiveIntegerField(
        default=DEFAULTS.token_period, help_text="align the shadow's token every N steps (0 never)"
    )
    kv_period = models.PositiveIntegerField(
        default=DEFAULTS.kv_period, help_text="align the shadow's KV cache every N steps (0 never)"
    )
    strategy = models.CharField(
        max_length=16,
        choices=choices("strategy"),
        default=DEFAULTS.strategy,
        help_text="what workers keep on their GPUs (importance and prerouter are approximate); applied on the "
        "next start",
    )
    predictor = models.CharField(
        max_length=16,
        choices=[("", "the strategy's own"), *choices("predictor")],
        default=DEFAULTS.predictor,
        blank=True,
        help_text="who names the experts workers load ahead: the shadow, main's "
        "next-layer router (next-gate) or main's trained heads (prerouter; both without a shadow seat); "
        "blank: the strategy's own",
    )
    max_batch = models.PositiveSmallIntegerField(
        default=DEFAULTS.max_batch,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_BATCH)],
        help_text="sequences main runs at once (continuous batching); applied on the next start",
    )
    max_per_user = models.PositiveSmallIntegerField(
        default=DEFAULTS.max_per_user,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_PER_USER)],
        help_text="generations one user may have in main at once, running and waiting (more: 429 "
        "too_many_generations); below max_batch + the queue's 64, so others still get in",
    )
    expert_codec = models.CharField(
        max_length=16,
        choices=choices("expert_codec"),
        default=DEFAULTS.expert_codec,
        help_text="how its workers' shards store the experts: none, or "
        "exponent-plane (lossless, fewer bytes in a worker's RAM and disk); the shard build keeps a set per codec; "
        "applied on the next start",
    )
    draft_tokens = models.PositiveSmallIntegerField(
        default=DEFAULTS.draft_tokens,
        validators=[MaxValueValidator(MAX_DRAFT_TOKENS)],
        help_text="tokens the shadow drafts for each decode pass, which main verifies in one round of expert "
        "copies (0: off); needs the shadow predictor; applied on the next start",
    )
    draft_policy = models.CharField(
        max_length=8,
        choices=choices("draft_policy"),
        default=DEFAULTS.draft_policy,
        help_text="how many tokens a pass drafts: fixed (always draft_tokens) or auto (per pass, up to "
        "draft_tokens, from the agreement and costs main measures); applied on the next start",
    )
    replay = models.CharField(
        max_length=8,
        choices=choices("replay"),
        default=DEFAULTS.replay,
        help_text="how main's agent carries an answer across main's restart: prefill (the tokens already "
        "sent re-read as prompt) or exact (the request run again, each sent token checked: the undisturbed "
        "answer); applied on the next start",
    )
    max_migrations = models.PositiveSmallIntegerField(
        default=DEFAULTS.max_migrations,
        validators=[MaxValueValidator(MAX_MIGRATIONS_LIMIT)],
        help_text="main restarts one answer is carried across (0: none); applied on the next start",
    )
    max_replay_tokens = models.PositiveIntegerField(
        default=DEFAULTS.max_replay_tokens,
        help_text="the most tokens already sent that carrying an answer across main's restart re-reads; "
        "applied on the next start",
    )
    epoch = models.PositiveIntegerField(default=0, help_text="how many times it was started")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        try:
            predictor_for(self.strategy, self.predictor)
        except ValueError as exc:
            raise ValidationError({"predictor": str(exc)}) from None
        try:
            check_drafts(self.draft_tokens, self.strategy, self.predictor)
        except SpecError as exc:
            raise ValidationError({"draft_tokens": str(exc)}) from None
        if not 1 <= self.max_per_user < self.max_batch + DEFAULTS.max_waiting:
            raise ValidationError(
                {"max_per_user": f"must be from 1 to below max_batch + {DEFAULTS.max_waiting} (the queue)"}
            )

    @property
    def settings(self) -> DeploymentSettings:
        """Its runtime settings: its own columns (``SETTINGS_COLUMNS``), the declaration's defaults for
        the rest."""
        return DeploymentSettings(**{name: getattr(self, name) for name in SETTINGS_COLUMNS})

    @property
    def runtime_key(self) -> str:
        """The name its runtime processes know it by; new on every start, so stale roles never mix in."""
        return f"dep{self.pk}-{self.epoch}"


class DeploymentNode(models.Model):
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="members")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="memberships")
    role = models.CharField(max_length=8, choices=Role.choices)
    worker_index = models.PositiveIntegerField(null=True, blank=True)
    gpu = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="the CUDA index of the GPU the role runs on, on a node that runs one role per GPU; "
        "empty: the node's largest GPU (or its CPU) and no other role of this deployment on the node",
    )
    port = models.PositiveIntegerField(null=True, blank=True, help_text="the role's inbox port on the node")
    state = models.CharField(max_length=16, choices=MemberState.choices, default=MemberState.PENDING)
    detail = models.TextField(blank=True)
    metrics = models.JSONField(
        default=dict, blank=True, help_text="what the role last reported (main: its last generation)"
    )
    memory = models.JSONField(
        default=dict,
        blank=True,
        help_text="the role's memory when it last answered: host_bytes, peak_host_bytes, device_bytes",
    )
    start_sent_at = models.DateTimeField(null=True, blank=True)
    # The seat's data-plane keys (inference.runtime.curve), new on every start of the deployment: the
    # role's own CURVE pair and its client's (the agent on the node talks to the role with it).
    # They reach the node in its StartRole over the agent's link; no API or form shows them.
    role_public_key = models.CharField(max_length=40, blank=True, editable=False)
    role_secret_key = models.CharField(max_length=40, blank=True, editable=False)
    client_public_key = models.CharField(max_length=40, blank=True, editable=False)
    client_secret_key = models.CharField(max_length=40, blank=True, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["role", "worker_index"]
        constraints = [
            # A node runs one role of a deployment, or one per GPU where each names its GPU.
            models.UniqueConstraint(
                fields=["deployment", "node"], condition=models.Q(gpu__isnull=True), name="one_role_per_node"
            ),
            models.UniqueConstraint(fields=["deployment", "node", "gpu"], name="one_role_per_gpu"),
        ]

    def __str__(self) -> str:
        where = f"{self.node_id}" if self.gpu is None else f"{self.node_id} cuda:{self.gpu}"
        return f"{self.role_name} of {self.deployment_id} on {where}"

    @property
    def role_name(self) -> str:
        """main, shadow or worker-N: also the name of the role's shard."""
        return f"worker-{self.worker_index}" if self.role == Role.WORKER else self.role


class PauseCause(models.TextChoices):
    MAIN_RESTART = "main_restart", "main restarted"
    MAIN_LINK = "main_link", "main's agent link closed"
    WEB_RESTART = "web_restart", "the chat's web process stopped"


class AnswerPause(models.Model):
    """One pause an answer was carried across: its cause, where in the answer, how long the caller
    waited (``deployments.pauses`` writes them from a finished answer's metrics; the console shows
    the latest)."""

    deployment = models.ForeignKey(Deployment, null=True, on_delete=models.SET_NULL, related_name="pauses")
    deployment_name = models.CharField(max_length=100)
    request_id = models.CharField(max_length=64)
    cause = models.CharField(max_length=16, choices=PauseCause.choices)
    at_token = models.PositiveIntegerField(null=True, help_text="the tokens the answer had when it paused")
    paused_ms = models.FloatField(null=True, help_text="from the last token before the pause to the first after")
    detail = models.CharField(max_length=100, blank=True, help_text="how it went on")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.cause} of {self.request_id} at token {self.at_token}"
