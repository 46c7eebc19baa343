"""REST endpoints for API keys: list, create (the clear key is in the answer, once) and revoke.

Everyone manages their own keys; staff see and revoke everyone's. Through an API key these
calls need the ``admin`` scope to write (``read`` to list), and a key never creates a key
with a scope it does not hold itself. A revoked key keeps its row, for the record. Each key
says what it spent (prompt and completion tokens, today in UTC and over the last 30 days) and
its daily token quota (``usage.py`` says what counts).
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.pagination import paginated

from . import selectors, services
from .models import ApiKey
from .permissions import KeyScopes
from .scopes import ALL_SCOPES, ScopeError
from .selectors import Spent

MAX_EXPIRY_DAYS = 3650


class KeyOutput(serializers.ModelSerializer):
    owner = serializers.CharField(source="user.username", read_only=True)
    state = serializers.CharField(read_only=True, help_text="active, expired or revoked")
    tokens_today = serializers.SerializerMethodField(help_text="prompt and completion tokens today (UTC)")
    tokens_last_30_days = serializers.SerializerMethodField(help_text="prompt and completion tokens, today included")

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "owner",
            "scopes",
            "state",
            "created_at",
            "expires_at",
            "last_used",
            "revoked_at",
            "daily_token_quota",
            "prefix_namespace",
            "tokens_today",
            "tokens_last_30_days",
        ]

    def _spent(self, key: ApiKey) -> Spent:
        """Read once for the whole page (a list's keys), then from the context."""
        spent = self.context.get("spent")
        if spent is None:
            page = self.parent.instance if isinstance(self.parent, serializers.ListSerializer) else [key]
            spent = self.context["spent"] = selectors.key_usage(keys=page)
        return spent.get(key.pk, Spent())

    def get_tokens_today(self, key: ApiKey) -> int:
        return self._spent(key).today

    def get_tokens_last_30_days(self, key: ApiKey) -> int:
        return self._spent(key).window


class CreatedKeyOutput(KeyOutput):
    key = serializers.CharField(read_only=True, help_text="the key itself: shown this once, never stored")

    class Meta(KeyOutput.Meta):
        fields = [*KeyOutput.Meta.fields, "key"]


class KeyListApi(APIView):
    """GET/POST /api/keys: your API keys (staff: everyone's); create one."""

    permission_classes = [IsAuthenticated, KeyScopes]

    @extend_schema_serializer(component_name="ApiKeyInput")
    class InputSerializer(serializers.Serializer):
        name = serializers.CharField(max_length=100, required=False, default="", allow_blank=True)
        scopes = serializers.ListField(
            child=serializers.ChoiceField(choices=ALL_SCOPES),
            required=False,
            min_length=1,
            max_length=len(ALL_SCOPES),
            help_text="default: every scope your user may hold",
        )
        expires_in_days = serializers.IntegerField(
            min_value=1, max_value=MAX_EXPIRY_DAYS, required=False, help_text="default: never expires"
        )
        daily_token_quota = serializers.IntegerField(
            min_value=1,
            max_value=services.MAX_DAILY_TOKEN_QUOTA,
            required=False,
            allow_null=True,
            help_text="prompt and completion tokens per UTC day; default (or null): unlimited",
        )

    @extend_schema(responses=KeyOutput(many=True))
    def get(self, request: Request) -> Response:
        return paginated(request, _visible(request), KeyOutput)

    @extend_schema(request=InputSerializer, responses={201: CreatedKeyOutput})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        days = values.get("expires_in_days")
        asking = request.auth if isinstance(request.auth, ApiKey) else None
        try:
            key, clear = services.create_api_key(
                user=request.user,
                name=values["name"],
                scopes=values.get("scopes"),
                expires_at=timezone.now() + timedelta(days=days) if days else None,
                within=tuple(asking.scopes) if asking is not None else None,
                daily_token_quota=values.get("daily_token_quota"),
            )
        except ScopeError as exc:
            return Response({"scopes": [str(exc)]}, status=status.HTTP_400_BAD_REQUEST)
        key.key = clear
        return Response(CreatedKeyOutput(key).data, status=status.HTTP_201_CREATED)


class KeyDetailApi(APIView):
    """GET/DELETE /api/keys/<id>: one key; DELETE revokes it (at once, for good)."""

    permission_classes = [IsAuthenticated, KeyScopes]

    @extend_schema(responses=KeyOutput)
    def get(self, request: Request, key_id: int) -> Response:
        return Response(KeyOutput(_key(request, key_id)).data)

    @extend_schema(responses=KeyOutput)
    def delete(self, request: Request, key_id: int) -> Response:
        return Response(KeyOutput(services.revoke_api_key(key=_key(request, key_id))).data)


def _visible(request: Request):
    keys = ApiKey.objects.select_related("user")
    return keys if request.user.is_staff else keys.filter(user=request.user)


def _key(request: Request, key_id: int) -> ApiKey:
    found = _visible(request).filter(pk=key_id).first()
    if found is None:
        raise NotFound(f"no API key {key_id}")
    return found
