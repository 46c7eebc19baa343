"""Shared fixtures: tiny checkpoints written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.tiny import make_tiny
from tests.reference import ODD_SHAPE


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def odd_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("odd") / "model", seed=1, **ODD_SHAPE)
