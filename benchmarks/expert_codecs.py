"""Lossless codecs for an expert's bytes, compared on bf16 and fp16 weights (issue 41's first step).

    python -m benchmarks.expert_codecs [--model platform/demo-model] [--repeats 5] [--json OUT]

Weights: the demo model's routed experts (fp32, trained) cast to bf16, fp16 and fp32 (their own dtype), and one
expert at Mixtral-8x7B's dimensions (w1 and w3 [14336, 4096], w2 [4096, 14336]) drawn from a
normal distribution with the demo experts' own standard deviation, in each dtype. For each
codec installed (a missing one is reported as missing; ``pip install zipnn dfloat11``):

- ``ratio``: compressed bytes ÷ raw bytes, over every tensor of the set;
- ``encode_mb_s`` / ``decode_mb_s``: raw megabytes per second on this machine's CPU, one thread,
  median of ``--repeats`` runs over the set (decode is what a worker would pay per expert);
- ``exact``: every decoded tensor is the same bits as the original.

The codecs:

- ``zstd``: the raw bytes through zstandard (level 3), the baseline;
- ``exponent-plane``: each 16-bit word split into an exponent byte plane (bf16's 8 exponent bits;
  fp16's sign, 5 exponent bits and top 2 mantissa bits) compressed with zstandard, and the other
  byte plane raw (bf16's sign and 7 mantissa bits; fp16's low 8 mantissa bits), DFloat11's and
  ZipNN's observation that only the exponent carries little information;
- ``zipnn``: the ZipNN package (byte grouping and Huffman coding, its own C code);
- ``runtime``: the code the shard build writes with ``expert_codec="exponent-plane"``
  (``inference.modelio.expert_codec``): the same split for bf16 and fp16, and fp32 (its high half split
  as a bf16, its low 16 mantissa bits raw), the exponent plane as fixed-width codes and an escape list
  (the palette a GPU decodes with torch's kernels), decoded as the workers' stores decode;
- ``runtime-zstd``: the runtime's earlier code, the same planes with the exponent through zstandard;
- ``dfloat11``: DFloat11's format (the exponent Huffman-coded from the tensor's histogram with its
  own codec builder, sign and mantissa raw); its decoder is a CUDA kernel only, so its size is
  computed from the code lengths and no CPU speed is given.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from benchmarks import provenance
from inference.modelio.families import family_for

# What its figures depend on beyond its own imports (benchmarks.substance): nothing, it runs in one process.
DEPENDS_ON: tuple[str, ...] = ()

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "platform" / "demo-model"
MIXTRAL_EXPERT = {"w1": (14336, 4096), "w3": (14336, 4096), "w2": (4096, 14336)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAFETENSORS_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def demo_experts(model: Path) -> list[torch.Tensor]:
    """Every routed expert tensor of the checkpoint, in its own dtype."""
    config = json.loads((model / "config.json").read_text())
    family = family_for(config)
    tensors = []
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors += [f.get_tensor(name) for name in f.keys() if family.is_release_expert(name)]  # noqa: SIM118
    if not tensors:
        raise SystemExit(f"{model}: no routed expert tensors found")
    return tensors


def exponent_plane_split(words: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(the plane that carries the exponent, the other plane) of uint16 ``words``."""
    if dtype == "bf16":  # exponent bits 14..7 in one byte; sign and 7 mantissa bits in the other
        exponent = ((words >> 7) & 0xFF).astype(np.uint8)
        rest = (((words >> 8) & 0x80) | (words & 0x7F)).astype(np.uint8)
        return exponent, rest
    return (words >> 8).astype(np.uint8), (words & 0xFF).astype(np.uint8)  # fp16: the high byte, the low byte


def exponent_plane_join(exponent: np.ndarray, rest: np.ndarray, dtype: str) -> np.ndarray:
    e, r = exponent.astype(np.uint16), rest.astype(np.uint16)
    if dtype == "bf16":
        return ((r & 0x80) << 8) | (e << 7) | (r & 0x7F)
    return (e << 8) | r


class Codec:
    name = ""

    def encode(self, tensor: torch.Tensor, dtype: str) -> object:
        raise NotImplementedError

    def size(self, encoded: object) -> int:
        raise NotImplementedError

    def decode(self, encoded: object, like: torch.Tensor, dtype: str) -> torch.Tensor | None:
        """The tensor again, or None where this machine cannot decode it."""
        raise NotImplementedError


