"""How a benchmark runs its cluster's roles: as processes (what it measures), or with
``--in-process`` as threads of the benchmark's own process, a quick check that the benchmark
runs and its outputs are exact (what the test suite does). Timings of such a run are not the
cluster's: every role shares one interpreter, so its JSON says ``"roles": "threads"`` and the
docs' renderer refuses it as a source of figures."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from benchmarks import provenance

if TYPE_CHECKING:
    from inference.tools.emulation import Emulation

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


def write_emulated(
    args: argparse.Namespace, emulation: Emulation, figures: dict, begun: dict, depends_on: tuple[str, ...]
) -> None:
    """A run on an emulated cluster, written at ``args.json`` when it was given: how its roles ran,
    the hardware profile it emulated (``emulation``: the figures it took from it) and its workers,
    then the benchmark's ``figures``, with the provenance of the run ``begun`` and the versions of
    Torch and Transformers, whose arithmetic the cluster runs (``provenance.write``)."""
    if not args.json:
        return
    cluster = {
        "roles": kind(args),
        "profile": args.profile,
        "emulation": emulation.as_dict(),
        "workers": args.workers,
    }
    provenance.write(args.json, cluster | figures, begun, "torch", "transformers", depends_on=depends_on)
