"""``/metrics`` in Prometheus' text format: what was served, how fast, and the cluster's state.

Per-request figures (requests, tokens, TTFT, decode time, routing recall, expert load waits)
are counted in the process that served the request: the web process for the OpenAI API and
the chat. Cluster state (nodes, deployments, jobs by status) and the tokens per user, API key
and deployment (``accounts.TokenUsage``, jobs' included) are read from the database at each
scrape, so they are the same whichever process answers.

The usage counters' labels are ``user`` (the username), ``key_id`` and ``key_prefix`` (the six
characters the keys page shows, never the secret; both empty for a browser session) and
``deployment``. Their cardinality is bounded twice: a (user, key, deployment) is exported only
while it spent tokens in the last 30 days (its series ends after that), and at most
``MAX_USAGE_SERIES`` of them, the ones that spent most; ``odmoe_usage_series_left_out`` says
how many more there were.

Scraping needs ``Authorization: Bearer`` the token ``ODMOE_METRICS_TOKEN`` (Prometheus' scrape
config: ``authorization: {credentials_file: ...}``), compared in constant time. Outside production
a staff user's API key with the ``metrics`` scope, or a staff session, also does; production takes
the token alone, and without one set serves ``/metrics`` to nobody (``settings.METRICS_TOKEN_ONLY``).
Every call is throttled first, as the REST API's calls are (an anonymous caller by its address, the
token's included), so neither guessing the token nor calling in a loop costs more than that rate.
"""

from __future__ import annotations

import hashlib
import hmac
import math

from django.conf import settings
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controlplane.accounts.scopes import Scope
from controlplane.accounts.selectors import usage_series
from controlplane.accounts.services import authenticate_api_key, bearer_key
from controlplane.throttles import throttle_wait

