"""``python -m inference``: make a tiny model, shard a checkpoint, generate, serve a role."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from inference.constants import EXPERT_CODECS, SHADOW_DTYPES
from inference.modelio.families import FAMILIES
from inference.setting_flags import add_setting_flags, settings_of
from inference.settings import DEFAULTS

# Each command imports what it runs inside its own function: torch, Transformers and a role's
# whole stack load only for the command that needs them, so `--help` and each role start light.

EXIT_ERROR = 1
# The runtime settings ``generate`` takes, each an option derived from its declaration
# (``inference.setting_flags``: ``--max-batch`` for ``max_batch``).
GENERATE_SETTINGS = (
    "shadow_dtype",
    "strategy",
    "predictor",
    "cache_experts",
    "max_resident_experts",
    "hybrid",
    "importance_threshold",
    "token_period",
    "kv_period",
    "speculate",
    "prefill_chunk",
    "prefill_step",
    "expert_store",
    "hot_experts",
    "expert_codec",
    "device",
    "dtype",
    "timeout_s",
)
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _user_errors() -> tuple[type[BaseException], ...]:
    from inference.modelio.checkpoint import CheckpointError
    from inference.modelio.shards import ShardError
    from inference.runtime.launcher import ClusterError
    from inference.runtime.spec import SpecError

    return (CheckpointError, ClusterError, ShardError, SpecError, ValueError, FileNotFoundError)  # CorpusError is one


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for add in (
        _add_make_tiny,
        _add_shard,
        _add_calibrate,
        _add_generate,
        _add_train_demo,
        _add_train_prerouter,
        _add_serve_role,
    ):
        add(sub)
    return parser


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    """``make-tiny``: a small random MoE checkpoint."""
    tiny = sub.add_parser("make-tiny", help="write a small random MoE checkpoint (with a tokenizer)")
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    for name, default in (
        ("layers", 4),
        ("hidden", 64),
        ("intermediate", 128),
        ("experts", 8),
        ("top-k", 2),
        ("heads", 4),
        ("kv-heads", 2),
        ("shards", 1),
    ):
        tiny.add_argument(f"--{name}", type=int, default=default)
    tiny.add_argument("--head-dim", type=int, default=None)
    tiny.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="dtype on disk")
    tiny.add_argument("--family", choices=tuple(FAMILIES), default="mixtral", help="the release layout to write")
    tiny.add_argument(
        "--shared-intermediate", type=int, default=None, help="qwen2_moe: the shared expert's width (default 2x)"
    )
    tiny.add_argument(
        "--mixtral-dims",
        type=int,
        metavar="LAYERS",
        help="this many layers at Mixtral-8x7B's sizes in bf16 (2.9 GB a layer); overrides the shape options",
    )
    tiny.set_defaults(run=_make_tiny)


def _add_shard(sub: argparse._SubParsersAction) -> None:
    """``shard``: a checkpoint split into role shards."""
    shard = sub.add_parser("shard", help="split a checkpoint into main, shadow and worker shards")
    shard.add_argument("model_dir", type=Path)
    shard.add_argument("out_dir", type=Path)
    shard.add_argument("--workers", type=int, required=True)
    shard.add_argument("--max-file-mb", type=int, default=2048, help="largest weights file to write (MiB)")
    shard.add_argument(
        "--shadow-dtypes",
        type=_dtype_list,
        default=(),
        help="also write the shadow pre-converted to these dtypes, comma-separated (e.g. nf4,int8): shadow-<dtype>/",
    )
    shard.add_argument(
        "--expert-codec",
        choices=EXPERT_CODECS,
        default=DEFAULTS.expert_codec,
        help="how worker shards store their experts: none, or exponent-plane (lossless, fewer bytes)",
    )
    shard.set_defaults(run=_shard)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    """``calibrate``: the importance strategy's similarity table."""
    cal = sub.add_parser(
        "calibrate", help="compute the experts' similarity table the importance strategy needs (beside the weights)"
    )
    cal.add_argument("model_dir", type=Path)
    cal.add_argument("--text", type=Path, help="a UTF-8 text file to calibrate on (default: the demo's corpus)")
    cal.add_argument("--corpus", type=Path, help="a folder of HTML pages (default: Debian's python3.11-doc)")
    cal.add_argument("--tokens", type=int, default=2048, help="calibration tokens (the first of the text)")
    cal.set_defaults(run=_calibrate)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    """``generate``: a local cluster on 127.0.0.1, one generation."""
    gen = sub.add_parser("generate", help="run main, shadow and N workers on 127.0.0.1 and generate")
    gen.add_argument(
        "--model",
        type=Path,
        required=True,
        help="a Hugging Face MoE checkpoint directory (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE)",
    )
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--workers", type=int, default=8)
    gen.add_argument("--no-shadow", action="store_true", help="same as --strategy reactive")
    add_setting_flags(gen, GENERATE_SETTINGS)
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and metrics")
    gen.set_defaults(run=_generate)


