"""lm-evaluation-harness, a client nobody here wrote, against ``manage.py up`` (issue 40).

``manage.py up`` serves the demo model on three local agents, as ``make run`` does; ``lm_eval``'s
own command line runs two small tasks shipped in ``tests/lm_eval_tasks/`` (local JSONL files,
offline) against it: a multiple-choice log-likelihood task through ``local-completions``
(token-id prompts, ``echo``, ``logprobs``, the demo model's tokenizer from its directory) and a
generation task through ``local-chat-completions`` with ``--apply_chat_template``. The command
lines are the ones the docs give (docs/using/openai-api.md).

Both must finish with their metrics, and the metrics must be ours: every log-likelihood the
harness computed equals the sum of our own ``/v1/completions`` echo logprobs over the same
continuation, its accuracy the one those sums give, and every answer it scored the answer our
``/v1/chat/completions`` gives to the same conversation.
"""

from __future__ import annotations

import json
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from controlplane.serving.tokenizer import TextTokenizer
from inference.runtime.launcher import free_port
from tests.controlplane.live import manage_py_up, up_env
from tests.paths import REPO

pytestmark = pytest.mark.slow
DEMO = REPO / "platform" / "demo-model"
TASKS = "tests/lm_eval_tasks"  # relative to the repository's root, as the tasks' data files are
MODEL = "demo"  # manage.py up's deployment


def lm_eval_argv(base_url: str, task: str) -> list[str]:
    """The command line the docs give for ``task`` against ``base_url`` (``http://HOST:PORT/v1``)."""
    if task == "odmoe_choice":
        model_args = f"base_url={base_url}/completions,model={MODEL},tokenizer={DEMO.relative_to(REPO)},"
        model_args += "tokenizer_backend=huggingface,max_length=1024"
        model = ["--model", "local-completions", "--model_args", model_args, "--batch_size", "4"]
    else:
        model_args = f"base_url={base_url}/chat/completions,model={MODEL}"
        model = ["--model", "local-chat-completions", "--model_args", model_args, "--apply_chat_template"]
    return ["lm_eval", "run", *model, "--tasks", task, "--include_path", TASKS]


def run_lm_eval(base_url: str, task: str, key: str, out: Path) -> tuple[dict, list[dict]]:
    """Run ``lm_eval`` on ``task``, offline; its results for the task and its logged samples."""
    env = {
        **os.environ,
        "OPENAI_API_KEY": key,  # local-completions sends it as "Authorization: Bearer KEY"
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(out / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    _, *args = lm_eval_argv(base_url, task)
    argv = [sys.executable, "-m", "lm_eval", *args, "--output_path", str(out), "--log_samples"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"lm_eval {task} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    (results,) = out.glob("*/results_*.json")
    (samples,) = out.glob(f"*/samples_{task}_*.jsonl")
    lines = samples.read_text().splitlines()
    return json.loads(results.read_text())["results"][task], sorted(map(json.loads, lines), key=lambda s: s["doc_id"])


def new_api_key(var: Path) -> str:
    """A key for ``manage.py up``'s admin, as its docs say: ``manage.py create_api_key``."""
    argv = [sys.executable, "manage.py", "create_api_key", "admin", "--name", "lm-eval"]
    done = subprocess.run(argv, cwd=REPO, env=up_env(var), capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.split()[-1]


def our_loglikelihood(client: openai.OpenAI, tokenizer: TextTokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context) from our ``/v1/completions`` echo logprobs, with the ids the
    harness sends (no BOS: its ``add_bos_token`` is false) from our own tokenizer."""
    ids = tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(tokenizer.encode(context, add_special_tokens=False))
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0, temperature=0)
    return sum(answer.choices[0].logprobs.token_logprobs[start:])


def normalized(text: str) -> str:
    """What the task's exact_match compares (odmoe_complete.yaml: whitespace at the ends, case, punctuation)."""
    text = re.sub(r"\s+$", "", re.sub(r"^\s+", "", text)).lower()
    return text.translate(str.maketrans("", "", string.punctuation))


def test_lm_evaluation_harness_finishes_both_tasks_against_manage_py_up_with_our_numbers(
    transactional_db, tmp_path: Path
) -> None:
    var, port = tmp_path / "var", free_port()
    with manage_py_up(var, port, DEMO, tmp_path / "up.log", agents=3):
        key = new_api_key(var)
        base_url = f"http://127.0.0.1:{port}/v1"
        choice, choice_samples = run_lm_eval(base_url, "odmoe_choice", key, tmp_path / "choice")
        complete, complete_samples = run_lm_eval(base_url, "odmoe_complete", key, tmp_path / "complete")

        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        tokenizer = TextTokenizer(DEMO)
        correct = []
        for sample in choice_samples:
            requests = sample["arguments"].values()
            theirs = [float(resp[0][0]) for resp in sample["resps"]]  # each [[loglikelihood, is_greedy]]
            ours = [our_loglikelihood(client, tokenizer, r["arg_0"], r["arg_1"]) for r in requests]
            assert theirs == pytest.approx(ours, abs=1e-6), sample["doc"]
            correct.append(ours.index(max(ours)) == sample["doc"]["answer"])
            assert sample["acc"] == float(correct[-1])
        assert len(correct) == 5 and choice["acc,none"] == pytest.approx(sum(correct) / len(correct))

        matches = []
        for sample in complete_samples:
            (answer,) = sample["resps"][0]
            messages = [{"role": "user", "content": sample["doc"]["prompt"]}]
            ask = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, stop=["."])
            ours = client.chat.completions.create(**ask)
            assert answer == ours.choices[0].message.content, sample["doc"]
            matches.append(normalized(answer) == normalized(sample["doc"]["answer"]))
            assert sample["exact_match"] == float(matches[-1])
        assert len(matches) == 5 and complete["exact_match,none"] == pytest.approx(sum(matches) / len(matches))
