"""The limits a generation's grammar keeps, declared once, and the one compile under them that the
web process and main both run: a grammar main would refuse is refused at the edge first.

A grammar (``Generate.grammar``) is llguidance's serialized form of a JSON schema or a Lark
grammar, and its cost is the client's to choose: an 8,000-property schema (231 KB) took 1.6 s to
validate and seconds more to compile, and one object of that many optional properties makes its
first token's parser row 32,007 items long. llguidance counts its work in its own units (grammar
symbols, lexer fuel, Earley items, lexer states), the same on every machine, so a limit in those
units decides a grammar's fate the same way under any load, where a time budget would refuse
more on a busy box than on an idle one. ``GRAMMAR_LIMITS`` names each limit, its value and why;
``PARSER_LIMITS`` is the same as llguidance takes it. Main keeps a wall clock as a backstop only
(``inference.runtime.engine.compiles``).

Two kinds of limit. The compile limits (``MAX_GRAMMAR_BYTES``, ``max_grammar_size``,
``initial_lexer_fuel``, and llguidance's own bound of 50,000 schema nodes, which callers cannot
set) are met by ``compile_grammar``: the web process answers a 400 naming the parameter and the
limit, main a ``Failed``. The step limits (``step_lexer_fuel``, ``step_max_items``,
``max_items_in_row``, ``max_lexer_states``) bound the work of one token's mask, on main's loop:
the compile meets them for the first token, and a generation whose next token would need more
ends with a ``Failed`` naming the limit, at the same token on every run.

**Why these values.** Every schema OpenAI's API takes for structured outputs and tools (at most
5,000 properties, 10 levels of nesting, 1,000 enum values, 128 tools) compiles, in the grammar
form ``controlplane.serving.structured`` writes, to at most about 30,000 symbols (measured: 128
tools of 39 parameters each, 4,992 properties: 29,803; 5,000 required properties: 20,007; 5,000
properties in 10 levels: 15,547). On random walks through the example schemas (tests/,
benchmarks/grammars.py, those) one token needed at most 5,800 lexer fuel, 3,300 Earley items and
360 lexer states under a 32,000-token vocabulary; under a 128,000-token one none failed with a
quarter of the step limits below but the 400-optional-property object, at a quarter of
``step_max_items``. What these limits refuse is what no client of OpenAI's could send. The one
bound such a schema can meet is ``MAX_GRAMMAR_BYTES``, main's cap before these limits: a grammar
carries its schema's descriptions (128 tools of 39 described parameters: 372 KB).

**Why precomputing large lexemes is off.** With it on, llguidance runs a lexeme of a very large
regex against the whole token trie while it compiles, under ``initial_lexer_fuel``, so a compile's
verdict would depend on the vocabulary. Off, that work happens while decoding, token by token,
under ``step_lexer_fuel``, and the web process (which compiles for a tokenizer of bytes,
``BYTE_TOKENIZER``: it has no model at hand where it reads a request) and main (for the model's
tokenizer) refuse the same grammars at compile.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import llguidance

MAX_GRAMMAR_BYTES = 256 * 1024  # a grammar past this is refused before it is compiled


@dataclass(frozen=True)
class GrammarLimit:
    """One of llguidance's ``ParserLimits``: its name there, our value, when it is met, and why.

    ``says``: the words of llguidance's refusals when a grammar is past it (how a refusal is told
    to be this limit's).
    """

    name: str
    value: int
    unit: str
    checked: str  # "compile" or "step"
    says: tuple[str, ...]
    why: str


GRAMMAR_LIMITS: tuple[GrammarLimit, ...] = (
    GrammarLimit(
        "max_grammar_size",
        40_000,
        "grammar symbols",
        "compile",
        ("grammar size (number of symbols) too big",),
        "OpenAI's limits for structured outputs and tools compile to at most about 30,000 symbols; "
        "40,000 leaves a third more and bounds the slowest grammar it admits (one object of about "
        "5,000 optional properties, whose compile grows with their square) to seconds, off main's loop "
        "(llguidance's default, 500,000, is sized for the whole FHIR schema)",
    ),
    GrammarLimit(
        "initial_lexer_fuel",
        1_000_000,
        "lexer fuel",
        "compile",
        ("initial lexer configuration (grammar) too big", "fuel exhausted when checking relevance"),
        "llguidance's default: building the lexer's regexes at this cost takes about 20 ms (50,000 a ms); "
        "128 tools of 30 parameters need 134,000, and an enum of 20,000 values more than 200,000",
    ),
    GrammarLimit(
        "step_lexer_fuel",
        50_000,
        "lexer fuel a token",
        "step",
        ("too many expressions constructed",),
        "about 3.5 ms of one token's mask (14,000 a ms), on main's loop; a quarter of llguidance's default, "
        "8 times the most a walk through any example schema needed on a 32,000-token vocabulary (5,800)",
    ),
    GrammarLimit(
        "step_max_items",
        10_000,
        "Earley items a token",
        "step",
        ("Too many items",),
        "about 0.5 ms of one token's mask (20,000 a ms); an object of optional properties needs about 8 a "
        "property at its start, so this admits every object max_items_in_row does (llguidance's default: 50,000)",
    ),
    GrammarLimit(
        "max_items_in_row",
        2_000,
        "Earley items in a row",
        "step",
        ("Current row has",),
        "llguidance's default: an object of n optional properties makes a row of 4n + 7 items, so at most "
        "498 optional properties in one object (required ones cost no row)",
    ),
    GrammarLimit(
        "max_lexer_states",
        10_000,
        "lexer states",
        "step",
        ("too many states",),
        "1 to 2 kB each, so at most 10 to 20 MB of lexer a grammar in main's cache (llguidance's default, "
        "250,000, is up to 500 MB); 28 times the most a walk through any example schema built (360)",
    ),
)

# llguidance's bound on a JSON schema's nodes, which callers cannot set (``SchemaBuilderOptions``).
SCHEMA_NODES = 50_000
SCHEMA_NODES_SAYS = "schema too large"

PARSER_LIMITS = llguidance.LLParserLimits(
    **{limit.name: limit.value for limit in GRAMMAR_LIMITS},
    precompute_large_lexemes=False,  # the edge and main refuse the same grammars (module docstring)
    verbose_errors=False,  # a refusal names the limit, never the grammar or the tokens so far
)


def compile_grammar(grammar: str, tokenizer: llguidance.LLTokenizer) -> tuple[llguidance.LLMatcher | None, str]:
    """``grammar`` compiled for ``tokenizer`` under the limits, its first token's mask computed;
    or None and why it cannot constrain a generation.

    The work is bounded by the limits and takes as long as llguidance needs to reach them
    (seconds, for the largest grammars they admit): call it off any loop that others wait on.
    llguidance lets go of the GIL while it compiles and computes masks.
    """
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        return None, f"the grammar is {size} bytes, over the limit of {MAX_GRAMMAR_BYTES} (MAX_GRAMMAR_BYTES)"
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
    if not matcher.is_error():
        # The first mask builds the lexer's first states: done here, once, not on a decoding step
        # (each sequence's matcher is a copy of this one). A grammar whose first token alone is past
        # a step limit is refused here, as it would end at its first token.
        matcher.compute_logit_bias()
    if matcher.is_error():
        return None, refusal(matcher.get_error())
    return matcher, ""


def refusal(message: str) -> str:
    """llguidance's refusal ``message`` of a grammar, in our words: the limit it met named, where it met one."""
    return over_limit(message) or f"the grammar does not compile: {message}"


