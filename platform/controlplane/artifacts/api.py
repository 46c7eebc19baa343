"""REST endpoints of the artifacts app: staff register checkpoints and see their shards."""

from __future__ import annotations

from rest_framework import serializers, status
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.names import name_field

from . import services
from .models import ModelArtifact


class ModelOutput(serializers.ModelSerializer):
    class Meta:
        model = ModelArtifact
        fields = [
            "id",
            "name",
            "path",
            "summary",
            "total_bytes",
            "created_at",
            "shard_status",
            "shard_workers",
            "shard_done_bytes",
            "shard_total_bytes",
            "shard_progress",
            "shard_error",
        ]


class ModelListApi(APIView):
    """GET/POST /api/models: list registered models, register a checkpoint directory."""

    permission_classes = [IsAdminUser]

    class InputSerializer(serializers.Serializer):
        name = name_field()
        path = serializers.CharField(max_length=1024)

    def get(self, request: Request) -> Response:
        return Response(ModelOutput(ModelArtifact.objects.all(), many=True).data)

    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            artifact = services.register_model(**data.validated_data)
        except services.ModelError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(ModelOutput(artifact).data, status=status.HTTP_201_CREATED)


class ModelDetailApi(APIView):
    permission_classes = [IsAdminUser]

    def get(self, request: Request, model_id: int) -> Response:
        artifact = ModelArtifact.objects.filter(pk=model_id).first()
        if artifact is None:
            return Response({"detail": f"no model {model_id}"}, status=status.HTTP_404_NOT_FOUND)
        return Response(ModelOutput(artifact).data)


class ModelShardsApi(APIView):
    """POST /api/models/<id>/shards: build the role shards for N workers in the background."""

    permission_classes = [IsAdminUser]

    class InputSerializer(serializers.Serializer):
        workers = serializers.IntegerField(min_value=1, max_value=1024)

    def post(self, request: Request, model_id: int) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        artifact = ModelArtifact.objects.filter(pk=model_id).first()
        if artifact is None:
            return Response({"detail": f"no model {model_id}"}, status=status.HTTP_404_NOT_FOUND)
        try:
            artifact = services.request_shard_build(artifact=artifact, **data.validated_data)
        except services.ModelError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(ModelOutput(artifact).data, status=status.HTTP_202_ACCEPTED)
