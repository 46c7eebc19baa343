from django.urls import path

from . import jobs_api, metrics, openai_api, responses_api

urlpatterns = [
    path("metrics", metrics.metrics_view, name="metrics"),
    path("v1/models", openai_api.models, name="openai-models"),
    path("v1/models/<path:name>", openai_api.model, name="openai-model"),
    path("v1/chat/completions", openai_api.chat_completions, name="openai-chat-completions"),
    path("v1/completions", openai_api.completions, name="openai-completions"),
    path("v1/responses", responses_api.responses, name="openai-responses"),
    path("api/jobs", jobs_api.JobListApi.as_view(), name="jobs"),
    path("api/jobs/<uuid:job_id>", jobs_api.JobDetailApi.as_view(), name="job-detail"),
    path("api/jobs/<uuid:job_id>/outputs", jobs_api.JobOutputListApi.as_view(), name="job-outputs"),
    path("api/jobs/<uuid:job_id>/cancel", jobs_api.JobCancelApi.as_view(), name="job-cancel"),
]
