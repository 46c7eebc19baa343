"""A model's tokenizer and chat template for the web process, without Transformers (nor torch).

The web process turns text into prompt ids and generated ids back into text; Transformers'
``AutoTokenizer`` does that by wrapping the ``tokenizers`` library and rendering the chat
template with jinja2, but importing it costs seconds and pulls in torch. ``TextTokenizer``
reads the same files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
and ``chat_templates/*.jinja``) and does what Transformers 5 does with them:

- encoding with the ``tokenizers`` model in ``tokenizer.json``, its post-processor (BOS/EOS) as
  it is: Transformers' generic ``TokenizersBackend`` (what ``AutoTokenizer`` gives for these
  files) keeps it whatever ``add_bos_token`` / ``add_eos_token`` the config names (measured:
  the tests compare configs that set them and a tokenizer.json without a post-processor);
- decoding with ``tokenizers``, and ``clean_up_tokenization_spaces`` where the config asks for
  it and the model is not a BPE (as ``TokenizersBackend._decode``);
- a token's bytes (``token_bytes``, for logprobs), from its vocabulary entry: a byte-level
  BPE's characters mapped back to bytes (GPT-2's table, as its ``ByteLevel`` decoder does),
  SentencePiece's ``<0xNN>`` byte pieces and ``▁`` for a space, an added token's own text;
- chat templates rendered in the environment of ``transformers.utils.chat_template_utils``:
  an immutable sandbox with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``,
  ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML and takes
  ``ensure_ascii``/``indent``/``separators``/``sort_keys``, a restricted ``dict`` and
  ``namespace``, and the named special tokens (``bos_token``, ``eos_token``...) of
  ``tokenizer_config.json`` as variables.

A model that ships only a SentencePiece ``tokenizer.model`` (no ``tokenizer.json``) is not
read here: converting it is Transformers' job. tests/controlplane/test_chat_template.py
compares ids, text and rendered prompts with ``AutoTokenizer`` for the demo model and the
families' tiny tokenizers.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # older checkpoints: merged into the config
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
# The named special tokens a template sees (Transformers' ``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerFilesError(ValueError):
    """A model directory whose tokenizer files cannot be read; the message says which and why."""


class TextTokenizer:
    """Encode, decode and render chat templates as the model's Transformers tokenizer does."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.config = _read_config(self.directory)
        try:
            self.backend = Tokenizer.from_file(str(self.directory / TOKENIZER_FILE))
        except Exception as exc:  # tokenizers raises its own Exception subclass for a bad file
            raise TokenizerFilesError(f"cannot read {self.directory / TOKENIZER_FILE}: {exc}") from None
        self.special_tokens = {name: text for name in SPECIAL_TOKENS if (text := _token_text(self.config.get(name)))}
        self.chat_template = _chat_template(self.directory, self.config)
        self.clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, *, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """``encode``'s ids, and the character where each token starts in ``text``."""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @cached_property
    def vocab_size(self) -> int:
        """One past the largest token id, added tokens included (ids may leave gaps; this bounds them)."""
        return max(self.get_vocab().values(), default=-1) + 1

    @property
    def normalizer(self) -> Any:
        return self.backend.normalizer

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text token ``token_id`` stands for on its own (b"" for an id past the vocabulary).

        Not ``decode([id])``: a token may hold part of a character (byte-level BPE, byte
        fallback), which decoding alone turns into U+FFFD, and SentencePiece's decoder drops
        the space a word's first token starts with.
        """
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps characters back to bytes (``ByteLevel``, alone or in a sequence)."""
        decoder = self.backend.decoder
        if decoder is None:
            return False
        state = json.loads(decoder.__getstate__())
        kinds = [d.get("type") for d in state.get("decoders", [])] if state.get("type") == "Sequence" else []
        return state.get("type") == "ByteLevel" or "ByteLevel" in kinds

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return chat_environment().from_string(self.chat_template)

    @cached_property
    def template_reads_tools(self) -> bool:
        """Whether the chat template writes the ``tools`` it is given (a tool-calling model's does)."""
        if not self.chat_template:
            return False
        environment = chat_environment()
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(self.chat_template))

    def render_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The conversation as the chat template writes it (``apply_chat_template(tokenize=False)``),
        with ``tools`` (OpenAI's form) where given.

        Raises ``jinja2.TemplateError`` where the template refuses the messages or is broken.
        """
        return self._compiled_template.render(
            **self.special_tokens,
            messages=[dict(m) for m in messages],
            tools=tools or None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )


def load_text_tokenizer(directory: str | Path) -> TextTokenizer | None:
    """The model's tokenizer, or None when it ships no ``tokenizer.json``."""
    if not (Path(directory) / TOKENIZER_FILE).is_file():
        return None
    return TextTokenizer(directory)


# --- Transformers' chat-template environment ---------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Jinja's own tojson escapes HTML characters; a prompt wants them as they are.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # A limited stand-in for dict, so that a template cannot reach dict's attributes.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # A namespace refuses underscore-prefixed names, which could reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Transformers marks the assistant's tokens with it;
    rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def chat_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


# --- reading the files -------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFilesError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerFilesError(f"{path} must hold a JSON object")
    return data


def _read_config(directory: Path) -> dict:
    config = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
    legacy = directory / SPECIAL_TOKENS_MAP_FILE
    if legacy.is_file():  # Transformers merges it in without overriding the config's own
        for key, value in _read_json(legacy).items():
            config.setdefault(key, value)
    return config


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict) -> str | None:
    """The template Transformers would use: ``chat_template.jinja`` (and ``chat_templates/``) over the
    config's ``chat_template``; of several named ones, "default"."""
    templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if not templates:
        given = config.get("chat_template")
        if isinstance(given, str):
            templates["default"] = given
        elif isinstance(given, list):
            templates = {t["name"]: t["template"] for t in given if isinstance(t, dict) and "name" in t}
    return templates.get("default")


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )
