"""Several clients streaming from one local cluster at once, each on its own thread (tests and benchmarks)."""

from __future__ import annotations

import threading
import time

from inference.runtime.client import GenerationError, RuntimeClient
from inference.runtime.launcher import LocalCluster
from inference.wire.generation import Done


def run_streams(
    cluster: LocalCluster,
    prompts: list[list[int]],
    new_tokens: list[int],
    *,
    stagger_s: float = 0.03,
    per_stream: list[dict] | None = None,
) -> list[Done | BaseException]:
    """Each prompt on its own client and thread, started ``stagger_s`` apart (``per_stream``: options)."""
    results: list[Done | BaseException] = [RuntimeError("did not run")] * len(prompts)

    def stream(i: int) -> None:
        client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        try:
            time.sleep(stagger_s * i)
            options = per_stream[i] if per_stream else {}
            results[i] = client.generate(prompts[i], new_tokens[i], timeout_s=180, **options)
        except (GenerationError, TimeoutError) as exc:
            results[i] = exc
        finally:
            client.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
