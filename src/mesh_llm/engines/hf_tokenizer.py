"""The engine :class:`~mesh_llm.engines.base.Tokenizer` for a Hugging Face tokenizer.

Built on the ``tokenizers`` library directly rather than transformers' ``PreTrainedTokenizerFast``:
transformers re-sets truncation and padding on the shared Rust object on every call, which raises
"Already borrowed" when the API thread encodes while the worker decodes. ``tokenizers.Tokenizer``'s
``encode``/``decode`` only read it, so one instance is safe to share between threads.

``tokenizers`` splits at added tokens in linear time (Aho-Corasick), unlike llama.cpp, but a 6 MB chat
still takes seconds: :meth:`HFTokenizer.min_tokens` bounds the count from below without tokenizing
(:mod:`mesh_llm.engines.token_floor`), so a prompt that cannot fit is refused first.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import models as _models

from mesh_llm.engines.base import EngineError
from mesh_llm.engines.token_floor import TokenFloor, byte_level_chars

# pre-tokenizers that only cut the text (those that may drop some of it are not here)
_CUTTING_PRE = frozenset({"Split", "Digits", "Punctuation", "ByteLevel"})


class HFTokenizer:
    """A ``tokenizer.json`` plus what ``tokenizer_config.json`` and the generation config add."""

    def __init__(
        self,
        tokenizer: _RustTokenizer,
        config: dict[str, Any],
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self._tok = tokenizer
        self._bos = _token_text(config.get("bos_token"))
        self._eos = _token_text(config.get("eos_token"))
        self._bos_id = self._tok.token_to_id(self._bos) if self._bos else None
        # Tokenizers whose tokenizer.json lacks a post-processor rely on this flag for the BOS.
        self._add_bos = bool(config.get("add_bos_token")) and self._bos_id is not None
        eos = set(extra_eos_ids)
        if self._eos and (eos_id := self._tok.token_to_id(self._eos)) is not None:
            eos.add(eos_id)
        self._eos_ids = frozenset(eos)
        self._template = chat_template or _template_from_config(config.get("chat_template"))
        self._floor = _token_floor(tokenizer)
        added = tokenizer.get_added_tokens_decoder().values()
        self._control = frozenset(a.content for a in added if a.special and a.content)
        self._plain: _RustTokenizer | None = None  # a copy that reads special tokens as text
        self._plain_lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: Path) -> HFTokenizer:
        """Read a model folder; :class:`EngineError` names the missing or unreadable file."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json") or {}
        tokenizer = _rust_tokenizer(folder)
        eos_ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos_ids |= _ids(_read_json(folder / name, {}).get("eos_token_id"))
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(tokenizer, config, eos_ids, template)

    @classmethod
    def from_json(
        cls, tokenizer_json: str, config: dict[str, Any], extra_eos_ids: Iterable[int] = ()
    ) -> HFTokenizer:
        """From a ``tokenizer.json`` string (a GGUF's vocabulary converted) and its config dict."""
        return cls(_RustTokenizer.from_str(tokenizer_json), config, extra_eos_ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def bos_token(self) -> str | None:
        return self._bos

    @property
    def eos_token(self) -> str | None:
        return self._eos

    @property
    def chat_template(self) -> str | None:
        return self._template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch tokenizes without the GIL; encode holds it throughout, so a long prompt
        # stopped every stream (a 600 KB one for 0.4 s on this CPU) while the worker waited for it
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._add_bos and ids[:1] != [self._bos_id]:
            ids.insert(0, self._bos_id)
        return ids

    @property
    def control_texts(self) -> frozenset[str]:
        return self._control

    def encode_plain(self, text: str) -> list[int]:
        # encode_special_tokens is the Rust object's own setting, so another object holds it: the
        # shared one is read by other threads (made on first use, as few prompts need it)
        with self._plain_lock:
            if self._plain is None:
                self._plain = _RustTokenizer.from_str(self._tok.to_str())
                self._plain.encode_special_tokens = True
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def min_tokens(self, text: str) -> int:
        """At most ``len(encode(text, False))``, found in linear time without tokenizing."""
        return self._floor.min_tokens(text.encode("utf-8"))

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (grammar libraries build their token tables from it)."""
        return self._tok.to_str()

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens are kept: the runtime stops on EOS ids before decoding them, and any
        # other special token the model emits (<think>, tool-call markers) is part of its answer.
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _token_floor(tok: _RustTokenizer) -> TokenFloor:
    """Added tokens are split out before anything else, leftmost-longest; always, unless the token is
    single-word (only between word boundaries), normalized while a normalizer may change the text it
    is looked for in, or special while the tokenizer is set to encode special tokens as text."""
    added = list(tok.get_added_tokens_decoder().values())
    countable = [a.content.encode("utf-8") for a in added
                 if not a.single_word and not (a.normalized and tok.normalizer is not None)
                 and not (a.special and tok.encode_special_tokens)]
    specials = [a.content.encode("utf-8") for a in added]
    return TokenFloor(specials, countable, *_bytes_per_token(tok, added))


def _bytes_per_token(tok: _RustTokenizer, added: list) -> tuple[int | None, bytes]:
    """The most input bytes one token can stand for, and the bytes it may drop, where each other
    input byte is covered by a token whose text holds it: byte-level BPE (each byte becomes a 1- or
    2-byte character of its alphabet; one the vocab lacks is dropped, and merges make vocab tokens)
    with no normalizer (NFC and others can shorten text), pre-tokenizers that only cut, and no added
    token that takes in the whitespace around it. (None, b"") otherwise."""
    if tok.normalizer is not None or not isinstance(tok.model, _models.BPE) or tok.pre_tokenizer is None:
        return None, b""
    pre = json.loads(tok.pre_tokenizer.__getstate__())
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps) or any(
            s.get("type") not in _CUTTING_PRE or s.get("behavior") == "Removed" for s in steps):
        return None, b""
    if any(a.lstrip or a.rstrip for a in added):
        return None, b""
    vocab = tok.get_vocab(with_added_tokens=True)
    dropped = bytes(b for b, char in enumerate(byte_level_chars()) if char not in vocab)
    return max((len(t.encode("utf-8")) for t in vocab), default=0) or None, dropped


def _rust_tokenizer(folder: Path) -> _RustTokenizer:
    path = folder / "tokenizer.json"
    if path.is_file():
        try:
            return _RustTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise EngineError(f"{path}: unreadable tokenizer ({first_line(e)})") from e
    if any((folder / n).is_file() for n in ("tokenizer.model", "vocab.json")):
        # A slow-only tokenizer (sentencepiece model, GPT-2 vocab+merges): transformers converts it.
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), use_fast=True).backend_tokenizer
        except Exception as e:
            raise EngineError(f"{folder}: cannot convert its tokenizer ({first_line(e)})") from e
    raise EngineError(f"{path}: missing (the model folder has no tokenizer files)")


def _read_json(path: Path, default: Any = None) -> Any:
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EngineError(f"{path}: unreadable JSON ({first_line(e)})") from e


def _token_text(token: Any) -> str | None:
    """tokenizer_config writes special tokens as strings or as serialized AddedToken dicts."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _template_from_config(template: Any) -> str | None:
    """A string, or a list of named templates of which the "default" one is the chat template."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def first_line(e: BaseException) -> str:
    """An exception's message cut to one line, for one-line EngineErrors."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
