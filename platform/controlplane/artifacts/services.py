"""Writes of the artifacts app: register a checkpoint (a directory, or a Hugging Face Hub repo
downloaded first), build its role shards with progress.

A model's shard sets are keyed by worker count and expert codec (``inference.settings``'s
``expert_codec``): each has its own folder (``shard_dir_for``: ``workers-2``, ``workers-2-exponent-plane``),
so a coded set and an uncoded one of the same model never overwrite each other, and a set
built once is reused by every deployment that asks for it again. The artifact's ``shard_*``
columns describe the set built or reused last; an agent is served the set its own start
named (``shard_set`` in its task), whatever was built since.
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from controlplane.queueing import queue_task
from inference.building.sharding import add_shadow_shards, build_shards
from inference.constants import EXPERT_CODECS, MAIN_EXTRAS
from inference.modelio.checkpoint import Checkpoint, CheckpointError
from inference.modelio.shards import SET_FILE, ShardError, ShardSet, shadow_dtypes_to_build

from .models import ModelArtifact, ModelStatus, ShardStatus

# The tasks this module queues, by name (controlplane.queueing): thin wrappers in tasks.py.
BUILD_MODEL_SHARDS_TASK = "controlplane.artifacts.tasks.build_model_shards_task"
DOWNLOAD_MODEL_TASK = "controlplane.artifacts.tasks.download_model_task"
PROGRESS_EVERY_S = 0.5  # how often a shard build or a download writes its progress to the database
# What a download fetches from a Hub repo: weights, configs, tokenizer and chat template
# (no .bin or .pt duplicates of the weights, no original/ consolidated files).
HUB_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.txt"]
# owner/name (the Hub's own name rules), optionally @revision (a branch, tag or commit).
REPO_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?)"
    r"(?:@(?P<revision>[\w.][\w./-]{0,254}))?$"
)
# A shard set's folder name under its model's (``shard_set_name``): what a start_role task names.
SHARD_SET_NAME = re.compile(r"workers-[1-9][0-9]{0,3}(?:-(?:" + "|".join(map(re.escape, EXPERT_CODECS)) + r"))?")
NO_ROUTE_HINT = (
    "this server has no route to the hub — download the model on a machine that has one and register its directory"
)


class ModelError(ValueError):
    """A checkpoint could not be registered or sharded; the message says why."""


def add_model(*, name: str, path: str) -> ModelArtifact:
    """Register ``path``: a checkpoint directory at once (as always), a Hub repo id by downloading it first.

    An absolute, home- or dot-relative path is a directory even when missing, so a mistyped
    path says that no checkpoint is there, not that it cannot be downloaded.
    """
    if path.startswith(("/", "~", ".")) or _is_directory(path):
        return register_model(name=name, path=path)
    return request_model_download(name=name, repo=path)


def _is_directory(path: str) -> bool:
    """Whether ``path`` names a directory here; a name the filesystem refuses (too long) names none."""
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def register_model(*, name: str, path: str) -> ModelArtifact:
    """Register the MoE checkpoint (any supported family) at ``path`` (a directory on this host)."""
    resolved, summary, total = _describe(path)
    try:
        with transaction.atomic():
            return ModelArtifact.objects.create(name=name, path=resolved, summary=summary, total_bytes=total)
    except IntegrityError:
        raise ModelError(f"a model named {name!r} is already registered") from None


def _describe(path: str) -> tuple[str, dict, int]:
    """The checkpoint's resolved path, shape summary and size; ModelError if it is not a usable one."""
    try:
        checkpoint = Checkpoint(Path(path))
        config = checkpoint.config
        summary = {
            "layers": checkpoint.n_layers,
            "experts": checkpoint.n_experts,
            "top_k": checkpoint.top_k,
            "hidden_size": checkpoint.hidden_size,
            "family": checkpoint.family.model_type,
            "intermediate_size": checkpoint.family.expert_intermediate(config),  # a routed expert's
            "vocab_size": config.get("vocab_size"),
            "max_position_embeddings": config.get("max_position_embeddings"),
            "files": len(checkpoint.files()),
        }
        total = sum(checkpoint.nbytes(key) for key in checkpoint)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None
    return str(checkpoint.path.resolve()), summary, total


