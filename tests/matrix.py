"""A test matrix in two tiers: a cover in ``make check``, every cell in ``make test``.

``covered(rows, columns)`` gives every (row, column) pair as a pytest param; the cells of one
diagonal (each row and each column at least once) run in the fast tier, the rest are marked
``slow`` so that ``make check`` (``-m "not slow"``) leaves them to ``make test``, which runs all.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest


def covered(rows: Sequence[object], columns: Sequence[tuple]) -> list:
    """Params ``(row, *column)`` for every cell; the cover of rows and columns is not ``slow``."""
    params = []
    for j, column in enumerate(columns):
        for i, row in enumerate(rows):
            fast = i == j % len(rows) or j == i % len(columns)
            marks = () if fast else (pytest.mark.slow,)
            params.append(pytest.param(row, *column, marks=marks, id=f"{'-'.join(map(str, column))}-{row}"))
    return params