def _add_train_demo(sub: argparse._SubParsersAction) -> None:
    """``train-demo``: the demo model trained again."""
    train = sub.add_parser("train-demo", help="train the demo model on Python's HTML documentation")
    train.add_argument("out_dir", type=Path)
    train.add_argument(
        "--corpus",
        type=Path,
        default=Path("/usr/share/doc/python3.11/html"),
        help="a folder of HTML pages (default: Debian's python3.11-doc)",
    )
    train.add_argument("--steps", type=int, default=1500)
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(run=_train_demo)


def _add_train_prerouter(sub: argparse._SubParsersAction) -> None:
    """``train-prerouter``: the prerouter strategy's heads and LoRA."""
    pre = sub.add_parser(
        "train-prerouter",
        help="train the prerouter strategy's heads and recovery LoRA (written beside the weights)",
    )
    pre.add_argument("model_dir", type=Path)
    pre.add_argument("--text", type=Path, help="a UTF-8 text file to train on (default: the demo's corpus)")
    pre.add_argument("--corpus", type=Path, help="a folder of HTML pages (default: Debian's python3.11-doc)")
    pre.add_argument("--head-steps", type=int, help="phase 1 steps (default: the recipe's, 1000)")
    pre.add_argument("--lora-steps", type=int, help="phase 2 steps (default: the recipe's, 1500)")
    pre.add_argument("--eval-tokens", type=int, help="held-out tokens scored (default: the recipe's, 16384)")
    pre.add_argument("--seed", type=int, default=0)
    pre.set_defaults(run=_train_prerouter)


def _add_serve_role(sub: argparse._SubParsersAction) -> None:
    """``serve-role``: one role from its spec file."""
    role = sub.add_parser("serve-role", help="run one role from a spec file (what an agent launches)")
    role.add_argument("--role", choices=("main", "shadow", "worker"), required=True)
    role.add_argument("--spec", type=Path, required=True)
    role.set_defaults(run=_serve_role)


def _make_tiny(args: argparse.Namespace) -> int:
    from inference.tools.tiny import make_tiny, mixtral_dims

    if args.mixtral_dims is not None:
        out = make_tiny(args.out_dir, seed=args.seed, **mixtral_dims(args.mixtral_dims))
        print(f"wrote a {args.mixtral_dims}-layer checkpoint at Mixtral-8x7B's sizes to {out}")
        return 0
    out = make_tiny(
        args.out_dir,
        seed=args.seed,
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        experts=args.experts,
        top_k=args.top_k,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        shards=args.shards,
        dtype=args.dtype,
        family=args.family,
        shared_intermediate=args.shared_intermediate,
    )
    print(f"wrote a tiny {args.family} checkpoint to {out}")
    return 0


def _dtype_list(text: str) -> tuple[str, ...]:
    dtypes = tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in dtypes if d not in SHADOW_DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shadow dtype {unknown[0]!r}; allowed: {', '.join(SHADOW_DTYPES)}")
    return dtypes


def _calibrate(args: argparse.Namespace) -> int:
    from inference.runtime.importance import write_similarity
    from inference.runtime.textstream import load_tokenizer
    from inference.tools.calibration import calibrate
    from inference.tools.train_demo import DEFAULT_CORPUS, corpus_texts

    if args.tokens < 2:
        raise ValueError("--tokens must be >= 2")
    tokenizer = load_tokenizer(args.model_dir)
    if tokenizer is None:
        raise ValueError(f"{args.model_dir} has no tokenizer to read the calibration text with")
    texts = [args.text.read_text(encoding="utf-8")] if args.text else corpus_texts(args.corpus or DEFAULT_CORPUS)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= args.tokens:
            break
    ids = ids[: args.tokens]
    if len(ids) < 2:
        raise ValueError("the calibration text has fewer than 2 tokens")
    print(f"calibrating on {len(ids)} tokens", file=sys.stderr)
    path = write_similarity(args.model_dir, calibrate(args.model_dir, ids), len(ids))
    print(f"wrote {path}; shard the model again to carry it into main's shard")
    return 0


