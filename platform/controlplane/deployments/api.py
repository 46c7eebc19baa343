"""REST endpoints of the deployments app (staff only)."""

from __future__ import annotations

import uuid

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.models import ApiKey
from controlplane.accounts.permissions import KeyScopes
from controlplane.accounts.scopes import Scope
from controlplane.accounts.selectors import caller_of
from controlplane.accounts.services import QuotaExceeded, check_quota
from controlplane.artifacts.models import ModelArtifact, ModelStatus
from controlplane.artifacts.services import ModelError, check_registered
from controlplane.names import name_field
from controlplane.pagination import paginated
from inference.policies.strategies import STRATEGIES, get_strategy
from inference.settings import DeploymentSettings
from inference.sim import hardware as sim_profiles
from inference.sim.strategies.base import SIMULATED_SHADOW_DTYPE

from . import generation, lifecycle, services
from .fields import ColumnSettingsInput, setting_field
from .models import SETTINGS_COLUMNS, Deployment, DeploymentNode
from .roles import RoleMap

RETRY_AFTER_S = 5  # what a 503 asks a client to wait: a restarting role is back in seconds
MAX_INT64 = 2**63 - 1  # token ids and seeds reach main as 64-bit integers: a larger one cannot be sent at all


class RoleMemoryOutput(serializers.Serializer):
    """A running role's memory in bytes when it last answered; empty before its first answer."""

    host_bytes = serializers.IntegerField(required=False, help_text="resident host memory now (VmRSS)")
    peak_host_bytes = serializers.IntegerField(required=False, help_text="resident host memory at its peak (VmHWM)")
    device_bytes = serializers.IntegerField(required=False, help_text="GPU memory it holds (0 on a CPU)")


class MemberOutput(serializers.ModelSerializer):
    node_name = serializers.CharField(source="node.name")
    node_status = serializers.CharField(source="node.status")
    memory = RoleMemoryOutput(read_only=True)

    class Meta:
        model = DeploymentNode
        fields = [
            "node",
            "node_name",
            "node_status",
            "role",
            "worker_index",
            "gpu",
            "port",
            "state",
            "detail",
            "metrics",
            "memory",
        ]


class DeploymentOutput(serializers.ModelSerializer):
    members = MemberOutput(many=True)
    approximate = serializers.SerializerMethodField(
        help_text="its strategy computes other experts than the model's router picks (importance, prerouter)"
    )

    def get_approximate(self, deployment: Deployment) -> bool:
        return not get_strategy(deployment.strategy).exact

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "model",
            "status",
            "status_reason",
            *SETTINGS_COLUMNS,
            "approximate",
            "created_at",
            "updated_at",
            "members",
        ]


