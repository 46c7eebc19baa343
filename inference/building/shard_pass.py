"""A shard build's pass over the checkpoint: each planned share's tensors read, one at a time,
stored as the share says, and handed to the writer.

A worker's experts are coded where the plan says so (``inference.modelio.expert_codec``: each
expert tensor becomes a flat ``uint8`` tensor of its coded bytes, noted in the manifest's
``stored``); a pre-converted shadow's tensors are converted to its dtype
(``inference.shadow.shadow_model.convert_tensors``), which loads Transformers, so only a build
that converts imports it. Progress counts the checkpoint's bytes read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from inference.building.shard_plan import ShardPlan
from inference.building.shard_writer import write_role, write_set_index
from inference.modelio.checkpoint import Checkpoint, is_expert_key
from inference.modelio.shards import StoredTensor

if TYPE_CHECKING:
    import torch

ProgressFn = Callable[[int, int], None]


def write_plan(ckpt: Checkpoint, plan: ShardPlan, max_file_bytes: int, progress: ProgressFn | None = None) -> None:
    """Every share of ``plan`` written from ``ckpt``, then the set's index; ``progress(done, total)``
    is called with the checkpoint's tensor bytes read so far, from ``(0, total)`` to ``(total, total)``.

    Raises ``CheckpointError`` for a tensor that cannot be read.
    """
    total, done = plan.read_bytes, 0
    if progress is not None:
        progress(0, total)

    def read(keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal done
        for name, tensor in ckpt.iter_tensors(keys):
            done += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress(done, total)
            yield name, tensor

    for share in plan.shares:
        stored: dict[str, StoredTensor] = {}
        records = read(share.keys)
        if share.expert_codec != "none":
            records = _coded(records, stored)
        if share.role.shadow_dtype is not None:
            import torch

            # Transformers (the model skeleton): kept out of the processes that import the shard
            # build for its names (the control plane's web process), loaded only by a build that converts.
            from inference.shadow.shadow_model import convert_tensors

            records = convert_tensors(records, ckpt.hf_config(), share.role.shadow_dtype, torch.device("cpu"))
        write_role(plan, share, records, stored, ckpt.path, max_file_bytes)
    if progress is not None and done != total:
        progress(total, total)
    write_set_index(plan)


def _coded(
    records: Iterable[tuple[str, torch.Tensor]], stored: dict[str, StoredTensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert tensor of ``records`` as its coded bytes (a flat uint8 tensor), noted in ``stored``;
    any other tensor, or one of a dtype the code does not take, as it is."""
    import torch

    from inference.modelio.expert_codec import PALETTE_CODE, encode, supports
    from inference.modelio.tensorfile import DTYPES

    names = {dtype: name for name, dtype in DTYPES.items()}
    for name, tensor in records:
        dtype = names.get(tensor.dtype, "")
        if not (is_expert_key(name) and supports(dtype)):
            yield name, tensor
            continue
        raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
        blob = encode(raw, dtype)
        stored[name] = StoredTensor(PALETTE_CODE, dtype, tuple(tensor.shape), raw.size, len(blob))
        yield name, torch.frombuffer(bytearray(blob), dtype=torch.uint8)