def parse_repo_id(text: str) -> tuple[str, str]:
    """``owner/name[@revision]`` split into (repo id, revision or ""); ModelError if it is not one."""
    match = REPO_ID.match(text)
    if match is None or ".." in text or "--" in match["repo"]:
        raise ModelError(
            f"{text!r} is neither a checkpoint directory on this server nor a Hugging Face repo id "
            "(owner/name, optionally @revision)"
        )
    return match["repo"], match["revision"] or ""


def models_dir() -> Path:
    return Path(settings.MODELS_DIR) if settings.MODELS_DIR else Path(settings.VAR_DIR) / "models"


def request_model_download(*, name: str, repo: str) -> ModelArtifact:
    """Register ``repo`` (``owner/name[@revision]``) by downloading it first, in the background.

    The model is listed at once as *downloading*; it turns *ready* once downloaded and read,
    or *failed* with the reason. Asking again for a failed download of the same repo retries
    it, from where it stopped.
    """
    repo_id, revision = parse_repo_id(repo)
    target = models_dir() / repo_id.replace("/", "--") / (revision or "main").replace("/", "--")
    with transaction.atomic():
        artifact = ModelArtifact.objects.select_for_update().filter(name=name).first()
        if artifact is None:
            try:
                with transaction.atomic():
                    artifact = ModelArtifact.objects.create(
                        name=name, path=str(target), repo_id=repo_id, revision=revision
                    )
            except IntegrityError:
                raise ModelError(f"a model named {name!r} is already registered") from None
        elif not (
            artifact.status == ModelStatus.FAILED and (artifact.repo_id, artifact.revision) == (repo_id, revision)
        ):
            raise ModelError(f"a model named {name!r} is already registered")
        artifact.status = ModelStatus.DOWNLOADING
        artifact.error = ""
        artifact.download_done_bytes = artifact.download_total_bytes = 0
        artifact.save()
        transaction.on_commit(lambda: queue_task(DOWNLOAD_MODEL_TASK, artifact.pk))
    return artifact


def download_model(*, artifact_id: int) -> ModelArtifact:
    """Download the artifact's Hub repo into its folder (resuming a partial one), then register it.

    Slow: run it from a background task. Progress is saved as it goes, like a shard build's;
    a failure is recorded on the artifact with its reason, and raised.
    """
    from huggingface_hub import snapshot_download

    artifact = ModelArtifact.objects.get(pk=artifact_id)
    label = f"{artifact.repo_id}@{artifact.revision}" if artifact.revision else artifact.repo_id
    ModelArtifact.objects.filter(pk=artifact.pk).update(status=ModelStatus.DOWNLOADING, error="")
    try:
        Path(artifact.path).mkdir(parents=True, exist_ok=True)
        options = dict(revision=artifact.revision or None, local_dir=artifact.path, allow_patterns=HUB_PATTERNS)
        plan = snapshot_download(artifact.repo_id, dry_run=True, **options)
        total = sum(f.file_size or 0 for f in plan)
        already = sum(f.file_size or 0 for f in plan if not f.will_download)
        ModelArtifact.objects.filter(pk=artifact.pk).update(download_done_bytes=already, download_total_bytes=total)
        snapshot_download(artifact.repo_id, tqdm_class=_progress_bar(artifact.pk, already, total), **options)
    except Exception as exc:  # every way a download fails ends the same: recorded, with the reason
        raise _failed(artifact, f"cannot download {label} from the Hugging Face Hub: {_hub_reason(exc)}") from None
    try:
        path, summary, size = _describe(artifact.path)
    except ModelError as exc:
        raise _failed(artifact, f"downloaded {label}, but it cannot be served: {exc}") from None
    ModelArtifact.objects.filter(pk=artifact.pk).update(
        status=ModelStatus.READY, path=path, summary=summary, total_bytes=size, download_done_bytes=total
    )
    artifact.refresh_from_db()
    return artifact


