"""REST endpoints of the artifacts app: staff register checkpoints and see their shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from django.http import StreamingHttpResponse
from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.permissions import KeyScopes
from controlplane.deployments.fields import setting_field
from controlplane.names import name_field
from controlplane.nodes.authentication import IsNode, NodeCredentialAuthentication
from controlplane.nodes.selectors import shard_sent_to_node
from controlplane.pagination import paginated
from inference.modelio.shards import MANIFEST_FILE, is_role_dirname

from . import services
from .models import ModelArtifact, ModelStatus
from .ranges import RangeNotSatisfiable, parse_range


class ModelOutput(serializers.ModelSerializer):
    class Meta:
        model = ModelArtifact
        fields = [
            "id",
            "name",
            "path",
            "status",
            "repo_id",
            "revision",
            "download_done_bytes",
            "download_total_bytes",
            "download_progress",
            "error",
            "summary",
            "total_bytes",
            "created_at",
            "shard_status",
            "shard_workers",
            "shard_expert_codec",
            "shard_shadow_dtypes",
            "shard_done_bytes",
            "shard_total_bytes",
            "shard_progress",
            "shard_error",
        ]


class ModelListApi(APIView):
    """GET/POST /api/models: list registered models; register a checkpoint directory on this
    server (201), or a Hugging Face repo id ``owner/name[@revision]`` that is downloaded first
    (202: the model is listed as *downloading*, then *ready* or *failed* with the reason)."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="ModelListInput")
    class InputSerializer(serializers.Serializer):
        name = name_field()
        path = serializers.CharField(
            max_length=1024, help_text="a checkpoint directory on this server, or a Hub repo id owner/name[@revision]"
        )

    @extend_schema(responses=ModelOutput(many=True))
    def get(self, request: Request) -> Response:
        return paginated(request, ModelArtifact.objects.all(), ModelOutput)

    @extend_schema(request=InputSerializer, responses={201: ModelOutput, 202: ModelOutput})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            artifact = services.add_model(**data.validated_data)
        except services.ModelError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        downloading = artifact.status == ModelStatus.DOWNLOADING
        return Response(
            ModelOutput(artifact).data, status=status.HTTP_202_ACCEPTED if downloading else status.HTTP_201_CREATED
        )


class ModelDetailApi(APIView):
    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(responses=ModelOutput)
    def get(self, request: Request, model_id: int) -> Response:
        artifact = _model(model_id)
        return Response(ModelOutput(artifact).data)


class ModelShardsApi(APIView):
    """POST /api/models/<id>/shards: build the role shards for N workers in the background, their experts
    stored as ``expert_codec`` says (a set per codec; one already built is reused)."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="ModelShardsInput")
    class InputSerializer(serializers.Serializer):
        workers = serializers.IntegerField(min_value=1, max_value=1024)
        expert_codec = setting_field("expert_codec")

    @extend_schema(request=InputSerializer, responses={202: ModelOutput})
    def post(self, request: Request, model_id: int) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        artifact = _model(model_id)
        try:
            artifact = services.request_shard_build(artifact=artifact, **data.validated_data)
        except services.ModelError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(ModelOutput(artifact).data, status=status.HTTP_202_ACCEPTED)


CHUNK = 1 << 20


class ShardFileApi(APIView):
    """GET /api/models/<id>/shards/<role>/<file>: a shard file for an enrolled agent.

    Only files the role's manifest lists (and the manifest itself) are served, so no path
    can reach outside the shard; single byte ranges are honoured so an interrupted download
    resumes where it stopped.
    """

    authentication_classes = [NodeCredentialAuthentication]
    permission_classes = [IsNode]

    @extend_schema(responses={(200, "application/octet-stream"): bytes, (206, "application/octet-stream"): bytes})
    def get(self, request: Request, model_id: int, role: str, name: str):
        artifact = ModelArtifact.objects.filter(pk=model_id).first()
        if artifact is None or not is_role_dirname(role):
            return Response({"detail": f"no ready shards for model {model_id} and role {role}"}, status=404)
        sent = shard_sent_to_node(node=request.auth, model_id=model_id, shard=role)
        if sent is None:
            # A node's credential fetches only what its node was told to run or fetch.
            return Response(
                {"detail": f"this node was not asked to fetch shard {role} of model {model_id}"}, status=403
            )
        # From the set its task named (its deployment's workers and expert codec), not whichever was built last.
        shard_dir = services.served_shard_dir(artifact, sent.get("shard_set"))
        if shard_dir is None:
            return Response({"detail": f"no ready shards for model {model_id} and role {role}"}, status=404)
        role_dir = shard_dir / role
        listed = _listed_files(role_dir)
        if name not in listed:
            return Response({"detail": f"{name} is not a file of shard {role}"}, status=404)
        path = role_dir / name
        size = path.stat().st_size
        try:
            wanted = parse_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable as exc:
            response = Response({"detail": str(exc)}, status=416)
            response["Content-Range"] = f"bytes */{size}"
            return response
        first, last = wanted if wanted is not None else (0, size - 1)
        kind = "application/json" if name == MANIFEST_FILE else "application/octet-stream"
        response = StreamingHttpResponse(_read(path, first, last), status=206 if wanted else 200, content_type=kind)
        response["Content-Length"] = str(max(0, last - first + 1))
        response["Accept-Ranges"] = "bytes"
        if wanted is not None:
            response["Content-Range"] = f"bytes {first}-{last}/{size}"
        return response


def _model(model_id: int) -> ModelArtifact:
    artifact = ModelArtifact.objects.filter(pk=model_id).first()
    if artifact is None:
        raise NotFound(f"no model {model_id}")
    return artifact


def _listed_files(role_dir: Path) -> set[str]:
    try:
        manifest = json.loads((role_dir / MANIFEST_FILE).read_text())
        return {MANIFEST_FILE, *(entry["path"] for entry in manifest["files"])}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _read(path: Path, first: int, last: int) -> Iterator[bytes]:
    with path.open("rb") as handle:
        handle.seek(first)
        remaining = last - first + 1
        while remaining > 0:
            chunk = handle.read(min(CHUNK, remaining))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk
