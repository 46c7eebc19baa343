"""Jobs REST API: ``POST /api/jobs``, ``GET /api/jobs``, ``GET`` and ``DELETE /api/jobs/<id>``,
``GET /api/jobs/<id>/outputs``, ``POST /api/jobs/<id>/cancel``.

Any logged-in user or API key may submit jobs; each sees their own, staff see all. A job that
would take a user past ``MAX_ACTIVE_JOB_PROMPTS_PER_USER`` prompts queued or running is a 429;
one whose prompts would take what the user's jobs store past ``MAX_STORED_JOB_BYTES_PER_USER``
is a 413 until the user deletes ended jobs (``DELETE``: a 409 for a job still queued or running).
A job's detail counts its outputs by state; the outputs themselves (prompt, text, token ids, a
summary of the metrics) come a page at a time, as every list does (``controlplane.pagination``):
the detail's size never grows with the job.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.models import ApiKey
from controlplane.accounts.permissions import KeyScopes
from controlplane.accounts.scopes import Scope
from controlplane.accounts.services import QuotaExceeded
from controlplane.pagination import Pages, paginated

from . import jobs, selectors
from .bounds import JOB_PROMPTS, MAX_TOKENS, PROMPT_CHARS
from .completions import ClusterUnavailable, ModelNotFound
from .models import Job, JobOutput
from .text import MAX_SEED, InputError, Sampling


class JobOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobOutput
        fields = [
            "index",
            "prompt",
            "prompt_tokens",
            "status",
            "text",
            "token_ids",
            "finish_reason",
            "metrics",
            "error",
            "finished_at",
            "stored_bytes",
        ]


class OutputCountsSerializer(serializers.Serializer):
    """How many of a job's outputs are in each state (``selectors.visible_jobs`` counts them)."""

    queued = serializers.IntegerField(source="outputs_queued")
    running = serializers.IntegerField(source="outputs_running")
    done = serializers.IntegerField(source="outputs_done")
    failed = serializers.IntegerField(source="outputs_failed")
    cancelled = serializers.IntegerField(source="outputs_cancelled")


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    model = serializers.CharField(source="model_name")
    prompts = serializers.IntegerField(help_text="how many prompts (outputs) the job has")
    outputs_by_status = OutputCountsSerializer(source="*", read_only=True)
    stored_bytes = serializers.IntegerField(help_text="what its outputs store, counted to the owner's job storage")

    class Meta:
        model = Job
        fields = [
            "id",
            "owner",
            "model",
            "status",
            "max_tokens",
            "temperature",
            "top_p",
            "seed",
            "created_at",
            "started_at",
            "finished_at",
            "prompts",
            "outputs_by_status",
            "stored_bytes",
        ]


class JobListApi(APIView):
    permission_classes = [IsAuthenticated, KeyScopes]
    write_scope = Scope.INFERENCE
    pagination_class = Pages  # for the schema: ``paginated`` pages the answer

    @extend_schema_serializer(component_name="JobInput")
    class InputSerializer(serializers.Serializer):
        model = serializers.CharField(help_text="a ready deployment's name")
        # The sizes are the request bounds' (bounds.py), checked before any prompt is tokenized.
        prompts = serializers.ListField(
            child=serializers.CharField(trim_whitespace=False, max_length=PROMPT_CHARS.limit),
            required=False,
            min_length=1,
            max_length=JOB_PROMPTS.limit,
        )
        prompt = serializers.CharField(
            required=False,
            trim_whitespace=False,
            max_length=PROMPT_CHARS.limit,
            help_text="one prompt (or use prompts)",
        )
        max_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS.limit, default=64)
        temperature = serializers.FloatField(min_value=0.0, max_value=2.0, default=1.0, help_text="0 is greedy")
        top_p = serializers.FloatField(min_value=0.0, max_value=1.0, default=1.0)
        seed = serializers.IntegerField(min_value=0, max_value=MAX_SEED, required=False, allow_null=True, default=None)

        def validate(self, data: dict) -> dict:
            if ("prompts" in data) == ("prompt" in data):
                raise serializers.ValidationError("give either prompt or prompts")
            if data["top_p"] == 0:
                raise serializers.ValidationError({"top_p": "top_p must be above 0"})
            return data

    @extend_schema(responses=JobSerializer(many=True))
    def get(self, request: Request) -> Response:
        return paginated(request, selectors.visible_jobs(user=request.user), JobSerializer)

    @extend_schema(request=InputSerializer, responses={201: JobSerializer})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        prompts = values.get("prompts") or [values["prompt"]]
        try:
            job = jobs.submit_job(
                owner=request.user,
                model=values["model"],
                prompts=prompts,
                max_tokens=values["max_tokens"],
                sampling=Sampling(values["temperature"], values["top_p"], values["seed"]),
                api_key=request.auth if isinstance(request.auth, ApiKey) else None,
            )
        except InputError as exc:
            return Response({"detail": str(exc), "param": exc.param}, status=status.HTTP_400_BAD_REQUEST)
        except jobs.TooManyActivePrompts as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_429_TOO_MANY_REQUESTS)
        except jobs.JobStorageFull as exc:
            body = {
                "detail": str(exc),
                "code": "job_storage_full",
                "stored_bytes": exc.stored,
                "adding_bytes": exc.adding,
                "quota_bytes": exc.quota,
            }
            return Response(body, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        except QuotaExceeded as exc:
            headers = {"Retry-After": str(exc.retry_after_s)}
            body = {"detail": str(exc), "code": "quota_exceeded"}
            return Response(body, status=status.HTTP_429_TOO_MANY_REQUESTS, headers=headers)
        except ModelNotFound as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_404_NOT_FOUND)
        except ClusterUnavailable as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(JobSerializer(_job(request, job.pk)).data, status=status.HTTP_201_CREATED)


class JobDetailApi(APIView):
    permission_classes = [IsAuthenticated, KeyScopes]
    write_scope = Scope.INFERENCE

    @extend_schema(responses=JobSerializer)
    def get(self, request: Request, job_id) -> Response:
        return Response(JobSerializer(_job(request, job_id)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, job_id) -> Response:
        """Delete an ended job and its outputs (409 while it is queued or running: cancel it first)."""
        try:
            jobs.delete_job(job=_job(request, job_id))
        except jobs.JobNotEnded as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(status=status.HTTP_204_NO_CONTENT)


class JobOutputListApi(APIView):
    """GET /api/jobs/<id>/outputs: the job's outputs in prompt order, a page at a time."""

    permission_classes = [IsAuthenticated, KeyScopes]
    write_scope = Scope.INFERENCE
    pagination_class = Pages  # for the schema: ``paginated`` pages the answer

    @extend_schema(responses=JobOutputSerializer(many=True))
    def get(self, request: Request, job_id) -> Response:
        return paginated(request, selectors.job_outputs(job=_job(request, job_id)), JobOutputSerializer)


class JobCancelApi(APIView):
    permission_classes = [IsAuthenticated, KeyScopes]
    write_scope = Scope.INFERENCE

    @extend_schema(request=None, responses=JobSerializer)
    def post(self, request: Request, job_id) -> Response:
        jobs.cancel_job(job=_job(request, job_id))
        return Response(JobSerializer(_job(request, job_id)).data)


def _job(request: Request, job_id) -> Job:
    found = selectors.visible_jobs(user=request.user).filter(pk=job_id).first()
    if found is None:
        raise NotFound(f"no job {job_id}")
    return found
