"""The settings a production server runs with: no published key, HTTPS only, strong passwords.

Each settings module is loaded in a Python of its own (as the servers load it), never reloaded
inside the test process, whose settings are the suite's.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError

from tests.paths import REPO


def settings_probe(module: str, code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` after ``django.setup()`` with ``module`` as the settings, in a fresh Python."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "ODMOE_")) and k != "DATABASE_URL"}
    environment = {
        **clean,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
        "DJANGO_SETTINGS_MODULE": f"controlplane.config.settings.{module}",
        "ODMOE_VAR_DIR": str(tmp_path / "var"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        **env,
    }
    script = "import django\ndjango.setup()\nfrom django.conf import settings\n" + code
    return subprocess.run(
        [sys.executable, "-c", script], env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_the_shared_settings_have_no_signing_key_to_fall_back_on(tmp_path: Path) -> None:
    """Without DJANGO_SECRET_KEY the shared settings give no key at all (Django refuses to sign),
    never one published with the source."""
    run = settings_probe("base", "print(repr(settings.SECRET_KEY))", tmp_path)
    assert run.returncode != 0 and "The SECRET_KEY setting must not be empty" in run.stderr, run.stdout
    source = (REPO / "platform" / "controlplane" / "config" / "settings" / "base.py").read_text()
    assert 'os.environ.get("DJANGO_SECRET_KEY", "")' in source


def test_the_test_and_local_settings_each_bring_their_own_key(tmp_path: Path) -> None:
    test = settings_probe("test", "print(settings.SECRET_KEY)", tmp_path)
    local = settings_probe("local", "print(settings.SECRET_KEY)", tmp_path)
    assert test.returncode == 0 and local.returncode == 0, test.stderr + local.stderr
    assert test.stdout.strip() and local.stdout.strip() != test.stdout.strip()
    assert local.stdout.strip() == (tmp_path / "var" / "secret_key").read_text().strip()


@pytest.mark.parametrize("key", ["", "odmoe-insecure-development-key-change-me", "replace-with-64-random-characters"])
def test_production_refuses_a_missing_or_published_key(tmp_path: Path, key: str) -> None:
    env = {"DJANGO_SECRET_KEY": key} if key else {}
    run = settings_probe("production", "print('started')", tmp_path, **env)
    assert run.returncode != 0 and "set DJANGO_SECRET_KEY to a random value" in run.stderr
    assert "started" not in run.stdout


@pytest.mark.parametrize("token", ["too-short", "replace-with-a-random-token-of-32-characters-or-more"])
def test_production_refuses_a_short_or_example_metrics_token_and_starts_without_one(tmp_path: Path, token: str) -> None:
    key = secrets.token_urlsafe(48)
    run = settings_probe("production", "print('started')", tmp_path, DJANGO_SECRET_KEY=key, ODMOE_METRICS_TOKEN=token)
    assert run.returncode != 0 and "set ODMOE_METRICS_TOKEN to a random value" in run.stderr
    unset = settings_probe("production", "print(settings.METRICS_TOKEN_ONLY)", tmp_path, DJANGO_SECRET_KEY=key)
    assert unset.returncode == 0 and unset.stdout.strip() == "True", unset.stderr


def test_a_rotated_key_still_accepts_what_the_old_one_signed(tmp_path: Path) -> None:
    """DJANGO_SECRET_KEY_FALLBACKS: a value signed with the old key still checks out after the
    rotation, and nothing new is signed with it; a published key there is refused."""
    old, new = secrets.token_urlsafe(48), secrets.token_urlsafe(48)
    sign = "from django.core import signing\nprint(signing.dumps('session'))"
    signed = settings_probe("production", sign, tmp_path, DJANGO_SECRET_KEY=old).stdout.strip()
    check = f"from django.core import signing\nprint(signing.loads({signed!r}))\nprint(signing.dumps('x'))"
    rotated = settings_probe("production", check, tmp_path, DJANGO_SECRET_KEY=new, DJANGO_SECRET_KEY_FALLBACKS=old)
    assert rotated.returncode == 0, rotated.stderr
    loaded, fresh = rotated.stdout.split()
    assert loaded == "session"
    verify_new_only = f"from django.core import signing\nprint(signing.loads({fresh!r}))"
    assert settings_probe("production", verify_new_only, tmp_path, DJANGO_SECRET_KEY=old).returncode != 0
    dropped = settings_probe("production", check, tmp_path, DJANGO_SECRET_KEY=new)
    assert dropped.returncode != 0 and "BadSignature" in dropped.stderr
    published = settings_probe(
        "production",
        "",
        tmp_path,
        DJANGO_SECRET_KEY=new,
        DJANGO_SECRET_KEY_FALLBACKS="odmoe-insecure-development-key-change-me",
    )
    assert published.returncode != 0 and "holds a published key" in published.stderr


PRODUCTION_PROBE = """
from django.core.management import call_command
from django.test import Client
import json
plain = Client().get("/api/schema/")
secure = Client().get("/accounts/login/", secure=True)
call_command("check", deploy=True, fail_level="WARNING")  # raises on any warning
print(json.dumps({
    "plain": [plain.status_code, plain.get("Location")],
    "hsts": secure.get("Strict-Transport-Security"),
    "secure_status": secure.status_code,
    "cookies_secure": [settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE],
}))
"""


def test_production_sends_plain_http_to_https_and_asks_for_https_only(tmp_path: Path) -> None:
    """Behind the proxy: a plain-HTTP request is redirected, HTTPS answers carry HSTS for a year,
    and Django's deployment checks find nothing left to warn about."""
    key = secrets.token_urlsafe(48)
    migrate = settings_probe(
        "production",
        "from django.core.management import call_command\ncall_command('migrate', verbosity=0)",
        tmp_path,
        DJANGO_SECRET_KEY=key,
    )
    assert migrate.returncode == 0, migrate.stderr
    run = settings_probe(
        "production", PRODUCTION_PROBE, tmp_path, DJANGO_SECRET_KEY=key, DJANGO_ALLOWED_HOSTS="testserver"
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["plain"] == [301, "https://testserver/api/schema/"]
    assert seen["secure_status"] == 200 and seen["hsts"] == "max-age=31536000"
    assert seen["cookies_secure"] == [True, True]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "password, why",
    [
        ("short1!", "too short"),
        ("password123", "too common"),
        ("8273645019283", "entirely numeric"),
        ("margaret.hamilton", "too similar to the username"),
    ],
)
def test_weak_passwords_are_refused_for_every_reason_django_knows(password: str, why: str) -> None:
    user = get_user_model()(username="margaret.hamilton", email="mh@example.org")
    with pytest.raises(ValidationError, match=why):
        validate_password(password, user)
    validate_password("correct-horse-battery-staple", user)  # a good one passes every validator
