"""Read-only questions about model artifacts that more than one app asks."""

from __future__ import annotations

import json
from pathlib import Path

from controlplane.artifacts.models import ModelArtifact, ShardStatus
from inference.modelio.shards import MANIFEST_FILE


def largest_shard_bytes() -> int | None:
    """The bytes of the largest role shard built so far (what the biggest download to a box is),
    from the shards' manifests; None while no shard is built."""
    largest = None
    for shard_dir in ModelArtifact.objects.filter(shard_status=ShardStatus.READY).values_list("shard_dir", flat=True):
        for manifest in Path(shard_dir).glob(f"*/{MANIFEST_FILE}") if shard_dir else ():
            try:
                files = json.loads(manifest.read_text()).get("files", [])
                size = sum(int(f["size"]) for f in files if isinstance(f, dict) and "size" in f)
            except (OSError, ValueError, TypeError, KeyError):
                continue  # a shard being rebuilt or a stray directory: not a size to compare with
            largest = size if largest is None else max(largest, size)
    return largest