class ReadyModelField(serializers.PrimaryKeyRelatedField):
    """A registered model that can be deployed: not one still downloading, nor one that failed (400 with why)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(queryset=ModelArtifact.objects.filter(status=ModelStatus.READY), **kwargs)

    def to_internal_value(self, data):
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError:
            text = str(data)  # only ASCII digits: "²" is a digit to isdigit() and not to int()
            is_id = type(data) is int or (text.isascii() and text.isdigit() and len(text) <= 18)
            known = ModelArtifact.objects.filter(pk=data).first() if is_id else None
            if known is not None:
                try:
                    check_registered(known)
                except ModelError as exc:
                    raise serializers.ValidationError(str(exc)) from None
            raise


class SeatField(serializers.CharField):
    """Where a role runs: a node id, or ``<node id>:<GPU index>`` on a node that runs a role per GPU."""

    def __init__(self, **kwargs) -> None:
        super().__init__(max_length=48, **kwargs)

    def to_internal_value(self, data) -> str:
        text = super().to_internal_value(data)
        node, sep, index = text.partition(":")
        try:
            node = str(uuid.UUID(node))
        except ValueError:
            raise serializers.ValidationError("not a node id (a UUID), nor <node id>:<GPU index>") from None
        if sep and not (index.isascii() and index.isdigit() and len(index) <= 3):
            raise serializers.ValidationError("the GPU index after ':' must be a number, as in <node id>:1")
        return f"{node}:{int(index)}" if sep else node


class RolesInput(serializers.Serializer):
    main = SeatField()
    shadow = SeatField(
        required=False,
        allow_null=True,
        help_text="only where the predictor is the shadow; null or left out for a deployment without a shadow seat",
    )
    workers = serializers.ListField(child=SeatField(), min_length=1)


def role_map(roles: dict) -> RoleMap:
    return RoleMap(roles["main"], roles.get("shadow"), tuple(roles["workers"]))


class SuggestApi(APIView):
    """POST /api/deployments/suggest {model, nodes[, shadow_dtype, strategy, predictor, max_batch, expert_codec]}:
    a role map.

    Only a map where every node holds its role's memory (main's KV caches for ``max_batch``
    sequences); otherwise 400 with each shortfall. ``shadow`` is null when the predictor is
    not the shadow: main and workers only.
    """

    permission_classes = [IsAdminUser, KeyScopes]
    write_scope = Scope.READ  # computes an answer, changes nothing

    @extend_schema_serializer(component_name="SuggestInput")
    class InputSerializer(serializers.Serializer):
        model = ReadyModelField()
        nodes = serializers.ListField(child=serializers.UUIDField(), min_length=1)
        shadow_dtype = setting_field("shadow_dtype")
        strategy = setting_field("strategy")
        predictor = setting_field("predictor")
        max_batch = setting_field("max_batch")
        expert_codec = setting_field("expert_codec")

    @extend_schema(request=InputSerializer, responses=RolesInput)
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        try:
            settings = DeploymentSettings(
                **{
                    name: values[name]
                    for name in ("shadow_dtype", "strategy", "predictor", "max_batch", "expert_codec")
                }
            )
            roles = services.suggest_for(
                model=values["model"], node_ids=[str(n) for n in values["nodes"]], settings=settings
            )
        except services.DeploymentError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(roles.as_dict())


class DeploymentListApi(APIView):
    """GET/POST /api/deployments: list deployments, create one (roles suggested unless given)."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="DeploymentListInput")
    class InputSerializer(ColumnSettingsInput):
        name = name_field()
        model = ReadyModelField()
        nodes = serializers.ListField(child=serializers.UUIDField(), min_length=1)
        roles = RolesInput(required=False)

    @extend_schema(responses=DeploymentOutput(many=True))
    def get(self, request: Request) -> Response:
        deployments = Deployment.objects.prefetch_related("members__node")
        return paginated(request, deployments, DeploymentOutput)

    @extend_schema(request=InputSerializer, responses={201: DeploymentOutput})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        roles = values.pop("roles", None)
        try:
            deployment = services.create_deployment(
                node_ids=[str(n) for n in values.pop("nodes")],
                roles=role_map(roles) if roles is not None else None,
                created_by=request.user,
                **values,
            )
        except services.DeploymentError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(DeploymentOutput(deployment).data, status=status.HTTP_201_CREATED)


# A DRF handler alike artifacts/api.py's ModelDetailApi by shape, in the control plane's style.
class DeploymentDetailApi(APIView):
    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(responses=DeploymentOutput)
    def get(self, request: Request, deployment_id: int) -> Response:
        deployment = _deployment(deployment_id)
        return Response(DeploymentOutput(deployment).data)