REGISTRY = CollectorRegistry()
REQUESTS = Counter("odmoe_requests", "Generations served, by API and outcome", ["api", "outcome"], registry=REGISTRY)
PROMPT_TOKENS = Counter("odmoe_prompt_tokens", "Prompt tokens of served generations", ["api"], registry=REGISTRY)
GENERATED_TOKENS = Counter("odmoe_generated_tokens", "Tokens generated", ["api"], registry=REGISTRY)
# Prometheus histograms, declarations one per line: alike by shape, each its own buckets.
TTFT = Histogram(
    "odmoe_time_to_first_token_seconds",
    "Time to the first token",
    ["api"],
    registry=REGISTRY,
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
DECODE = Histogram(
    "odmoe_decode_seconds",
    "Decode time of a generation, first token excluded",
    ["api"],
    registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
RECALL = Histogram(
    "odmoe_routing_recall_ratio",
    "Share of routed experts the shadow predicted, per generation",
    registry=REGISTRY,
    buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99, 0.999, 1.0),
)
LOAD_WAIT = Histogram(
    "odmoe_expert_load_wait_seconds",
    "Median wait for an expert's weights per decode layer, per generation",
    registry=REGISTRY,
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
# Drafts (``draft_tokens``): agreement is accepted / drafted, tokens per decode pass (generated - 1) / passes
# of the generations served with drafts, and the distinct experts a pass copied per layer a histogram.
DRAFTED = Counter("odmoe_drafted_tokens", "The shadow's drafts main verified", ["api"], registry=REGISTRY)
ACCEPTED = Counter("odmoe_accepted_drafts", "Drafts main kept, each equal to its own token", ["api"], registry=REGISTRY)
DRAFTED_PASSES = Counter(
    "odmoe_drafted_decode_passes", "Decode passes of generations served with drafts", ["api"], registry=REGISTRY
)
DRAFTED_TOKENS = Counter(
    "odmoe_drafted_decode_tokens", "Decode tokens of generations served with drafts", ["api"], registry=REGISTRY
)
DISTINCT_EXPERTS = Histogram(
    "odmoe_distinct_experts_per_layer_pass",
    "Mean distinct experts a decode pass used per layer, per generation served with drafts",
    registry=REGISTRY,
    buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64),
)

LINK_PAUSES = Counter(
    "odmoe_link_pauses",
    "Pauses of finished generations: main's agent link closed mid-generation, and its agent sent the rest on its next",
    ["api"],
    registry=REGISTRY,
)
RESENT_TOKENS = Counter(
    "odmoe_resent_tokens",
    "Tokens main's agent sent again after its link came back, dropped as had",
    ["api"],
    registry=REGISTRY,
)

MAIN_RESTARTS_CARRIED = Counter(
    "odmoe_main_restarts_carried",
    "Restarts of main that finished answers were carried across (main's agent continued them)",
    ["api"],
    registry=REGISTRY,
)
PAUSES = Histogram(
    "odmoe_answer_pause_seconds",
    "How long answers paused and went on whole, by cause: main_restart, main_link, web_restart",
    ["cause"],
    registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
)
CHAT_RESUMES = Counter(
    "odmoe_chat_resumes",
    "Chat pages that followed an answer again after their socket closed (a reconnection, a reload)",
    registry=REGISTRY,
)
CHAT_TAKEOVERS = Counter(
    "odmoe_chat_takeovers",
    "Chat answers whose writer stopped (its web process died) and that a page's web process wrote on",
    registry=REGISTRY,
)


def record(api: str, *, ok: bool, prompt_tokens: int = 0, metrics: dict | None = None) -> None:
    """Count one generation served through ``api`` (its runtime ``metrics`` when it finished)."""
    REQUESTS.labels(api, "ok" if ok else "error").inc()
    if not ok or metrics is None:
        return
    PROMPT_TOKENS.labels(api).inc(prompt_tokens)
    generated = metrics.get("generated_tokens") or 0
    GENERATED_TOKENS.labels(api).inc(generated)
    if metrics.get("ttft_ms") is not None:
        TTFT.labels(api).observe(metrics["ttft_ms"] / 1000)
    rate = metrics.get("decode_tok_s")
    if rate and generated > 1:
        DECODE.labels(api).observe((generated - 1) / rate)
    if metrics.get("recall") is not None:
        RECALL.observe(metrics["recall"])
    if metrics.get("decode_layer_load_wait_ms_median") is not None:
        LOAD_WAIT.observe(metrics["decode_layer_load_wait_ms_median"] / 1000)
    restarts = metrics.get("main_restarts")
    if isinstance(restarts, dict):
        MAIN_RESTARTS_CARRIED.labels(api).inc(restarts.get("count", 0))
    link = metrics.get("link")
    if isinstance(link, dict):
        LINK_PAUSES.labels(api).inc(link.get("pauses", 0))
        RESENT_TOKENS.labels(api).inc(link.get("resent_tokens", 0))
    drafts = metrics.get("drafts")
    if isinstance(drafts, dict):
        DRAFTED.labels(api).inc(drafts.get("drafted", 0))
        ACCEPTED.labels(api).inc(drafts.get("accepted", 0))
        DRAFTED_PASSES.labels(api).inc(drafts.get("decode_passes", 0))
        DRAFTED_TOKENS.labels(api).inc(max(generated - 1, 0))
        if drafts.get("decode_passes"):
            DISTINCT_EXPERTS.observe(drafts.get("distinct_experts", 0))


class ClusterCollector:
    """Gauges read from the database at scrape time."""

    def describe(self) -> list:
        return []  # not at registration: the database may not exist yet (e.g. before migrate)

    def collect(self):
        from controlplane.deployments.models import Deployment, DeploymentStatus
        from controlplane.nodes.models import Node, NodeStatus

        from .models import Job, JobStatus

        for name, doc, model, choices in (
            ("odmoe_nodes", "Enrolled nodes by status", Node, NodeStatus),
            ("odmoe_deployments", "Deployments by status", Deployment, DeploymentStatus),
            ("odmoe_jobs", "Jobs by status", Job, JobStatus),
        ):
            family = GaugeMetricFamily(name, doc, labels=["status"])
            counts = dict(model.objects.values_list("status").annotate(n=Count("pk")))
            for status in choices.values:
                family.add_metric([status], counts.get(status, 0))
            yield family


MAX_USAGE_SERIES = 1000  # (user, key, deployment) triples per scrape: three series each


class UsageCollector:
    """Counters of the tokens each (user, key, deployment) spent, read from the database at scrape time."""

    LABELS = ["user", "key_id", "key_prefix", "deployment"]

    def describe(self) -> list:
        return []  # as ClusterCollector: no database at registration

    def collect(self):
        series = usage_series()
        kept = sorted(series, key=lambda s: -(s.prompt_tokens + s.completion_tokens))[:MAX_USAGE_SERIES]
        families = {
            "prompt_tokens": CounterMetricFamily(
                "odmoe_usage_prompt_tokens", "Prompt tokens per user, API key and deployment", labels=self.LABELS
            ),
            "completion_tokens": CounterMetricFamily(
                "odmoe_usage_completion_tokens", "Generated tokens per user, API key and deployment", labels=self.LABELS
            ),
            "generations": CounterMetricFamily(
                "odmoe_usage_generations", "Generations per user, API key and deployment", labels=self.LABELS
            ),
        }
        for s in sorted(kept, key=lambda s: (s.username, s.key_id or 0, s.deployment)):
            labels = [s.username, "" if s.key_id is None else str(s.key_id), s.key_prefix, s.deployment]
            for field, family in families.items():
                family.add_metric(labels, getattr(s, field))
        yield from families.values()
        left_out = GaugeMetricFamily(
            "odmoe_usage_series_left_out",
            f"(user, key, deployment) with usage in the last 30 days past the {MAX_USAGE_SERIES} exported",
        )
        left_out.add_metric([], len(series) - len(kept))
        yield left_out


REGISTRY.register(ClusterCollector())
REGISTRY.register(UsageCollector())


def token_matches(presented: str, token: str) -> bool:
    """Whether ``presented`` is ``token``, in time that tells nothing of either (both digested first,
    so not even the length is compared)."""
    digest = [hashlib.sha256(text.encode(errors="surrogatepass")).digest() for text in (presented, token)]
    return bool(token) and hmac.compare_digest(*digest)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text for the metrics token, or outside production for a staff user: a key with the
    ``metrics`` scope (a key that can do nothing else is enough), or a staff browser session."""
    wait = throttle_wait(request, request.user)  # before any credential is looked at
    if wait is not None:
        response = HttpResponse("too many calls to /metrics: try again later\n", status=429, content_type="text/plain")
        response["Retry-After"] = str(max(1, math.ceil(wait)))
        return response
    presented = bearer_key(request.headers.get("Authorization", "")) or ""
    if token_matches(presented, settings.METRICS_TOKEN):
        return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
    if settings.METRICS_TOKEN_ONLY:
        if not settings.METRICS_TOKEN:
            why = "/metrics is served to nobody: set ODMOE_METRICS_TOKEN on the server and scrape with it\n"
            return HttpResponse(why, status=403, content_type="text/plain")
        return _unauthorized("the metrics token is needed (Authorization: Bearer ODMOE_METRICS_TOKEN)\n")
    if presented:
        found = authenticate_api_key(key=presented)
        allowed = found is not None and found.user.is_staff and found.allows(Scope.METRICS)
    else:
        allowed = request.user.is_authenticated and request.user.is_staff
    if not allowed:
        return _unauthorized("a staff user's API key with the 'metrics' scope is needed (Authorization: Bearer KEY)\n")
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _unauthorized(why: str) -> HttpResponse:
    response = HttpResponse(why, status=401, content_type="text/plain")
    response["WWW-Authenticate"] = "Bearer"
    return response