def _failed(artifact: ModelArtifact, message: str) -> ModelError:
    """Record a failed download on the artifact; the error to raise."""
    ModelArtifact.objects.filter(pk=artifact.pk).update(status=ModelStatus.FAILED, error=message)
    return ModelError(message)


def _hub_reason(exc: Exception) -> str:
    """Why a Hub download failed, in one line, with what to do about it."""
    from huggingface_hub.errors import DryRunError, GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    # The dry run (the listing of what to fetch) wraps what went wrong on the way.
    root = exc.__cause__ if isinstance(exc, DryRunError) and exc.__cause__ is not None else exc
    first_line = (str(root).strip().splitlines() or [type(root).__name__])[0].rstrip(".")
    if isinstance(root, GatedRepoError):
        return f"the repo is gated: accept its terms on huggingface.co and set HF_TOKEN on the server ({first_line})"
    if isinstance(root, RepositoryNotFoundError | RevisionNotFoundError):
        return f"no such repo or revision (a private repo needs HF_TOKEN on the server): {first_line}"
    if _unreachable(root) or _unreachable(root.__cause__):
        return f"{first_line}; {NO_ROUTE_HINT}"
    return first_line


def _unreachable(exc: BaseException | None) -> bool:
    """True when the hub could not be reached at all (offline mode, no route, no name, a timeout)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if exc is None:
        return False
    # OfflineModeIsEnabled is a ConnectionError; httpx's connect and timeout errors are not OSErrors.
    return isinstance(exc, ConnectionError | TimeoutError | LocalEntryNotFoundError) or type(exc).__module__.startswith(
        ("httpx", "httpcore")
    )


def _progress_bar(artifact_id: int, already: int, total: int) -> type:
    """A tqdm class for ``snapshot_download`` that saves the bytes written to the artifact's row."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    last_write = 0.0
    owner = threading.get_ident()

    class Progress(hub_tqdm):
        def __init__(self, *args, **kwargs) -> None:
            # The byte bar of the whole snapshot; the others count files or network bytes.
            self.counts = kwargs.get("name") == "huggingface_hub.snapshot_download"
            kwargs.update(disable=False, file=_Nowhere())
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            nonlocal last_write
            shown = super().update(n)
            now = time.monotonic()
            if self.counts and now - last_write >= PROGRESS_EVERY_S:
                done = min(total, already + int(self.n))
                ModelArtifact.objects.filter(pk=artifact_id).update(download_done_bytes=done)
                last_write = now
                if threading.get_ident() != owner:  # a download thread: leave no connection behind it
                    connection.close()
            return shown

    return Progress


