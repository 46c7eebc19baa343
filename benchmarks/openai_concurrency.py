"""Several prompts at once through a running platform's OpenAI API, against one after another.

    python manage.py up   # another terminal: the demo cluster
    python -m benchmarks.openai_concurrency --api-key "$(python manage.py create_api_key admin)" \\
        [--base-url http://127.0.0.1:8000/v1] [--model demo] [--prompts 8] [--max-tokens 32] \\
        [--repeats 3] [--json OUT]

With the official ``openai`` client: ``--prompts`` different prompts sent one after another
(each waits for the last answer), then the same prompts sent at the same moment from as
many threads; the wall time of each, and their ratio (together ÷ one after another), for
``--repeats`` rounds, reported as medians with their spread. Greedy answers, so every
answer sent together is checked to be the answer the same prompt got alone. One user sends
them all: main runs 8 at once by default (``max_batch``) and queues the rest, up to the
deployment's ``max_per_user`` (32 by default) of one user's running and waiting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

from benchmarks import provenance, substance

# What its figures depend on beyond its own imports: the control plane, agents and roles it serves through
# (benchmarks.substance).
DEPENDS_ON = substance.PLATFORM

PROMPTS = [
    "How do I read a file line by line?",
    "What does the with statement do?",
    "Explain list comprehensions.",
    "How are exceptions raised and caught?",
    "What is a generator?",
    "How do I format a string?",
    "What does the import system do?",
    "How do I sort a dictionary by value?",
    "What is a decorator?",
    "How do threads share data?",
    "What is the difference between a list and a tuple?",
    "How do I open a socket?",
    "What does asyncio do?",
    "How do I parse JSON?",
    "What is a context manager?",
    "How do I compare two floats?",
]


def ask(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    return answer.choices[0].message.content or ""


def one_round(client: openai.OpenAI, model: str, prompts: list[str], max_tokens: int) -> dict:
    started = time.perf_counter()
    alone = [ask(client, model, p, max_tokens) for p in prompts]
    sequential_s = time.perf_counter() - started

    together: list[str | BaseException] = [RuntimeError("did not run")] * len(prompts)

    def send(i: int, gate: threading.Barrier) -> None:
        gate.wait()
        try:
            together[i] = ask(client, model, prompts[i], max_tokens)
        except Exception as exc:  # reported below
            together[i] = exc

    gate = threading.Barrier(len(prompts) + 1)
    threads = [threading.Thread(target=send, args=(i, gate)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    gate.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    concurrent_s = time.perf_counter() - started
    failed = [r for r in together if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} requests sent together failed: {failed[0]}")
    return {
        "sequential_s": sequential_s,
        "concurrent_s": concurrent_s,
        "ratio": concurrent_s / sequential_s,
        "identical": together == alone,
    }


def main(argv: list[str] | None = None) -> int:
    # A benchmark's command line, alike faults.py's by shape: each script declares its own options.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", required=True, help="an API key with the inference scope")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    begun = provenance.begin()
    if not 1 <= args.prompts <= len(PROMPTS) or args.max_tokens < 1 or args.repeats < 1:
        parser.error(f"--prompts from 1 to {len(PROMPTS)}, --max-tokens >= 1 and --repeats >= 1")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600, max_retries=0)
    prompts = PROMPTS[: args.prompts]
    ask(client, args.model, prompts[0], 4)  # warm-up
    rounds = []
    for i in range(args.repeats):
        rounds.append(one_round(client, args.model, prompts, args.max_tokens))
        r = rounds[-1]
        print(
            f"  round {i + 1}: one after another {r['sequential_s']:.2f} s, together {r['concurrent_s']:.2f} s "
            f"({r['ratio']:.2f}), identical {r['identical']}",
            file=sys.stderr,
        )
    figures = {
        key: {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
        for key in ("sequential_s", "concurrent_s", "ratio")
        for values in [[r[key] for r in rounds]]
    }
    identical = all(r["identical"] for r in rounds)
    ratio = figures["ratio"]
    print(
        f"{args.prompts} prompts, {args.max_tokens} tokens each, through {args.base_url} ({args.model}): together "
        f"{figures['concurrent_s']['median']:.2f} s against {figures['sequential_s']['median']:.2f} s one after "
        f"another, ratio {ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f}) over {args.repeats} rounds; "
        f"every answer sent together identical to its answer alone: {identical}"
    )
    if args.json:
        provenance.write(
            args.json,
            {
                "base_url": args.base_url,
                "model": args.model,
                "prompts": args.prompts,
                "max_tokens": args.max_tokens,
                "identical": identical,
                **figures,
            },
            begun,
            "openai",
            depends_on=DEPENDS_ON,
        )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