class DeploymentSettingsApi(APIView):
    """PATCH /api/deployments/<id>/settings {token_period, kv_period}: change alignment."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="DeploymentSettingsInput")
    class InputSerializer(serializers.Serializer):
        token_period = setting_field("token_period", required=True)
        kv_period = setting_field("kv_period", required=True)

    @extend_schema(request=InputSerializer, responses=DeploymentOutput)
    def patch(self, request: Request, deployment_id: int) -> Response:
        deployment = _deployment(deployment_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            deployment = lifecycle.change_alignment(deployment=deployment, **data.validated_data)
        except services.DeploymentError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(DeploymentOutput(deployment).data)


class DeploymentStartApi(APIView):
    """POST /api/deployments/<id>/start: deploy (or redeploy) it; progress shows in its members."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(request=None, responses={202: DeploymentOutput})
    def post(self, request: Request, deployment_id: int) -> Response:
        deployment = _deployment(deployment_id)
        try:
            lifecycle.start_deployment(deployment=deployment)
        except services.DeploymentDoesNotFit as exc:  # the request itself can't succeed on these nodes
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except services.DeploymentError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(DeploymentOutput(_deployment(deployment_id)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentStopApi(APIView):
    """POST /api/deployments/<id>/stop: stop every role; its nodes are free again."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(request=None, responses=DeploymentOutput)
    def post(self, request: Request, deployment_id: int) -> Response:
        lifecycle.stop_deployment(deployment=_deployment(deployment_id))
        return Response(DeploymentOutput(_deployment(deployment_id)).data)


class DeploymentGenerateApi(APIView):
    """POST /api/deployments/<id>/generate: token ids in, token ids and metrics out (an operator's check).

    Greedy unless ``do_sample``. Chat, jobs and the OpenAI-compatible API build on the
    same service with text in and out.
    """

    permission_classes = [IsAdminUser, KeyScopes]
    write_scope = Scope.INFERENCE

    @extend_schema_serializer(component_name="DeploymentGenerateInput")
    class InputSerializer(serializers.Serializer):
        prompt_ids = serializers.ListField(
            child=serializers.IntegerField(min_value=0, max_value=MAX_INT64), min_length=1, max_length=8192
        )
        max_new_tokens = serializers.IntegerField(min_value=1, max_value=4096, default=16)
        do_sample = serializers.BooleanField(default=False)
        temperature = serializers.FloatField(min_value=0.0, max_value=10.0, default=1.0)
        top_p = serializers.FloatField(min_value=0.0, max_value=1.0, default=1.0)
        seed = serializers.IntegerField(min_value=0, max_value=MAX_INT64, required=False, allow_null=True, default=None)

    @extend_schema_serializer(component_name="DeploymentGenerateOutput")
    class OutputSerializer(serializers.Serializer):
        request_id = serializers.CharField()
        token_ids = serializers.ListField(child=serializers.IntegerField())
        finish_reason = serializers.CharField()
        metrics = serializers.DictField()

    @extend_schema(request=InputSerializer, responses=OutputSerializer)
    def post(self, request: Request, deployment_id: int) -> Response:
        _deployment(deployment_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = request.auth if isinstance(request.auth, ApiKey) else None
        who = caller_of(request.user.pk, key)
        # Main bounds each user's generations, and keys its prefix cache by the user (or the key's grant).
        request_fields = {**data.validated_data, "user": str(who.user_id), "prefix_namespace": who.prefix_namespace}
        try:
            check_quota(key=key)
        except QuotaExceeded as exc:
            headers = {"Retry-After": str(exc.retry_after_s)}
            return Response({"detail": str(exc)}, status=status.HTTP_429_TOO_MANY_REQUESTS, headers=headers)
        try:
            done = generation.generate(deployment_id, generation.new_request(**request_fields), caller=who)
        except generation.ClusterUnavailable as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        except generation.TooManyGenerations as exc:
            headers = {"Retry-After": "1"}
            return Response({"detail": str(exc)}, status=status.HTTP_429_TOO_MANY_REQUESTS, headers=headers)
        except generation.RequestTooLarge as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except generation.ClusterGenerationError as exc:
            if exc.retryable:  # main is being restarted: the same request can succeed shortly
                headers = {"Retry-After": str(RETRY_AFTER_S)}
                return Response({"detail": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE, headers=headers)
            return Response({"detail": str(exc)}, status=status.HTTP_502_BAD_GATEWAY)
        return Response(self.OutputSerializer(done).data)


def _deployment(deployment_id: int) -> Deployment:
    deployment = Deployment.objects.prefetch_related("members__node").filter(pk=deployment_id).first()
    if deployment is None:
        raise NotFound(f"no deployment {deployment_id}")
    return deployment


class EstimateApi(APIView):
    """POST /api/deployments/estimate: the simulator's prediction for a planned deployment.

    Before anything is deployed: decode tok/s, TTFT and memory per node of ``model`` (a
    registered model, by its config.json; Mixtral-8x7B when omitted) with ``workers``
    workers on a hardware ``profile``, at the roofline (``ideal``) and with measured or
    published implementation efficiencies (``adjusted``); see inference/sim. ``memory``
    is the host RAM, GPU memory and disk per role from the tensor sizes (inference/building/memory.py),
    with main's KV caches for ``max_batch`` sequences, what creating and starting a deployment
    check each node against; without the shadow when ``predictor`` is not the shadow.
    ``expert_codec`` other than "none" is a 400 with the reason: the simulator has no decode
    rate for a profile's CPU, so it cannot estimate coded experts. ``draft_tokens`` above 0 needs
    ``draft_agreement`` (the chance each draft equals main's token, which only a measurement of the
    shadow on the model gives: ``benchmarks.draft_agreement``); each kind's ``drafts`` then holds the
    simulated passes' tally.
    """

    permission_classes = [IsAdminUser, KeyScopes]
    write_scope = Scope.READ  # computes an answer, changes nothing

    @extend_schema_serializer(component_name="EstimateInput")
    class InputSerializer(serializers.Serializer):
        model = serializers.PrimaryKeyRelatedField(queryset=ModelArtifact.objects.all(), required=False)
        profile = serializers.ChoiceField(choices=sorted(sim_profiles.PROFILES), default=sim_profiles.DEFAULT_PROFILE)
        workers = serializers.IntegerField(min_value=1, max_value=1024)
        strategy = setting_field("strategy")
        predictor = setting_field("predictor")
        # The simulator's shadow unless told (int8): it has no model of a deployment's default fp32 shadow.
        shadow_dtype = setting_field("shadow_dtype", default=SIMULATED_SHADOW_DTYPE)
        input_tokens = serializers.IntegerField(min_value=1, max_value=32768, default=128)
        output_tokens = serializers.IntegerField(min_value=2, max_value=32768, default=128)
        max_batch = setting_field("max_batch")
        # Taken so that a coded plan is refused with the reason (services.ESTIMATE_CODEC_REFUSAL), not
        # estimated as if it were uncoded: only "none" is estimated.
        expert_codec = setting_field("expert_codec")
        draft_tokens = setting_field("draft_tokens")
        draft_policy = setting_field("draft_policy")
        draft_agreement = serializers.FloatField(
            min_value=0.0,
            max_value=1.0,
            required=False,
            help_text="with draft_tokens: the chance each draft equals main's token, given those before it "
            "did (measure it: python -m benchmarks.draft_agreement)",
        )

        def validate_strategy(self, value: str) -> str:
            if value not in STRATEGIES:
                raise serializers.ValidationError(
                    f"the simulator models the exact strategies ({', '.join(STRATEGIES)}), not {value}; "
                    "benchmarks.quality measures it"
                )
            return value

    @extend_schema(request=InputSerializer, responses=dict)
    def get(self, request: Request) -> Response:
        """The hardware profiles an estimate can use."""
        return Response({"profiles": sim_profiles.list_profiles(), "default": sim_profiles.DEFAULT_PROFILE})

    @extend_schema(request=InputSerializer, responses=dict)
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        try:
            return Response(services.estimate(**values))
        except services.DeploymentError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