def over_limit(message: str) -> str:
    """Which limit llguidance's error ``message`` says a grammar is past, in our words ("" if none)."""
    if SCHEMA_NODES_SAYS in message:
        return f"the schema is over llguidance's limit of {SCHEMA_NODES} schema nodes ({message})"
    for limit in GRAMMAR_LIMITS:
        if any(words in message for words in limit.says):
            return f"the grammar is over the limit {limit.name} = {limit.value} {limit.unit} ({message})"
    return ""


class _Bytes:
    """A tokenizer of one token a byte (and an end): what the web process compiles for."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


# The web process has no model's tokenizer at hand where it reads a request's structure. Under
# PARSER_LIMITS (no precomputed lexemes) what a compile refuses does not depend on the vocabulary,
# but the first mask's lexer work does, a little: a grammar whose first token is past a step limit
# under the model's vocabulary but not under bytes passes the edge and ends at main's compile.
BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def digest(grammar: str) -> bytes:
    """The key a compiled grammar is kept by."""
    return hashlib.sha256(grammar.encode()).digest()


@dataclass(frozen=True)
class Compiled:
    """A grammar's compile: its matcher (the first token's state, to copy for each sequence), or
    why it cannot constrain a generation; ``size``: its text's bytes, what the cache counts."""

    matcher: llguidance.LLMatcher | None
    problem: str
    size: int


class CompiledGrammars:
    """The most recently used compiles, by their grammar's digest: at most ``max_entries`` of them
    and ``max_bytes`` of grammar text (None: no bound), the least recently used dropped first.
    Safe across threads."""

    def __init__(self, *, max_entries: int, max_bytes: int | None = None) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._kept: OrderedDict[bytes, Compiled] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: bytes) -> Compiled | None:
        with self._lock:
            found = self._kept.get(key)
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
                self._kept.move_to_end(key)
            return found

    def put(self, key: bytes, compiled: Compiled) -> None:
        with self._lock:
            old = self._kept.pop(key, None)
            self._bytes -= old.size if old is not None else 0
            self._kept[key] = compiled
            self._bytes += compiled.size
            while self._kept and (
                len(self._kept) > self.max_entries or (self.max_bytes is not None and self._bytes > self.max_bytes)
            ):
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.size

    def __len__(self) -> int:
        return len(self._kept)
