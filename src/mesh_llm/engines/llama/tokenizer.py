"""llama.cpp's own tokenizer on a loaded vocab, callable from any thread while the engine decodes.

llama_tokenize/llama_detokenize only read the vocab (const methods, a tokenizer session per call) and
ctypes drops the GIL, so calls run concurrently: an 8 MiB prompt being encoded on an API thread does
not hold up the worker's detokenizing. The one hazard is close() freeing the vocab mid-call, so calls
are counted in and out (:class:`_Readers`) and the engine frees the model only once none is running.

llama.cpp splits a text at its special tokens in time that grows with the square of their number, so
a prompt with many (a long chat) is encoded in pieces that each hold a bounded number, cut where the
cut provably changes no token (:meth:`LlamaTokenizer.encode`); :meth:`~LlamaTokenizer.min_tokens`
bounds the count from below without tokenizing (:mod:`mesh_llm.engines.token_floor`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence

import llama_cpp.llama_cpp as ll

from mesh_llm.engines.base import EngineError
from mesh_llm.engines.token_floor import TokenFloor, byte_level_chars

# the tokens llama.cpp splits a text at before tokenizing the rest (its special-token cache)
_SPECIAL = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED | ll.LLAMA_TOKEN_ATTR_UNKNOWN
_STRIP = ll.LLAMA_TOKEN_ATTR_LSTRIP | ll.LLAMA_TOKEN_ATTR_RSTRIP
# Special tokens per llama_tokenize call: its splitting costs about 1.5e-9 s x their number squared
# (measured: 65,536 in one call took 6.2 s), so 256 a call cost 0.1 ms, linear in the text's length.
CHUNK_SPECIALS = 256
# BPE pre-tokenizers whose input is not mapped to GPT-2's byte alphabet (llama.cpp's byte_encode=false)
_UNMAPPED_PRE = frozenset({"whitespace", "sarvam-moe", "gemma4"})


class _Readers:
    """Any number of calls at once; :meth:`retire` refuses new ones and waits for those running."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._running = 0
        self._open = True

    def __enter__(self) -> None:
        with self._cond:
            if not self._open:
                raise EngineError("the llama engine is closed")
            self._running += 1

    def __exit__(self, *_exc) -> None:
        with self._cond:
            self._running -= 1
            if not self._running:
                self._cond.notify_all()

    def retire(self, free: Callable[[], None]) -> None:
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._running == 0)
            free()


