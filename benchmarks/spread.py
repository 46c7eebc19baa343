"""How a benchmark reports a figure measured over several runs: the median, the least and the
most, and every run as measured (a summary counts every recorded run, the bad ones too)."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict:
    """``values``' median, min and max, and all of them (``all``), in the order they were measured."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}
