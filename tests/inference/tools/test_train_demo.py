"""The demo-model trainer, on a few pages and a few steps: the checkpoint it writes is the model it trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.modelio.checkpoint import Checkpoint
from inference.tools.train_demo import CorpusError, Recipe, Shape, corpus_texts, train_demo

PAGE = """<html><head><title>t</title><script>var x = 1;</script></head><body><nav>menu</nav>
<h1>Built-in Types</h1><p>{body}</p></body></html>"""


def write_corpus(folder: Path) -> Path:
    folder.mkdir()
    for i, topic in enumerate(
        ["lists hold items in order", "dictionaries map keys to values", "sets keep unique items"]
    ):
        body = " ".join([f"In Python, {topic}. The section {i} explains how and why."] * 20)
        (folder / f"page{i}.html").write_text(PAGE.format(body=body))
    return folder


def test_text_comes_from_the_body_without_scripts_or_navigation(tmp_path: Path) -> None:
    texts = corpus_texts(write_corpus(tmp_path / "html"))
    assert len(texts) == 3 and texts[0].startswith("Built-in Types")
    assert all("var x" not in t and "menu" not in t for t in texts)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"python3\.11-doc"):
        corpus_texts(tmp_path / "empty")


def test_a_short_run_writes_a_checkpoint_that_reproduces_the_trained_model(tmp_path: Path) -> None:
    shape = Shape(layers=2, hidden=32, intermediate=48, experts=4, top_k=2, heads=2, kv_heads=1, vocab=300)
    record = train_demo(
        tmp_path / "model",
        write_corpus(tmp_path / "html"),
        shape=shape,
        recipe=Recipe(steps=3, batch=2, seq=16, warmup=1),
        say=lambda line: None,
    )
    checkpoint = Checkpoint(tmp_path / "model")
    assert checkpoint.n_experts == 4 and checkpoint.top_k == 2 and checkpoint.n_layers == 2
    saved = json.loads((tmp_path / "model" / "training.json").read_text())
    assert saved["recipe"]["steps"] == 3 and saved["corpus"]["pages"] == 3 and record["parameters"] > 0
    assert 0 < saved["router_top_k_mass"] <= 1
