"""The admin console page (staff only) and its state as JSON."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import ensure_csrf_cookie

from controlplane.accounts.selectors import usage_by_user_and_deployment
from controlplane.accounts.usage import USAGE_WINDOW_DAYS
from controlplane.deployments.fields import MAX_PER_USER
from controlplane.nodes.tls import upgrade_command
from inference.constants import DRAFT_POLICIES, MAX_BATCH, MAX_DRAFT_TOKENS, REPLAY_MODES, SHADOW_DTYPES
from inference.policies.strategies import PREDICTORS, RUNTIME_STRATEGIES, get_strategy
from inference.settings import DEFAULTS, info

from .snapshot import snapshot


@staff_member_required
@ensure_csrf_cookie  # the page's script sends the cookie's token with its API calls
def console(request: HttpRequest) -> HttpResponse:
    """The console page; its deployment form's limits are the API's (``max_batch`` from 1 to ``MAX_BATCH``,
    ``max_per_user`` below ``max_batch`` + main's queue).

    ``own_predictors`` (strategy -> its own predictor, or None) tells the form's script whether
    a deployment has a shadow seat, so its estimate counts the workers the role map will have.
    ``usage``: the tokens each user spent on each deployment, as the page was loaded.
    ``expert_codec``: the setting's declared choices and default (``inference.settings``, what
    ``setting_field`` gives the API), for the deployment form's select and each model's
    *Build shards* select, which the script builds.
    """
    codec = info("expert_codec")
    context = {
        "shadow_dtypes": SHADOW_DTYPES,
        "expert_codecs": codec.choices,
        "expert_codec": {"choices": list(codec.choices), "default": codec.default},
        # (name, label): an approximate strategy is marked so where it is chosen.
        "strategies": [(s, s if get_strategy(s).exact else f"{s} (approximate)") for s in RUNTIME_STRATEGIES],
        "predictors": PREDICTORS,
        "own_predictors": {s: get_strategy(s).predictor for s in RUNTIME_STRATEGIES},
        "defaults": DEFAULTS,  # the form's initial values are a deployment's declared defaults
        "default_max_batch": DEFAULTS.max_batch,
        "max_batch_limit": MAX_BATCH,
        "max_draft_tokens": MAX_DRAFT_TOKENS,
        "draft_policies": DRAFT_POLICIES,
        "replay_modes": REPLAY_MODES,
        "default_max_per_user": DEFAULTS.max_per_user,
        "max_per_user_limit": MAX_PER_USER,
        "max_waiting": DEFAULTS.max_waiting,
        # What an outdated node runs to upgrade, for the URL this page was reached at (with its pin).
        "upgrade_command": upgrade_command(request.build_absolute_uri("/")),
        "usage": usage_by_user_and_deployment(),
        "usage_days": USAGE_WINDOW_DAYS,
    }
    return render(request, "console/console.html", context)


@staff_member_required
def state(request: HttpRequest) -> JsonResponse:
    return JsonResponse(snapshot())
