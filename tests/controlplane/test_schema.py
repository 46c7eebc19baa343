"""The OpenAPI schema documents every endpoint, without warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from django.core.management import call_command
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


def test_schema_is_valid_and_lists_the_endpoints(tmp_path: Path) -> None:
    out = tmp_path / "schema.yml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    schema = yaml.safe_load(out.read_text())
    for path in (
        "/api/agents/enroll",
        "/api/join-tokens",
        "/api/nodes",
        "/api/models",
        "/api/deployments",
        "/api/deployments/{deployment_id}/settings",
    ):
        assert path in schema["paths"], path
    assert {"apiKey", "nodeCredential"} <= set(schema["components"]["securitySchemes"])


def test_schema_is_served() -> None:
    response = APIClient().get("/api/schema/")
    assert response.status_code == 200
    assert b"/api/agents/enroll" in response.content
