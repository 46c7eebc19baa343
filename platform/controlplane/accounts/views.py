"""The API keys page (any logged-in user): your keys with their tokens (today in UTC, and the
last 30 days) and daily quota, a form to create one, revoke buttons.

Plain HTML forms, no script: a created key is shown once on the answer page and never again.
"""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from . import selectors, services
from .api import MAX_EXPIRY_DAYS
from .models import ApiKey
from .scopes import Scope, ScopeError, allowed_scopes


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="what the key is for")
    scopes = forms.MultipleChoiceField(widget=forms.CheckboxSelectMultiple)
    # Declarations, one per line: alike api.py's KeyListApi.InputSerializer (the API's side).
    expires_in_days = forms.IntegerField(
        min_value=1, max_value=MAX_EXPIRY_DAYS, required=False, help_text="empty: never expires"
    )
    daily_token_quota = forms.IntegerField(
        min_value=1,
        max_value=services.MAX_DAILY_TOKEN_QUOTA,
        required=False,
        help_text="prompt and completion tokens per UTC day; empty: unlimited",
    )

    def __init__(self, *args, user, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        mine = allowed_scopes(user)
        self.fields["scopes"].choices = [(s.value, f"{s.value}: {s.label}") for s in Scope if s.value in mine]
        self.fields["scopes"].initial = [Scope.INFERENCE]


@login_required
@require_http_methods(["GET", "POST"])
def keys_page(request: HttpRequest) -> HttpResponse:
    created = None
    form = KeyForm(user=request.user)
    if request.method == "POST" and "revoke" in request.POST:
        key = get_object_or_404(ApiKey, pk=_int(request.POST["revoke"]), user=request.user)
        services.revoke_api_key(key=key)
        return redirect("keys-page")
    if request.method == "POST":
        form = KeyForm(request.POST, user=request.user)
        if form.is_valid():
            days = form.cleaned_data["expires_in_days"]
            try:
                _, created = services.create_api_key(
                    user=request.user,
                    name=form.cleaned_data["name"],
                    scopes=form.cleaned_data["scopes"],
                    expires_at=timezone.now() + timedelta(days=days) if days else None,
                    daily_token_quota=form.cleaned_data["daily_token_quota"],
                )
                form = KeyForm(user=request.user)
            except ScopeError as exc:
                form.add_error("scopes", str(exc))
    keys = list(ApiKey.objects.filter(user=request.user))
    spent = selectors.key_usage(keys=keys)
    for key in keys:
        key.spent = spent.get(key.pk, selectors.Spent())
    return render(request, "accounts/keys.html", {"form": form, "keys": keys, "created": created})


def _int(value: str) -> int:
    return int(value) if value.isascii() and value.isdigit() and len(value) < 19 else 0  # not "²": int() refuses it
