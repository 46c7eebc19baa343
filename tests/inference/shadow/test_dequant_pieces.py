"""Dequantizing in pieces (bounded temporaries) gives exactly what one pass over the weight gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.constants import NF4_BLOCKSIZE
from inference.shadow import quant


def _one_pass(q: quant.QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole-tensor dequantization the pieces replaced (its temporaries: ~20 bytes an element)."""
    if q.scheme == "int8":
        return (q.data.float() * q.state.float()[:, None]).to(dtype)
    n = q.shape.numel()
    packed = q.data.reshape(-1)
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(-1)[:n].long()
    values = quant._nf4_code(q.data.device)[codes]
    values = nn.functional.pad(values, (0, -n % NF4_BLOCKSIZE)).view(-1, NF4_BLOCKSIZE)
    return (values * q.state.float()[:, None]).reshape(-1)[:n].reshape(q.shape).to(dtype)


@pytest.mark.parametrize("scheme", quant.QUANT_SCHEMES)
@pytest.mark.parametrize("chunk", [NF4_BLOCKSIZE, 3 * NF4_BLOCKSIZE, 1 << 20])
def test_pieces_equal_one_pass(scheme: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "DEQUANT_CHUNK_ELEMENTS", chunk)
    generator = torch.Generator().manual_seed(0)
    # Sizes that are and are not multiples of the block, of a piece, and of two (odd: a half byte).
    for shape in [(7, 13), (33, 65), (64, 64), (1000, 37), (5, 1)]:
        weight = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        q = quant.quantize_weight(weight, scheme)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = quant.dequantize_weight(q, dtype)
            assert got.dtype == dtype and torch.equal(got, _one_pass(q, dtype)), (shape, dtype)