class _Nowhere:
    """A file that drops what a progress bar draws (the Celery log is no terminal)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def request_shard_build(*, artifact: ModelArtifact, workers: int, expert_codec: str = "none") -> ModelArtifact:
    """Queue a shard build for ``workers`` workers with ``expert_codec``; it starts once this transaction commits."""
    if workers < 1:
        raise ModelError(f"at least one worker is needed, got {workers}")
    check_codec(expert_codec)
    with transaction.atomic():
        locked = ModelArtifact.objects.select_for_update().get(pk=artifact.pk)
        check_registered(locked)
        if locked.shard_status == ShardStatus.BUILDING:
            raise ModelError(f"shards of {locked.name} are already being built; wait for that build to end")
        locked.shard_status = ShardStatus.BUILDING
        locked.shard_workers = workers
        locked.shard_expert_codec = expert_codec
        locked.shard_done_bytes = locked.shard_total_bytes = 0
        locked.shard_error = ""
        locked.save()
        transaction.on_commit(lambda: queue_task(BUILD_MODEL_SHARDS_TASK, locked.pk, workers, expert_codec))
    return locked


def check_registered(artifact: ModelArtifact) -> None:
    """Refuse to shard (or deploy) a model whose download has not finished well."""
    if artifact.status == ModelStatus.DOWNLOADING:
        raise ModelError(f"{artifact.name} is still downloading from the Hugging Face Hub; wait for it")
    if artifact.status == ModelStatus.FAILED:
        raise ModelError(f"{artifact.name} could not be registered: {artifact.error}")


def check_codec(expert_codec: str) -> None:
    """Refuse an expert codec the shard build does not know, naming those it does."""
    if expert_codec not in EXPERT_CODECS:
        raise ModelError(f"unknown expert codec {expert_codec!r}; allowed: {', '.join(EXPERT_CODECS)}")


def shard_set_name(workers: int, expert_codec: str = "none") -> str:
    """The folder of the shard set for ``workers`` workers whose worker shards store experts with ``expert_codec``.

    An uncoded set keeps the name it always had (``workers-N``), so sets built before codecs are reused.
    """
    return f"workers-{workers}" if expert_codec == "none" else f"workers-{workers}-{expert_codec}"


def shard_dir_for(artifact: ModelArtifact, workers: int, expert_codec: str = "none") -> Path:
    return _sets_dir(artifact) / shard_set_name(workers, expert_codec)


def _sets_dir(artifact: ModelArtifact) -> Path:
    """The folder of every shard set of ``artifact``, one folder a set."""
    return Path(settings.VAR_DIR) / "shards" / str(artifact.pk)


def built_set(out: Path, *, workers: int, expert_codec: str) -> ShardSet | None:
    """The complete shard set at ``out`` if it is one for ``workers`` workers and ``expert_codec``, else None.

    ``shards.json`` is written last, so a folder without it is an interrupted build.
    """
    if not (out / SET_FILE).is_file():
        return None
    try:
        found = ShardSet.load(out)
    except (OSError, ValueError, KeyError, TypeError, ShardError):
        return None
    return found if (found.placement.n_workers, found.expert_codec) == (workers, expert_codec) else None


def build_model_shards(
    *, artifact_id: int, workers: int, shadow_dtypes: Sequence[str] = (), expert_codec: str = "none"
) -> ModelArtifact:
    """Build the role shards for ``workers`` workers with ``expert_codec``, saving progress as it goes.

    ``shadow_dtypes`` get their shadow shard pre-converted (``shadow-<dtype>``): a set already
    built for ``workers`` and ``expert_codec`` (its own folder, ``shard_dir_for``) is reused and
    only gets the ones it lacks, nothing else is rebuilt. Slow (it reads and hashes the whole
    model): run it from a background task. A failure is recorded on the artifact with its
    reason, and raised.
    """
    if workers < 1:
        raise ModelError(f"at least one worker is needed, got {workers}")
    check_codec(expert_codec)
    artifact = ModelArtifact.objects.get(pk=artifact_id)
    check_registered(artifact)
    out = shard_dir_for(artifact, workers, expert_codec)
    with _build_lock(out):  # one build per shard set at a time; a second one finds the first's work done
        artifact.refresh_from_db()
        # A set already built for these workers and codec is reused: it only gets the shadows it
        # lacks, and is READY (and served to agents) meanwhile: converting a shadow of a 93 GB
        # model takes a while.
        existing = built_set(out, workers=workers, expert_codec=expert_codec)
        # Main's extras (the prerouter, the similarity table) made again since: the set is rebuilt.
        extend = existing is not None and main_extras_current(artifact, out)
        kept = list(existing.shadow_dtypes) if existing is not None and extend else []
        fields = dict(
            shard_done_bytes=0,
            shard_total_bytes=0,
            shard_error="",
            shard_workers=workers,
            shard_dir=str(out),
            shard_expert_codec=expert_codec,
        )
        if extend:
            fields |= dict(shard_status=ShardStatus.READY, shard_shadow_dtypes=kept)
        else:
            fields |= dict(shard_status=ShardStatus.BUILDING, shard_shadow_dtypes=[])
        ModelArtifact.objects.filter(pk=artifact.pk).update(**fields)
        last_write = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal last_write
            now = time.monotonic()
            if now - last_write >= PROGRESS_EVERY_S or done >= total:
                ModelArtifact.objects.filter(pk=artifact.pk).update(shard_done_bytes=done, shard_total_bytes=total)
                last_write = now

        try:
            if extend:
                built = add_shadow_shards(artifact.path, out, shadow_dtypes, progress=progress)
            else:
                built = build_shards(
                    artifact.path,
                    out,
                    workers=workers,
                    progress=progress,
                    shadow_dtypes=shadow_dtypes,
                    expert_codec=expert_codec,
                )
        except (CheckpointError, ShardError, OSError, ValueError) as exc:
            failed = dict(shard_error=str(exc)) | ({} if extend else dict(shard_status=ShardStatus.FAILED))
            ModelArtifact.objects.filter(pk=artifact.pk).update(**failed)
            raise ModelError(f"building shards of {artifact.name} failed: {exc}") from None
        ModelArtifact.objects.filter(pk=artifact.pk).update(
            shard_status=ShardStatus.READY, shard_shadow_dtypes=list(built.shadow_dtypes)
        )
    artifact.refresh_from_db()
    return artifact


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """An exclusive lock on the shard set ``out`` (a file beside it), held for a whole build."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shards_ready_for(
    artifact: ModelArtifact, *, workers: int, shadow_dtype: str, shadow: bool = True, expert_codec: str = "none"
) -> bool:
    """Whether the built set serves ``workers`` workers with experts stored by ``expert_codec`` and a
    ``shadow_dtype`` shadow as it should (any shadow dtype will do for a deployment without a
    shadow seat: ``shadow`` false), and carries in main's shard what the model has beside its
    weights (``MAIN_EXTRAS``: the expert similarity table, the prerouter)."""
    if not (
        artifact.shard_status == ShardStatus.READY
        and artifact.shard_workers == workers
        and artifact.shard_expert_codec == expert_codec
        and Path(artifact.shard_dir).is_dir()
    ):
        return False
    if not main_extras_current(artifact, Path(artifact.shard_dir)):
        return False
    if not shadow:
        return True
    return set(needed_shadow_dtypes(artifact, shadow_dtype)) <= set(artifact.shard_shadow_dtypes or [])


