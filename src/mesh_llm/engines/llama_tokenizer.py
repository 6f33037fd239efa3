"""llama.cpp's own tokenizer on a loaded vocab, callable from any thread while the engine decodes.

llama_tokenize/llama_detokenize only read the vocab (const methods, a tokenizer session per call) and
ctypes drops the GIL, so calls run concurrently: an 8 MiB prompt being encoded on an API thread does
not hold up the worker's detokenizing. The one hazard is close() freeing the vocab mid-call, so calls
are counted in and out (:class:`_Readers`) and the engine frees the model only once none is running.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence

import llama_cpp.llama_cpp as ll

from mesh_llm.engines.base import EngineError


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
        data = text.encode("utf-8")
        n = len(data) + 8  # byte-level vocabularies give at most a token a byte, plus BOS/EOS
        with self._calls:
            while True:
                out = (ll.llama_token * n)()
                got = ll.llama_tokenize(self._vocab, data, len(data), out, n, add_special_tokens, True)
                if got >= 0:
                    return out[:got]
                n = -got

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
