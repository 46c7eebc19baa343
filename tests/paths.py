"""The checkout's root, for the test files that read its folders, wherever under ``tests/`` they sit."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