def _shard(args: argparse.Namespace) -> int:
    from inference.building.sharding import build_shards

    def progress(done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        print(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done / 2**20:8.1f} / {total / 2**20:.1f} MiB",
            end="",
            file=sys.stderr,
            flush=True,
        )

    shard_set = build_shards(
        args.model_dir,
        args.out_dir,
        workers=args.workers,
        max_file_bytes=args.max_file_mb * 2**20,
        progress=progress,
        shadow_dtypes=args.shadow_dtypes,
        expert_codec=args.expert_codec,
    )
    print(file=sys.stderr)
    shadows = "".join(f", shadow-{d}" for d in shard_set.shadow_dtypes)
    print(f"wrote shards for main, shadow{shadows} and {args.workers} workers to {shard_set.root}")
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def _generate(args: argparse.Namespace) -> int:
    from inference.modelio.checkpoint import Checkpoint
    from inference.policies.alignment import validate_periods
    from inference.runtime.launcher import ClusterOptions, LocalCluster
    from inference.runtime.spec import DeploymentSettings, validate_settings
    from inference.runtime.textstream import TextStream, load_tokenizer

    validate_periods(args.token_period, args.kv_period)
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    Checkpoint(args.model)  # a bad model dir is reported before anything starts
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer; pass --prompt-ids instead of --prompt")
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    else:
        prompt_ids = _parse_ids(args.prompt_ids)
    values = settings_of(args, GENERATE_SETTINGS)
    values["strategy"] = "reactive" if args.no_shadow else args.strategy
    settings = DeploymentSettings(**values)
    validate_settings(settings)
    options = ClusterOptions(workers=args.workers, settings=settings)
    say = (lambda line: print(line, file=sys.stderr)) if not args.json else (lambda line: None)
    stream = TextStream(tokenizer, sys.stdout if not args.json else None)
    with LocalCluster(args.model, options, progress=say) as cluster:
        say("cluster ready; generating")
        # Keyword-argument call whose names line up with make_tiny(...)'s above: a different call.
        done = cluster.generate(
            prompt_ids,
            args.max_new_tokens,
            on_token=stream.add,
            do_sample=args.sample,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
    stream.finish()
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": done.token_ids,
                    "text": stream.text(done.token_ids),
                    "finish_reason": done.finish_reason,
                    "metrics": done.metrics,
                }
            )
        )
    else:
        m = done.metrics
        recall = "n/a" if m["recall"] is None else f"{m['recall']:.1%}"
        peak = max(m["worker_peak_expert_bytes"].values(), default=0)
        say(
            f"\n{len(done.token_ids)} tokens; TTFT {m['ttft_ms']:.0f} ms; "
            f"decode {m['decode_tok_s']:.1f} tok/s; recall {recall}; peak expert bytes per worker {peak}"
        )
    return 0


def _train_demo(args: argparse.Namespace) -> int:
    from inference.tools.train_demo import Recipe, train_demo

    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    train_demo(args.out_dir, args.corpus, recipe=Recipe(steps=args.steps, seed=args.seed))
    return 0


def _train_prerouter(args: argparse.Namespace) -> int:
    import dataclasses

    from inference.modelio.checkpoint import Checkpoint
    from inference.runtime.textstream import load_tokenizer
    from inference.tools.train_demo import DEFAULT_CORPUS, _token_stream, corpus_texts
    from inference.tools.train_prerouter import PrerouterRecipe, train_prerouter

    given = {k: v for k in ("head_steps", "lora_steps", "eval_tokens", "seed") if (v := getattr(args, k)) is not None}
    if given.get("head_steps", 0) < 0 or given.get("lora_steps", 0) < 0 or given.get("eval_tokens", 2) < 2:
        raise ValueError("--head-steps and --lora-steps must be >= 0 and --eval-tokens >= 2")
    Checkpoint(args.model_dir)  # a bad model dir is reported before the text is read
    tokenizer = load_tokenizer(args.model_dir)
    if tokenizer is None:
        raise ValueError(f"{args.model_dir} has no tokenizer to read the training text with")
    texts = [args.text.read_text(encoding="utf-8")] if args.text else corpus_texts(args.corpus or DEFAULT_CORPUS)
    recipe = dataclasses.replace(PrerouterRecipe(), **given)
    train_prerouter(args.model_dir, _token_stream(tokenizer, texts), recipe)
    return 0


def _serve_role(args: argparse.Namespace) -> int:
    from inference.runtime.spec import SpecError, load_spec

    spec = load_spec(args.spec)
    if spec.role != args.role:
        raise SpecError(f"--role {args.role} but the spec is for role {spec.role}")
    from inference.runtime.roles.common import setup_process
    from inference.runtime.roles.dispatch import serve_role

    setup_process(spec)
    serve_role(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
