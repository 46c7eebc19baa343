"""Grammar libraries for constrained decoding, compared on the demo tokenizer.

    python -m benchmarks.grammars [--tokenizer platform/demo-model/tokenizer.json] [--json OUT]

xgrammar, llguidance and outlines-core each turn a JSON schema into a per-token mask over the
vocabulary. For each one installed (``pip install xgrammar llguidance outlines-core``; a
missing one is reported as missing), this measures, on the demo model's byte-level BPE
tokenizer (vocab 4096):

- ``compile_ms``: the time to compile a strict schema that uses every feature below (median
  of 5, each on a fresh compiler, so no cache helps);
- ``mask_us``: the time to compute one token's mask, then advance by a token drawn at random
  from the allowed ones (median and p90 over random walks that run until the document is
  complete, 5 seeds);
- ``installed_mb`` and ``requires``: its own install size and what it pulls in (the web
  process must not import torch; main has it);
- ``coverage``: for each feature a strict ``json_schema`` needs (nested objects, arrays,
  enums, ``maxLength``, ``maximum``/``minimum``, ``required``, ``additionalProperties: false``),
  whether the library compiles a schema that uses it, accepts a document that keeps it and
  refuses one that breaks it (fed token by token, as decoding would).

The figures are one machine's, on a shared CPU; what decides is coverage first, then the
order of magnitude of the times, not small differences between them.
"""

from __future__ import annotations

import abc
import argparse
import importlib.metadata
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchmarks import provenance

# What its figures depend on beyond its own imports (benchmarks.substance): nothing, it runs in one process.
DEPENDS_ON: tuple[str, ...] = ()

DEMO_TOKENIZER = Path("platform/demo-model/tokenizer.json")

# The schema a strict json_schema request might send: every feature at once.
FULL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "tags", "address"],
    "additionalProperties": False,
}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or list(properties), **extra}


# feature: (schema, a document that keeps it, a document that breaks it)
COVERAGE: dict[str, tuple[dict[str, Any], str, str]] = {
    "nested objects": (_obj({"a": _obj({"b": {"type": "integer"}})}), '{"a":{"b":1}}', '{"a":1}'),
    "arrays": (_obj({"a": {"type": "array", "items": {"type": "integer"}}}), '{"a":[1,2]}', '{"a":["x"]}'),
    "enums": (_obj({"a": {"enum": ["red", "blue"]}}), '{"a":"red"}', '{"a":"green"}'),
    "maxLength": (_obj({"a": {"type": "string", "maxLength": 3}}), '{"a":"abc"}', '{"a":"abcd"}'),
    "maximum": (_obj({"a": {"type": "integer", "maximum": 50}}), '{"a":50}', '{"a":51}'),
    "minimum": (_obj({"a": {"type": "integer", "minimum": 10}}), '{"a":10}', '{"a":9}'),
    "number maximum": (_obj({"a": {"type": "number", "maximum": 1.5}}), '{"a":1.5}', '{"a":2.5}'),
    "required": (_obj({"a": {"type": "integer"}, "b": {"type": "integer"}}), '{"a":1,"b":2}', '{"a":1}'),
    "additionalProperties false": (
        _obj({"a": {"type": "integer"}}, additionalProperties=False),
        '{"a":1}',
        '{"a":1,"z":2}',
    ),
}


class Library(abc.ABC):
    """One library behind the few calls the comparison makes."""

    name = ""
    package = ""

    @abc.abstractmethod
    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None: ...

    @abc.abstractmethod
    def compile(self, schema: str) -> Any:
        """A fresh compilation of ``schema`` (nothing cached from an earlier one)."""
        ...

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> Any: ...

    @abc.abstractmethod
    def allowed(self, matcher: Any) -> list[int]:
        """The tokens the mask allows next (the mask is computed here)."""
        ...

    @abc.abstractmethod
    def advance(self, matcher: Any, token: int) -> bool:
        """Take ``token``; False when the grammar refuses it."""
        ...

    @abc.abstractmethod
    def complete(self, matcher: Any) -> bool: ...


class LLGuidance(Library):
    name = package = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.eos = eos

    def compile(self, schema: str) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)  # compiles here
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)

    def allowed(self, matcher: Any) -> list[int]:
        import numpy

        bias = matcher.compute_logit_bias()  # one byte per token: 200 allowed, 0 not
        return numpy.frombuffer(bias, dtype=numpy.uint8).nonzero()[0].tolist()

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    def complete(self, matcher: Any) -> bool:
        return matcher.is_accepting()


class XGrammar(Library):
    name = package = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token="</s>")
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.vocab = vocab

    def compile(self, schema: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(schema, strict_mode=True, any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab)

    def allowed(self, matcher: Any) -> list[int]:
        import torch

        m, bitmask = matcher
        m.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, self.vocab)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)
        return torch.nonzero(logits[0] == 0).view(-1).tolist()

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher[0].accept_token(token)

    def complete(self, matcher: Any) -> bool:
        return matcher[0].is_terminated() or matcher[0].accept_token(self.info.stop_token_ids[0])