class Zstd(Codec):
    name = "zstd"

    def __init__(self) -> None:
        import zstandard

        self.version = importlib.metadata.version("zstandard")
        self.c, self.d = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()

    def encode(self, tensor, dtype):
        return self.c.compress(tensor.view(torch.uint8).numpy().tobytes())

    def size(self, encoded):
        return len(encoded)

    def decode(self, encoded, like, dtype):
        raw = np.frombuffer(self.d.decompress(encoded), dtype=np.uint8)
        return torch.from_numpy(raw.copy()).view(like.dtype).view(like.shape)


class ExponentPlane(Zstd):
    name = "exponent-plane"

    def encode(self, tensor, dtype):
        if dtype == "fp32":
            return None  # a 16-bit split; fp32 is the runtime's (below)
        exponent, rest = exponent_plane_split(tensor.view(torch.int16).numpy().view(np.uint16).ravel(), dtype)
        return self.c.compress(exponent.tobytes()), rest.tobytes()

    def size(self, encoded):
        return len(encoded[0]) + len(encoded[1])

    def decode(self, encoded, like, dtype):
        exponent = np.frombuffer(self.d.decompress(encoded[0]), dtype=np.uint8)
        words = exponent_plane_join(exponent, np.frombuffer(encoded[1], dtype=np.uint8), dtype)
        return torch.from_numpy(words.view(np.int16)).view(like.dtype).view(like.shape)


class Runtime(Codec):
    """The code the shard build writes (``inference.modelio.expert_codec``): the exponent plane as fixed-width
    codes and an escape list (the palette), decoded into one flat buffer as the workers' stores do; fp32 too
    (its high half as a bf16)."""

    name = "runtime"
    package = "numpy"

    def __init__(self) -> None:
        from inference.modelio import expert_codec

        self.version = importlib.metadata.version(self.package)
        self.codec = expert_codec
        self.code = expert_codec.PALETTE_CODE

    def encode(self, tensor, dtype):
        raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
        return self.codec.encode(raw, SAFETENSORS_DTYPES[dtype], self.code)

    def size(self, encoded):
        return len(encoded)

    def decode(self, encoded, like, dtype):
        raw = self.codec.decode(encoded, SAFETENSORS_DTYPES[dtype], like.numel() * like.element_size(), code=self.code)
        return torch.from_numpy(raw).view(like.dtype).view(like.shape)


class RuntimeZstd(Runtime):
    """The runtime's earlier code, which sets built before the palette hold: the exponent plane through zstandard."""

    name = "runtime-zstd"
    package = "zstandard"

    def __init__(self) -> None:
        super().__init__()
        self.code = self.codec.ZSTD_CODE


class ZipNN(Codec):
    name = "zipnn"

    def __init__(self) -> None:
        import zipnn

        self.version = importlib.metadata.version("zipnn")
        self.zipnn = zipnn
        self.by_dtype = {
            d: zipnn.ZipNN(
                input_format="torch",
                bytearray_dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[d],
                threads=1,
            )
            for d in DTYPES
        }

    def encode(self, tensor, dtype):
        return self.by_dtype[dtype].compress(tensor.clone())  # it reorders its input's bytes in place

    def size(self, encoded):
        return len(encoded)

    def decode(self, encoded, like, dtype):
        return self.by_dtype[dtype].decompress(encoded).view(like.shape)


class DFloat11(Codec):
    name = "dfloat11"

    def __init__(self) -> None:
        from dahuffman import HuffmanCodec

        self.version = importlib.metadata.version("dfloat11")
        self.huffman = HuffmanCodec

    def encode(self, tensor, dtype):
        if dtype != "bf16":
            return None  # DFloat11 is a bf16 format
        words = tensor.view(torch.int16).numpy().view(np.uint16).ravel()
        values, counts = np.unique((words >> 7) & 0xFF, return_counts=True)
        table = self.huffman.from_frequencies(dict(zip(values.tolist(), counts.tolist(), strict=True))).get_code_table()
        bits = sum(int(c) * table[int(v)][0] for v, c in zip(values, counts, strict=True))
        return words.size + (bits + 7) // 8  # sign and mantissa bytes, then the exponents' code

    def size(self, encoded):
        return encoded

    def decode(self, encoded, like, dtype):
        return None


CODECS: tuple[type[Codec], ...] = (Zstd, ExponentPlane, Runtime, RuntimeZstd, ZipNN, DFloat11)


def measure(codec: Codec, tensors: list[torch.Tensor], dtype: str, repeats: int) -> dict:
    raw = sum(t.numel() * t.element_size() for t in tensors)
    encode_s, decode_s = [], []
    encoded: list[object] = []
    exact: bool | None = True
    for _ in range(repeats):
        started = time.perf_counter()
        encoded = [codec.encode(t, dtype) for t in tensors]
        encode_s.append(time.perf_counter() - started)
        if encoded[0] is None:
            return {"ratio": None, "note": "not a format for this dtype"}
        started = time.perf_counter()
        decoded = [codec.decode(e, t, dtype) for e, t in zip(encoded, tensors, strict=True)]
        decode_s.append(time.perf_counter() - started)
        if decoded[0] is None:
            exact = None
        else:
            exact = exact and all(
                torch.equal(d.view(torch.uint8), t.view(torch.uint8)) for d, t in zip(decoded, tensors, strict=True)
            )
    compressed = sum(codec.size(e) for e in encoded)
    figures = {"ratio": compressed / raw, "raw_mb": raw / 1e6, "encode_mb_s": raw / 1e6 / statistics.median(encode_s)}
    if exact is not None:  # decoded here
        figures |= {"decode_mb_s": raw / 1e6 / statistics.median(decode_s), "exact": exact}
        figures["decode_mb_s_runs"] = [raw / 1e6 / s for s in decode_s]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    if args.repeats < 1:
        parser.error("--repeats is at least 1")
    torch.set_num_threads(1)
    experts = demo_experts(args.model)
    std = float(torch.cat([t.float().ravel() for t in experts]).std())
    generator = torch.Generator().manual_seed(0)
    mixtral = [torch.randn(shape, generator=generator) * std for shape in MIXTRAL_EXPERT.values()]
    sets: dict[str, Callable[[torch.dtype], list[torch.Tensor]]] = {
        "demo": lambda d: [t.to(d) for t in experts],
        "mixtral_expert": lambda d: [t.to(d) for t in mixtral],
    }
    codecs: dict[str, Codec] = {}
    missing: dict[str, str] = {}
    for kind in CODECS:
        try:
            codecs[kind.name] = kind()
        except ImportError as exc:
            missing[kind.name] = str(exc)
    results: dict[str, dict] = {}
    for set_name, make in sets.items():
        for dtype, torch_dtype in DTYPES.items():
            tensors = make(torch_dtype)
            key = f"{set_name}/{dtype}"
            results[key] = {name: measure(codec, tensors, dtype, args.repeats) for name, codec in codecs.items()}
            print(
                f"  {key}: " + ", ".join(f"{n} {r['ratio']:.3f}" for n, r in results[key].items() if r["ratio"]),
                file=sys.stderr,
            )
    print(
        f"experts of {args.model.name} ({len(experts)} tensors, std {std:.4f}) and one Mixtral-size expert; 1 thread\n"
    )
    print("| weights | codec | bytes ÷ raw | encode MB/s | decode MB/s | bit-exact |\n|---|---|---:|---:|---:|---|")
    for key, per_codec in results.items():
        for name, r in per_codec.items():
            if r["ratio"] is None:
                continue
            decode = f"{r['decode_mb_s']:.0f}" if "decode_mb_s" in r else "GPU only"
            print(f"| {key} | {name} | {r['ratio']:.3f} | {r['encode_mb_s']:.0f} | {decode} | {r.get('exact', '—')} |")
    if missing:
        print(f"\nnot installed: {', '.join(missing)}")
    if args.json:
        provenance.write(
            args.json,
            {
                "model": args.model.name,
                "expert_std": std,
                "repeats": args.repeats,
                "codec_versions": {name: getattr(codec, "version", "") for name, codec in codecs.items()},
                "missing": missing,
                "results": results,
            },
            begun,
            "torch",
            "transformers",
            depends_on=DEPENDS_ON,
        )
    exact = all(r.get("exact") is not False for per in results.values() for r in per.values())
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