def main_extras_current(artifact: ModelArtifact, shard_dir: Path) -> bool:
    """Whether main's shard in ``shard_dir`` carries each of the model's ``MAIN_EXTRAS`` as it is now."""
    for extra in MAIN_EXTRAS:
        made, carried = Path(artifact.path) / extra, shard_dir / "main" / extra
        if made.is_file() and not (carried.is_file() and filecmp.cmp(made, carried, shallow=False)):
            return False  # made (or made again) after the shards were built: main's shard must carry it
    return True


def needed_shadow_dtypes(artifact: ModelArtifact, shadow_dtype: str) -> tuple[str, ...]:
    """The pre-converted shadow shard a ``shadow_dtype`` deployment of ``artifact`` downloads."""
    try:
        config = Checkpoint(artifact.path).config
    except CheckpointError as exc:
        raise ModelError(f"cannot read {artifact.name}: {exc}") from None
    return shadow_dtypes_to_build(config, shadow_dtype)


def shadow_shard_name(artifact: ModelArtifact, shadow_dtype: str, shard_dir: Path | None = None) -> str:
    """The shard a ``shadow_dtype`` shadow fetches: its pre-converted one if built, else the full one.

    ``shard_dir``: the set the shadow is served from, when it may be another than the one the
    artifact's columns describe (built last).
    """
    built = artifact.shard_shadow_dtypes or []
    if shard_dir is not None and shard_dir != Path(artifact.shard_dir):
        # Not built (yet): the columns' answer.
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ShardError):
            built = list(ShardSet.load(shard_dir).shadow_dtypes)
    return f"shadow-{shadow_dtype}" if shadow_dtype in built else "shadow"


def served_shard_dir(artifact: ModelArtifact, shard_set: object) -> Path | None:
    """The folder of the shard set ``shard_set`` (a name a start_role task gave, ``shard_set_name``) of
    ``artifact`` if it is built; else, for a task that named none (sent before sets had names),
    the set the artifact's columns describe if ready. None when there is nothing to serve."""
    if shard_set is None:
        ready = artifact.shard_status == ShardStatus.READY and artifact.shard_dir
        return Path(artifact.shard_dir) if ready else None
    if not (isinstance(shard_set, str) and SHARD_SET_NAME.fullmatch(shard_set)):
        return None
    root = _sets_dir(artifact) / shard_set
    return root if (root / SET_FILE).is_file() else None