class OutlinesCore(Library):
    name = "outlines-core"
    package = "outlines_core"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        # Byte-level BPE spells bytes as printable characters: outlines-core wants the bytes.
        to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        model = json.loads(tokenizer_json)
        special = {t["id"] for t in model.get("added_tokens", [])}
        tokens: dict[bytes, list[int]] = {}
        for text, i in model["model"]["vocab"].items():
            if i not in special:
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.eos = eos

    def compile(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def allowed(self, matcher: Any) -> list[int]:
        return list(matcher.get_tokens())

    def advance(self, matcher: Any, token: int) -> bool:
        if token not in matcher.get_tokens():
            return False
        matcher.advance(token)
        return True

    def complete(self, matcher: Any) -> bool:
        return matcher.is_finished() or self.eos in matcher.get_tokens()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, which byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


LIBRARIES: list[type[Library]] = [XGrammar, LLGuidance, OutlinesCore]


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    began = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - began


def walk_times(lib: Library, compiled: Any, seed: int, max_steps: int = 400) -> tuple[list[float], bool]:
    """Mask-and-advance times (seconds) along one random walk, and whether it completed the document."""
    rng = random.Random(seed)
    matcher = lib.matcher(compiled)
    times: list[float] = []
    for _ in range(max_steps):
        allowed, took = _timed(lambda: lib.allowed(matcher))
        allowed = [t for t in allowed if t != lib_eos(lib)]
        if not allowed:
            return times, True
        token = rng.choice(allowed)
        ok, took_advance = _timed(lambda token=token: lib.advance(matcher, token))
        times.append(took + took_advance)
        if not ok:
            raise RuntimeError(f"{lib.name} refused a token its own mask allowed")
    return times, False


def lib_eos(lib: Library) -> int:
    return lib.eos if hasattr(lib, "eos") else lib.info.stop_token_ids[0]


def coverage(lib: Library, tokenizer: Tokenizer) -> dict[str, str]:
    """Each feature: ``enforced``, or what went wrong."""
    found = {}
    for feature, (schema, good, bad) in COVERAGE.items():
        try:
            compiled = lib.compile(json.dumps(schema))
        except Exception as exc:  # a library's own refusal, reported as it words it
            found[feature] = f"does not compile: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        keeps = _accepts(lib, compiled, tokenizer.encode(good, add_special_tokens=False).ids)
        breaks = _accepts(lib, compiled, tokenizer.encode(bad, add_special_tokens=False).ids)
        if not keeps:
            found[feature] = "refuses a valid document"
        elif breaks:
            found[feature] = "accepts a document that breaks it (not enforced)"
        else:
            found[feature] = "enforced"
    return found


def _accepts(lib: Library, compiled: Any, tokens: list[int]) -> bool:
    matcher = lib.matcher(compiled)
    return all(lib.advance(matcher, t) for t in tokens) and lib.complete(matcher)


def measure(cls: type[Library], tokenizer_json: str, tokenizer: Tokenizer, eos: int) -> dict[str, Any]:
    try:
        version = importlib.metadata.version(cls.package)
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    vocab = tokenizer.get_vocab_size()
    lib, setup_s = _timed(lambda: cls(tokenizer_json, vocab, eos))
    schema = json.dumps(FULL_SCHEMA)
    compiles = [_timed(lambda: lib.compile(schema))[1] for _ in range(5)]
    compiled = lib.compile(schema)
    steps: list[float] = []
    completed = 0
    for seed in range(5):
        times, done = walk_times(lib, compiled, seed)
        steps += times
        completed += done
    steps.sort()
    found = coverage(lib, tokenizer)
    files = importlib.metadata.files(cls.package) or []
    requires = [r for r in importlib.metadata.requires(cls.package) or [] if "extra ==" not in r]
    return {
        "installed": True,
        "version": version,
        "installed_mb": round(sum(f.size or 0 for f in files) / 1e6, 1),
        "requires": requires,
        "tokenizer_setup_ms": round(setup_s * 1e3, 1),
        "compile_ms": round(statistics.median(compiles) * 1e3, 2),
        "mask_us": {
            "median": round(statistics.median(steps) * 1e6, 1),
            "p90": round(steps[int(0.9 * (len(steps) - 1))] * 1e6, 1),
            "tokens": len(steps),
            "walks_completed": f"{completed}/5",
        },
        "coverage": found,
        "features_enforced": f"{sum(v == 'enforced' for v in found.values())}/{len(found)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=DEMO_TOKENIZER)
    parser.add_argument("--json", type=Path, required=True, help="a new file: benchmarks/results/grammars-N.json")
    args = parser.parse_args()
    begun = provenance.begin()
    tokenizer_json = args.tokenizer.read_text()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = tokenizer.token_to_id("</s>")
    results = {cls.name: measure(cls, tokenizer_json, tokenizer, eos) for cls in LIBRARIES}
    record = {
        "benchmark": "grammars",
        "tokenizer": str(args.tokenizer),
        "vocab": tokenizer.get_vocab_size(),
        "schema": FULL_SCHEMA,
        "libraries": results,
    }
    provenance.write(args.json, record, begun, "llguidance", depends_on=DEPENDS_ON)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
