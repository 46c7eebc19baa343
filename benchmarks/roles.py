"""How a benchmark runs its cluster's roles: as processes (what it measures), or with
``--in-process`` as threads of the benchmark's own process, a quick check that the benchmark
runs and its outputs are exact (what the test suite does). Timings of such a run are not the
cluster's: every role shares one interpreter, so its JSON says ``"roles": "threads"`` and the
docs' renderer refuses it as a source of figures."""

from __future__ import annotations

import argparse

PROCESSES = "processes"
THREADS = "threads"


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the roles as threads of this process: a check of the benchmark, not a measurement",
    )


def kind(args: argparse.Namespace) -> str:
    """What the run's JSON records under ``roles``."""
    return THREADS if args.in_process else PROCESSES
