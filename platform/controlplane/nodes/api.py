"""REST endpoints of the nodes app: enrollment for agents, join tokens and nodes for staff."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.permissions import AllowAny, IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.permissions import KeyScopes
from controlplane.names import name_field
from controlplane.pagination import paginated

from . import selectors, services
from .authentication import IsNode, NodeCredentialAuthentication
from .models import JoinToken, Node, NodeTask
from .tls import enroll_commands


class NodeListOutput(serializers.ListSerializer):
    """Nodes, with when each was last heard read for all of them at once."""

    def to_representation(self, data):
        nodes = list(data.all() if hasattr(data, "all") else data)
        self.child.context["last_heard"] = selectors.last_heard(nodes)
        return super().to_representation(nodes)


class NodeOutput(serializers.ModelSerializer):
    rotation_pending = serializers.BooleanField(read_only=True, help_text="a new credential sent, not yet confirmed")

    def to_representation(self, instance: Node) -> dict:
        """``last_seen``: when its agent was last heard (``selectors.last_heard``), not only its row's."""
        data = super().to_representation(instance)
        heard = self.context.get("last_heard")
        if heard is None:
            heard = selectors.last_heard([instance])
        moment = heard.get(str(instance.pk))
        data["last_seen"] = serializers.DateTimeField().to_representation(moment) if moment else None
        return data

    class Meta:
        list_serializer_class = NodeListOutput
        model = Node
        fields = [
            "id",
            "name",
            "status",
            "address",
            "inventory",
            "enrolled_at",
            "last_seen",
            "credential_rotated_at",
            "rotation_pending",
        ]


class EnrollOutput(serializers.Serializer):
    node_id = serializers.UUIDField()
    node_secret = serializers.CharField(help_text="the node credential: shown once, stored only hashed")
    name = serializers.CharField()


class EnrollApi(APIView):
    """POST /api/agents/enroll: a box spends a join token and gets its node credential."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema_serializer(component_name="EnrollInput")
    class InputSerializer(serializers.Serializer):
        token = serializers.CharField(max_length=200)
        name = name_field()
        inventory = serializers.DictField(required=False, default=dict)
        address = serializers.CharField(max_length=255, required=False, allow_blank=True, default="")

    @extend_schema(request=InputSerializer, responses={201: EnrollOutput})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            node, secret = services.enroll_node(**data.validated_data)
        except services.EnrollmentError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(
            {"node_id": str(node.id), "node_secret": secret, "name": node.name}, status=status.HTTP_201_CREATED
        )


class AgentMeApi(APIView):
    """GET /api/agents/me: the node an agent's credential belongs to."""

    authentication_classes = [NodeCredentialAuthentication]
    permission_classes = [IsNode]

    @extend_schema(responses=NodeOutput)
    def get(self, request: Request) -> Response:
        services.touch_node(node=request.auth)
        return Response(NodeOutput(request.auth).data)


class JoinTokenApi(APIView):
    """GET/POST /api/join-tokens: staff list tokens (never their values) and create new ones."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="JoinTokenInput")
    class InputSerializer(serializers.Serializer):
        name = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")
        ttl_s = serializers.IntegerField(min_value=60, max_value=services.MAX_TOKEN_TTL_S, required=False)
        max_uses = serializers.IntegerField(min_value=1, max_value=1000, required=False, default=1)

    @extend_schema_serializer(component_name="JoinTokenOutput")
    class OutputSerializer(serializers.ModelSerializer):
        created_by = serializers.CharField(source="created_by.username", default=None)

        class Meta:
            model = JoinToken
            fields = ["id", "name", "prefix", "created_by", "created_at", "expires_at", "max_uses", "uses", "revoked"]

    @extend_schema(responses=OutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        return paginated(request, selectors.join_token_list(), self.OutputSerializer)

    @extend_schema(request=InputSerializer, responses={201: OutputSerializer})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        token, clear = services.create_join_token(created_by=request.user, **data.validated_data)
        body = dict(self.OutputSerializer(token).data)
        body["token"] = clear  # shown once: only its digest is stored
        # The commands name the URL this request came to (https behind the TLS proxy), with its pin.
        body |= enroll_commands(request.build_absolute_uri("/"), clear)
        return Response(body, status=status.HTTP_201_CREATED)


class NodeListApi(APIView):
    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(responses=NodeOutput(many=True))
    def get(self, request: Request) -> Response:
        return paginated(request, selectors.node_list(), NodeOutput)


class NodeDetailApi(APIView):
    """GET/PATCH/DELETE /api/nodes/<id>: see, rename or remove a node."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="NodeDetailInput")
    class InputSerializer(serializers.Serializer):
        name = name_field()

    @extend_schema(responses=NodeOutput)
    def get(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        return Response(NodeOutput(node).data)

    # A DRF handler that validates, calls a service and maps its error, as deployments/api.py's;
    # each maps its own service and error to its own status.
    @extend_schema(request=InputSerializer, responses=NodeOutput)
    def patch(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            node = services.rename_node(node=node, **data.validated_data)
        except services.NodeError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(NodeOutput(node).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        services.remove_node(node=node)
        return Response(status=status.HTTP_204_NO_CONTENT)


class NodeDrainApi(APIView):
    """POST /api/nodes/<id>/drain {"drain": true|false}: take a node out of service, or back."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="NodeDrainInput")
    class InputSerializer(serializers.Serializer):
        drain = serializers.BooleanField(default=True)

    @extend_schema(request=InputSerializer, responses=NodeOutput)
    def post(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        drain = data.validated_data["drain"]
        node = services.drain_node(node=node) if drain else services.undrain_node(node=node)
        return Response(NodeOutput(node).data)


class NodeRotateCredentialApi(APIView):
    """POST /api/nodes/<id>/rotate-credential: the node's agent gets a new credential over its link;
    the old one stops working once the agent has stored the new one (a second or so)."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(request=None, responses={202: NodeOutput})
    def post(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        try:
            services.rotate_credential(node=node)
        except services.NodeError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(NodeOutput(node).data, status=status.HTTP_202_ACCEPTED)


def _node(node_id: str) -> Node:
    node = selectors.node_list().filter(pk=node_id).first()
    if node is None:
        raise NotFound(f"no node {node_id}")
    return node


class TaskOutput(serializers.ModelSerializer):
    class Meta:
        model = NodeTask
        fields = ["id", "kind", "params", "state", "done", "total", "detail", "created_at", "updated_at"]


class NodeFetchApi(APIView):
    """POST /api/nodes/<id>/fetch {model, role}: the node's agent downloads a role shard."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema_serializer(component_name="NodeFetchInput")
    class InputSerializer(serializers.Serializer):
        model = serializers.IntegerField(min_value=1)
        role = serializers.RegexField(r"^(main|shadow|worker-\d{1,4})$")

    @extend_schema(request=InputSerializer, responses={202: TaskOutput})
    def post(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            task = services.request_fetch(
                node=node, model_id=data.validated_data["model"], role=data.validated_data["role"]
            )
        except services.NodeError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(TaskOutput(task).data, status=status.HTTP_202_ACCEPTED)


class NodeTasksApi(APIView):
    """GET /api/nodes/<id>/tasks: what the node's agent was asked to do, and how it went."""

    permission_classes = [IsAdminUser, KeyScopes]

    @extend_schema(responses=TaskOutput(many=True))
    def get(self, request: Request, node_id: str) -> Response:
        node = _node(node_id)
        return paginated(request, node.tasks.all(), TaskOutput)
