"""Lazy, read-only access to a Hugging Face MoE checkpoint directory, of any supported family.

A Mixtral-8x7B checkpoint is ~90 GB, far more than the machines that shard or serve it
can hold, so nothing here loads a whole file: tensor names and shapes come from the
safetensors headers, and tensor data is read one tensor at a time with ``safe_open``
(which memory-maps the file). Every problem with the directory surfaces as a
``CheckpointError`` that names the directory or file and says what is wrong, because the
people who hit these errors have usually just downloaded 90 GB and need to know which
piece is broken, not a Rust traceback.

The checkpoint's family (``inference.modelio.families``, by the config's ``model_type``) says where
its routed experts live. ``Checkpoint`` shows them in one *shard layout*, whatever the family:
``model.layers.{L}.block_sparse_moe.experts.{E}.{w1|w2|w3}.weight`` (see ``ExpertKey``), the
Mixtral release's names. ``keys()`` lists those names in place of the release's expert tensors,
and ``tensor``, ``shape`` and ``nbytes`` resolve them to the release tensor, or to one expert's
rows of a fused ``[E, ...]`` tensor read by a safetensors slice (GraniteMoE), so sharding,
memory plans and calibration never see the family's own expert layout. Every other tensor
keeps its release name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from inference.modelio.families import SHARD_EXPERT_RE, SHARD_PROJS, ExpertSource, Family, FamilyError, family_for
from inference.modelio.families.base import shard_expert_name

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

EXPERT_PROJS = SHARD_PROJS  # w1 gate, w2 down, w3 up
_EXPERT_RE = SHARD_EXPERT_RE

# Bytes per element of the safetensors dtype codes; used to size a tensor from its header
# alone. Codes missing here (packed sub-byte formats) fall back to reading the tensor.
_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}


class CheckpointError(Exception):
    """The checkpoint directory is missing, incomplete, malformed, or not a supported MoE model."""


@dataclass(frozen=True)
class ExpertKey:
    """One expert projection of one layer, in the shard layout: ``w1`` (gate), ``w3`` (up) or ``w2`` (down)."""

    layer: int
    expert: int
    proj: str

    @property
    def name(self) -> str:
        return expert_key_name(self.layer, self.expert, self.proj)


def expert_key_name(layer: int, expert: int, proj: str) -> str:
    """The shard-layout tensor name of ``proj`` of ``expert`` in ``layer``."""
    if proj not in EXPERT_PROJS:
        raise ValueError(f"expert projection must be one of {EXPERT_PROJS}, got {proj!r}")
    return shard_expert_name(layer, expert, proj)


def expert_keys(experts: Iterable[tuple[int, int]]) -> list[str]:
    """The shard-layout tensor names of ``experts`` ((layer, expert) pairs, in that order), each
    expert's projections in ``EXPERT_PROJS`` order: what a worker's shard holds of them."""
    return [expert_key_name(layer, expert, proj) for layer, expert in experts for proj in EXPERT_PROJS]


def parse_expert_key(name: str) -> ExpertKey | None:
    """The expert a tensor name belongs to, or ``None`` for every non-expert tensor."""
    match = _EXPERT_RE.fullmatch(name)
    if match is None:
        return None
    return ExpertKey(int(match.group(1)), int(match.group(2)), match.group(3))


def is_expert_key(name: str) -> bool:
    return parse_expert_key(name) is not None


@dataclass(frozen=True)
class _TensorInfo:
    dtype: str
    shape: tuple[int, ...]


class Checkpoint:
    """A validated MoE checkpoint directory whose tensors are read on demand, experts in the shard layout.

    Construction checks everything that can be checked cheaply (the directory, the
    config, the index and the presence of every weights file); safetensors headers are
    parsed the first time a file is needed, and each is parsed only once.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            exists, is_dir = self.path.exists(), self.path.is_dir()
        except OSError as exc:  # a name too long for the filesystem, a directory we may not enter
            raise CheckpointError(f"checkpoint path {self.path} cannot be read: {exc.strerror}") from None
        if not exists:
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        if not is_dir:
            raise CheckpointError(f"checkpoint path {self.path} is not a directory")
        self.config: dict[str, Any] = _read_config(self.path)
        self.family: Family = family_for(self.config, check=False)
        self._weight_map: dict[str, str] | None = _read_index(self.path)
        self._single: Path | None = None
        if self._weight_map is None:
            self._single = self.path / SINGLE_WEIGHTS_FILE
            if not self._single.is_file():
                raise CheckpointError(_no_weights_message(self.path))
        try:
            self.family.check(self.config)
        except FamilyError as exc:
            raise CheckpointError(f"{self.path / CONFIG_FILE}: {exc}") from None
        self._expert_sources = self._map_experts()
        self._headers: dict[Path, dict[str, _TensorInfo]] = {}

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r})"

    # -- config ---------------------------------------------------------------------

    def hf_config(self) -> PretrainedConfig:
        """The config as its family's Transformers config class (imported lazily: it is slow)."""
        try:
            return self.family.config_class().from_dict(dict(self.config))
        except Exception as exc:  # transformers raises assorted types for bad fields
            raise CheckpointError(
                f"{self.path / CONFIG_FILE}: not a valid {self.family.model_type} config: {exc}"
            ) from exc

    @property
    def n_layers(self) -> int:
        return self._config_int("num_hidden_layers")

    @property
    def n_experts(self) -> int:
        return self.family.n_experts(self.config)

    # Properties, one declaration each: alike building/memory.py's MemoryPlan.main/shadow by shape.
    @property
    def top_k(self) -> int:
        return self._config_int("num_experts_per_tok")

    @property
    def hidden_size(self) -> int:
        return self._config_int("hidden_size")

    def _config_int(self, field: str) -> int:
        value = self.config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(
                f"{self.path / CONFIG_FILE}: field {field!r} must be a positive integer, got {value!r}"
            )
        return value

    # -- tensor names -----------------------------------------------------------------

    def files(self) -> list[Path]:
        """Every weights file, in a stable order (index order of first appearance)."""
        if self._single is not None:
            return [self._single]
        assert self._weight_map is not None
        return [self.path / name for name in dict.fromkeys(self._weight_map.values())]

    def release_keys(self) -> list[str]:
        """Every tensor name in the checkpoint's files (experts in the family's own layout)."""
        if self._weight_map is not None:
            return list(self._weight_map)
        assert self._single is not None
        return list(self._header(self._single))

    def keys(self) -> list[str]:
        """Every tensor name, routed experts in the shard layout (in place of their release tensors)."""
        keys: list[str] = []
        for name in self.release_keys():
            if self.family.is_release_expert(name):
                keys += self._experts_in.get(name, [])
            else:
                keys.append(name)
        return keys

    def dense_keys(self) -> list[str]:
        """Every tensor name but the routed experts' (what main holds: routers included)."""
        return [key for key in self.keys() if not is_expert_key(key)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        source = self._expert_sources.get(key) if isinstance(key, str) else None
        if source is not None:
            key = source.name
        elif isinstance(key, str) and self.family.is_release_expert(key) and _EXPERT_RE.fullmatch(key) is None:
            return False  # a release expert tensor is seen through the shard layout only
        if self._weight_map is not None:
            return key in self._weight_map
        assert self._single is not None
        return key in self._header(self._single)

    def expert_source(self, key: str) -> ExpertSource | None:
        """Where a shard-layout expert tensor lives in the release (None: not an expert key)."""
        return self._expert_sources.get(key)

    def file_of(self, key: str) -> Path:
        """The weights file that holds ``key`` (an expert key: the file of its release tensor)."""
        source = self._expert_sources.get(key)
        if source is not None:
            key = source.name
        if self._weight_map is not None:
            try:
                return self.path / self._weight_map[key]
            except KeyError:
                raise CheckpointError(f"tensor {key!r} is not listed in {self.path / INDEX_FILE}") from None
        assert self._single is not None
        if key not in self._header(self._single):
            raise CheckpointError(f"tensor {key!r} is not in {self._single}")
        return self._single

    # -- sizes and data ---------------------------------------------------------------

    def shape(self, key: str) -> tuple[int, ...]:
        source = self._expert_sources.get(key)
        if source is None:
            return self._info(key).shape
        return _sliced_shape(self._info(source.name).shape, source, key)

    def dtype(self, key: str) -> str:
        """The tensor's safetensors dtype name (``BF16``, ``F32``...), from the file header; an expert
        sliced from a fused release tensor has that tensor's."""
        source = self._expert_sources.get(key)
        return self._info(key if source is None else source.name).dtype

    def nbytes(self, key: str) -> int:
        """The tensor's size in bytes, from the file header (data is read only for exotic dtypes)."""
        source = self._expert_sources.get(key)
        info = self._info(key if source is None else source.name)
        per_element = _DTYPE_BYTES.get(info.dtype)
        if per_element is None:
            tensor = self.tensor(key)
            return tensor.numel() * tensor.element_size()
        count = 1
        for dim in self.shape(key):
            count *= dim
        return count * per_element

    def tensor(self, key: str) -> torch.Tensor:
        """Read one tensor (only its bytes are touched: an expert of a fused tensor reads its slice)."""
        file = self.file_of(key)
        with _open(file) as handle:
            return self._read(handle, file, key)

    def iter_tensors(self, keys: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for ``keys`` (default: all), one tensor at a time.

        Keys are grouped by file so that each file is opened once; within a file they
        keep the order they were given in.
        """
        by_file: dict[Path, list[str]] = {}
        for key in self.keys() if keys is None else keys:
            by_file.setdefault(self.file_of(key), []).append(key)
        for file, names in by_file.items():
            with _open(file) as handle:
                for name in names:
                    yield name, self._read(handle, file, name)

    def _read(self, handle: Any, file: Path, key: str) -> torch.Tensor:
        source = self._expert_sources.get(key)
        if source is None or source.index is None:
            return _get(handle, file, key if source is None else source.name)
        shape = _sliced_shape(self._info(source.name).shape, source, key)  # checks the fused tensor's shape
        rows = source.rows or (0, shape[0])
        try:
            part = handle.get_slice(source.name)[source.index : source.index + 1, rows[0] : rows[1]]
        except Exception as exc:
            raise CheckpointError(f"cannot read expert rows {key!r} from {source.name!r} in {file}: {exc}") from exc
        # safetensors maps the file and returns a view of the whole fused tensor's storage, with
        # only this slice's pages read: the clone owns this expert's bytes alone.
        return part[0].clone()  # [rows, cols]

    def _map_experts(self) -> dict[str, ExpertSource]:
        """Shard-layout expert name -> its release source, for every layer, expert and projection."""
        sources: dict[str, ExpertSource] = {}
        self._experts_in: dict[str, list[str]] = {}
        for layer in range(self.n_layers):
            for expert in range(self.n_experts):
                for proj in EXPERT_PROJS:
                    key = expert_key_name(layer, expert, proj)
                    source = self.family.expert_source(layer, expert, proj, self.config)
                    sources[key] = source
                    self._experts_in.setdefault(source.name, []).append(key)
        return sources

    def _info(self, key: str) -> _TensorInfo:
        file = self.file_of(key)
        try:
            return self._header(file)[key]
        except KeyError:
            raise CheckpointError(
                f"{file}: tensor {key!r} is listed in {INDEX_FILE} but missing from the file; "
                "the download is incomplete or the index belongs to another checkpoint"
            ) from None

    def _header(self, file: Path) -> dict[str, _TensorInfo]:
        # Cached because sizing all ~1000 tensors of a real checkpoint would otherwise
        # re-open a file per tensor.
        cached = self._headers.get(file)
        if cached is None:
            with _open(file, framework="numpy") as handle:  # headers only: no torch needed (nor imported)
                cached = {}
                names = handle.keys()  # a method of safe_open, which is not iterable itself
                for name in names:
                    view = handle.get_slice(name)
                    cached[name] = _TensorInfo(view.get_dtype(), tuple(view.get_shape()))
            self._headers[file] = cached
        return cached


# -- helpers ------------------------------------------------------------------------


def _read_json(file: Path, what: str) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {file}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what} {file} is not valid JSON: {exc}") from exc


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{directory} has no {CONFIG_FILE}; is it a Hugging Face model directory? "
            "(download the whole model repository, not just the weights)"
        )
    config = _read_json(file, "model config")
    if not isinstance(config, dict):
        raise CheckpointError(f"model config {file} must be a JSON object")
    try:
        family_for(config, check=False)
    except FamilyError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    return config


def _read_index(directory: Path) -> dict[str, str] | None:
    """The index's tensor → file map, or ``None`` when the checkpoint has no index."""
    file = directory / INDEX_FILE
    if not file.exists():
        return None
    index = _read_json(file, "weights index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"weights index {file} has no 'weight_map' object listing the tensors")
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(f"weights index {file}: tensor {key!r} maps to a bad file name {name!r}")
    missing = sorted(name for name in set(weight_map.values()) if not (directory / name).is_file())
    if missing:
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing)} weights file(s) listed in {INDEX_FILE} "
            f"are missing: {', '.join(missing)}"
        )
    return weight_map


