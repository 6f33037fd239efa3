"""Constrained decoding: JSON schemas and Lark grammars turned into per-sequence ``Constraint`` objects.

Built on llguidance (measured against outlines-core and xgrammar: docs/performance.md): it
has no dependencies, compiles a schema in about a millisecond (no per-schema index over the
vocabulary), computes a mask in tens of microseconds on a 152k vocabulary, and its Lark grammars
embed JSON schemas (``%json {...}``) and special tokens (``<[id]>``), which tool-call syntaxes need.

Its token table comes from the engine's own tokenizer: a Hugging Face ``tokenizer.json`` (MLX) or
llama.cpp's token pieces (GGUF), so masks index exactly the ids the engine samples.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance as llg
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mesh_llm.engines.base import Tokenizer

log = logging.getLogger(__name__)

# Compact separators and no free whitespace: a model cannot stall in endless newlines, and the text
# reads like json.dumps'.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message says why (for a 400)."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """An llguidance grammar for JSON values matching ``schema`` (see :func:`closed_objects`)."""
    try:
        return llg.LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=_JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def lark_grammar(lark: str) -> str:
    return llg.LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str) -> None:
    """:class:`GrammarError` unless ``grammar`` compiles (no tokenizer needed: a malformed schema is
    refused even when nothing will be constrained by it)."""
    error = llg.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark ``%json`` term, with the same options as :func:`json_schema_grammar`."""
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": _JSON_OPTIONS})


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists ``properties`` and
    says nothing of others (as xgrammar's strict mode and OpenAI's strict schemas do): what it accepts
    still validates against the original, and a small model is not invited to invent keys."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if ("properties" in out and "additionalProperties" not in out and "patternProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SUBSCHEMAS = {"items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if",
               "then", "else", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems"}


class GrammarConstraint:
    """One sequence's matcher, as the engines' ``Constraint``: the allowed next tokens, then the token
    chosen. A matcher that failed allows only EOS, so the generation ends instead of running on
    unconstrained, and says why in ``failed``. Its own masks keep it from failing on the model's
    tokens; what remains is a grammar past llguidance's limits (a schema whose required objects
    nest forever: "Too many items"; a pattern of a million repeats: "too many expressions")."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int, eos_ids: frozenset[int]):
        self._matcher = matcher
        self._vocab = vocab_size
        self._bits = allocate_token_bitmask(1, vocab_size)
        self._eos_only = np.zeros(vocab_size, dtype=bool)
        self._eos_only[[t for t in eos_ids if t < vocab_size]] = True
        self.failed: str | None = None

    def mask(self) -> np.ndarray:
        if self._matcher.is_error():
            self.failed = _first_line(self._matcher.get_error())
            return self._eos_only
        fill_next_token_bitmask(self._matcher, self._bits)
        return np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self._vocab].view(bool)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token) and not self.done:
            log.warning("constrained generation left its grammar: %s", self._matcher.get_error())

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return self._matcher.is_stopped()


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


class Grammars:
    """Compiles grammars for one tokenizer. Safe from any thread; the token table is built once, on
    first use (about 0.1 s for 49k tokens, 0.4 s for 152k), and compiled grammars are kept (LRU)."""

    def __init__(self, tokenizer: Tokenizer, cache: int = 64):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._lltok: llg.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._cache = cache

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for ``grammar`` (from :func:`json_schema_grammar` or :func:`lark_grammar`);
        :class:`GrammarError` if it does not compile."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is None:
                lltok = self._token_table()
                template = llg.LLMatcher(lltok, grammar, log_level=0)
                if not template.is_error():  # the first mask: a $ref loop compiles, then fails here
                    fill_next_token_bitmask(template, allocate_token_bitmask(1, lltok.vocab_size))
                if template.is_error():
                    raise GrammarError(f"the grammar does not compile: {_first_line(template.get_error())}")
                self._compiled[grammar] = template
                if len(self._compiled) > self._cache:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(grammar)
            matcher = template.deep_copy()
        return GrammarConstraint(matcher, self._tokenizer.vocab_size, self._tokenizer.eos_token_ids)

    def literal(self, text: str) -> str:
        """``text`` as a Lark terminal: ``<[id]>`` when it is one special token, else a string."""
        token = self.special_token(text)
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

    def special_token(self, text: str) -> int | None:
        """The id of ``text`` when the tokenizer has it as one special (control) token, else None:
        grammars then name it ``<[id]>``, as its bytes alone would not match it."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            return None
        with self._lock:
            lltok = self._token_table()
        return ids[0] if lltok.is_special_token(ids[0]) else None

    def _token_table(self) -> llg.LLTokenizer:
        if self._lltok is None:
            self._lltok = _lltokenizer(self._tokenizer)
        return self._lltok


def _lltokenizer(tokenizer: Tokenizer) -> llg.LLTokenizer:
    """llguidance's view of an engine tokenizer: from its ``tokenizer.json`` (``to_json()``, Hugging
    Face tokenizers) or from each token's bytes (``token_table()``, llama.cpp's vocab)."""
    eos = sorted(tokenizer.eos_token_ids)
    if hasattr(tokenizer, "to_json"):
        return llg.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    if hasattr(tokenizer, "token_table"):
        table = tokenizer.token_table()
        return llg.LLTokenizer(llg.TokenizerWrapper(_TableSource(tokenizer, table, eos)), eos_token=eos)
    raise GrammarError("this model's tokenizer cannot be used for constrained output")


class _TableSource:
    """The object llguidance's TokenizerWrapper reads: token bytes (control tokens prefixed with 0xff,
    its marker for specials), EOS, and a tokenize function."""

    def __init__(self, tokenizer: Tokenizer, table: list[tuple[bytes, bool]], eos: list[int]):
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = None
        self.tokens = [b"\xff" + piece if special else piece for piece, special in table]
        self.special_token_ids = [i for i, (_, special) in enumerate(table) if special]

    def __call__(self, text: str | bytes) -> list[int]:
        """Token ids of ``text`` as a continuation (llguidance tokenizes the text a grammar forces).
        SentencePiece vocabularies put a space before the start of any text; then the text is
        tokenized after a newline and the newline's tokens dropped."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if ids and text[:1] not in ("", " ") and self.tokens[ids[0]].startswith(b" "):
            shifted = self._tokenizer.encode("\n" + text, add_special_tokens=False)
            spelled = b""
            for i, token in enumerate(shifted):
                spelled += self.tokens[token]
                if spelled.strip(b" ") == b"\n":
                    return shifted[i + 1:]
                if len(spelled) > 2:
                    break
        return ids


_GRAMMARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def grammars_for(tokenizer: Tokenizer) -> Grammars:
    """The one :class:`Grammars` of ``tokenizer`` (so its token table is built once per model)."""
    with _GRAMMARS_LOCK:
        grammars = _GRAMMARS.get(tokenizer)
        if grammars is None:
            grammars = _GRAMMARS[tokenizer] = Grammars(tokenizer)
        return grammars