class LlamaTokenizer:
    """The model's vocab: encode/decode, end-of-generation ids, special tokens, chat template."""

    def __init__(self, model: ll.llama_model_p) -> None:
        self._calls = _Readers()
        self._vocab = vocab = ll.llama_model_get_vocab(model)
        self._n_vocab = ll.llama_vocab_n_tokens(vocab)
        self._eos_ids = frozenset(t for t in range(self._n_vocab) if ll.llama_vocab_is_eog(vocab, t))
        self._bos = self._text(ll.llama_vocab_bos(vocab))
        self._eos = self._text(ll.llama_vocab_eos(vocab))
        template = ll.llama_model_chat_template(model, None)
        self._template = template.decode("utf-8") if template else None
        self._floor, self._cuttable, control = _vocab_floor(model, vocab, self._n_vocab)
        self._control = frozenset(t.decode("utf-8", errors="replace") for t in control)
        # SPM and BPE tokenize each fragment between special tokens on its own; others are not cut
        self._cut = ll.llama_vocab_type(vocab) in (ll.LLAMA_VOCAB_TYPE_SPM, ll.LLAMA_VOCAB_TYPE_BPE)
        self._bos_id = ll.llama_vocab_bos(vocab) if ll.llama_vocab_get_add_bos(vocab) else None
        self._eos_id = ll.llama_vocab_eos(vocab) if ll.llama_vocab_get_add_eos(vocab) else None

    def _text(self, token: int) -> str | None:
        if token == ll.LLAMA_TOKEN_NULL:
            return None
        return ll.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-generation token llama.cpp knows (EOS, EOT, <|im_end|>, ...)."""
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
        return self._n_vocab

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """llama_tokenize's ids for ``text``, special tokens parsed. A text with more than
        :data:`CHUNK_SPECIALS` special tokens is encoded in pieces, each cut just before an atomic
        special token (:mod:`~mesh_llm.engines.token_floor`) that strips no whitespace to its left.
        llama.cpp then gives the same ids as for the whole text: no special text overlaps that
        token, so no match crosses the cut; it is split out wherever it stands, so the cut is a
        fragment boundary in the whole text too; no left-strip reaches across it (it starts with a
        non-space and strips nothing itself); and SPM and BPE tokenize each fragment on its own,
        every text fragment after a special token (SPM's space prefix). BOS and EOS are added
        around the whole, as llama_tokenize would."""
        data = text.encode("utf-8")
        cuts = self._cuts(data) if self._cut else []
        if not cuts:
            return self._tokenize(data, add_special_tokens)
        ids = [self._bos_id] if add_special_tokens and self._bos_id is not None else []
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            ids += self._tokenize(data[start:end], False)
        if add_special_tokens and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    @property
    def control_texts(self) -> frozenset[str]:
        return self._control

    def encode_plain(self, text: str) -> list[int]:
        """llama_tokenize's ids for ``text`` with control tokens not parsed (user-defined ones still
        are, as Hugging Face's non-special added tokens)."""
        return self._tokenize(text.encode("utf-8"), False, special=False)

    def _cuts(self, data: bytes) -> list[int]:
        """Where to cut ``data``: before every CHUNK_SPECIALS-th cuttable special token."""
        starts = [m.start() for m in self._floor.occurrences(data) if m.group() in self._cuttable]
        return starts[CHUNK_SPECIALS::CHUNK_SPECIALS]

    def _tokenize(self, data: bytes, add_special_tokens: bool, special: bool = True) -> list[int]:
        n = len(data) + 8  # byte-level vocabularies give at most a token a byte, plus BOS/EOS
        with self._calls:
            while True:
                out = (ll.llama_token * n)()
                got = ll.llama_tokenize(self._vocab, data, len(data), out, n, add_special_tokens, special)
                if got >= 0:
                    return out[:got]
                n = -got

    def min_tokens(self, text: str) -> int:
        """At most ``len(encode(text, False))``, found in linear time without tokenizing."""
        return self._floor.min_tokens(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        tokens = (ll.llama_token * len(ids))(*ids)
        n = 16 * len(ids) + 16
        with self._calls:
            while True:
                buf = ctypes.create_string_buffer(n)
                got = ll.llama_detokenize(self._vocab, tokens, len(ids), buf, n, False, True)
                if got >= 0:
                    return buf.raw[:got].decode("utf-8", errors="replace")
                n = -got

    def token_table(self) -> list[tuple[bytes, bool]]:
        """Every token's bytes as generation emits them, and whether it is special (grammar libraries
        build their token tables from it)."""
        buf = ctypes.create_string_buffer(4096)
        table = []
        with self._calls:
            for token in range(self._n_vocab):
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                piece, attr = buf.raw[:max(n, 0)], ll.llama_vocab_get_attr(self._vocab, token)
                # as llguidance's own llama.cpp adapter: user-defined tokens spelled <...> are special too
                special = bool(attr & ll.LLAMA_TOKEN_ATTR_CONTROL) or bool(
                    attr & ll.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">"))
                table.append((piece, special))
        return table

    def retire(self, free: Callable[[], None]) -> None:
        """Refuse new calls, wait for running ones, then ``free()`` (the model that owns the vocab)."""
        self._calls.retire(free)


def _vocab_floor(model: ll.llama_model_p, vocab: ll.llama_vocab_p,
                 n_vocab: int) -> tuple[TokenFloor, frozenset[bytes], list[bytes]]:
    """The vocab's :class:`TokenFloor`, the atomic special texts a text may be cut before, and the
    control tokens' texts."""
    texts: list[bytes] = []
    specials: dict[bytes, int] = {}  # text -> its tokens' attributes, together
    stripping = False
    for token in range(n_vocab):
        text = ll.llama_vocab_get_text(vocab, token) or b""
        attr = ll.llama_vocab_get_attr(vocab, token)
        texts.append(text)
        stripping |= bool(attr & _STRIP)
        if attr & _SPECIAL:
            specials[text] = specials.get(text, 0) | attr
    longest, dropped = (None, b"") if stripping else _bytes_per_token(model, texts)
    floor = TokenFloor(specials, bytes_per_token=longest, dropped=dropped)
    cuttable = frozenset(t for t in floor.atomic if not specials[t] & ll.LLAMA_TOKEN_ATTR_LSTRIP)
    return floor, cuttable, [t for t, attr in specials.items() if attr & ll.LLAMA_TOKEN_ATTR_CONTROL and t]


def _bytes_per_token(model: ll.llama_model_p, texts: list[bytes]) -> tuple[int | None, bytes]:
    """The most input bytes one token can stand for, and the bytes that may be dropped, where each
    other byte of a text fragment is covered by a token whose text holds it (at least as long as
    what it covers): SPM (its texts escape a space to three bytes; a byte no piece covers becomes a
    ``<0xXX>`` token, or llama.cpp fails) and GPT-2 style BPE, whose input is mapped to one 1- or
    2-byte character a byte (one without a token is dropped; merges make vocab tokens).
    (None, b"") for other tokenizers; the caller gives that too where a token strips whitespace."""
    kind = _meta(model, "tokenizer.ggml.model")
    dropped = b""
    if kind == "gpt2" and _meta(model, "tokenizer.ggml.pre") not in _UNMAPPED_PRE:
        present = set(texts)
        dropped = bytes(b for b, char in enumerate(byte_level_chars()) if char.encode() not in present)
    elif kind != "llama":
        return None, b""
    return max(map(len, texts), default=0) or None, dropped


def _meta(model: ll.llama_model_p, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    got = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if got >= 0 else None