def _sliced_shape(fused: tuple[int, ...], source: ExpertSource, key: str) -> tuple[int, ...]:
    """The shape of one expert's projection within a release tensor of shape ``fused``."""
    if source.index is None:
        return fused
    if source.fused is not None and fused != source.fused:
        raise CheckpointError(f"tensor {source.name!r} is {list(fused)}, but the config says {list(source.fused)}")
    if len(fused) != 3 or source.index >= fused[0]:
        raise CheckpointError(f"tensor {source.name!r} is {fused}, not [experts, rows, cols] holding {key!r}")
    rows = source.rows or (0, fused[1])
    if rows[1] > fused[1]:
        raise CheckpointError(
            f"tensor {source.name!r} is {fused}: too few rows for {key!r} (rows {rows[0]}..{rows[1]})"
        )
    return (rows[1] - rows[0], fused[2])


def _no_weights_message(directory: Path) -> str:
    legacy = sorted(p.name for p in directory.glob("*.bin"))
    hint = f" (found {', '.join(legacy)}: PyTorch .bin weights are not supported)" if legacy else ""
    return f"{directory} has no weights: expected {SINGLE_WEIGHTS_FILE} or {INDEX_FILE}{hint}"


def _open(file: Path, framework: str = "pt") -> Any:
    # safe_open validates the whole header (and that the data region is fully present),
    # so truncated or garbage files fail here; turn that into an error naming the file.
    # framework="pt" imports torch; sizing a checkpoint (headers only) opens it with "numpy",
    # so the control plane's web and Celery processes size models without torch.
    try:
        return safe_open(str(file), framework=framework)
    except Exception as exc:  # SafetensorError or OSError
        raise CheckpointError(f"cannot read weights file {file}: {exc}; the file is damaged or incomplete") from exc


def _get(handle: Any, file: Path, key: str) -> torch.Tensor:
    try:
        return handle.get_tensor(key)
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {key!r} from {file}: {exc}") from exc
