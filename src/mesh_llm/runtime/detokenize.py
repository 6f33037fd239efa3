"""Token ids to text, one token at a time, without splitting a character or leaking a stop string.

Streamed deltas must concatenate to exactly the text a non-streamed request returns, so both paths use
this one class. Decoding works on windows of ids (as vLLM does) because a token's text depends on its
neighbours: byte-level BPE splits UTF-8 characters across tokens, SentencePiece drops a leading space
at the start of a decode.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh_llm.engines.base import Tokenizer

_CONTEXT = 4  # prompt tokens kept as left context so the first generated token decodes as in place
_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes (and a token may end with part of the next one): past 8
# tokens, a trailing U+FFFD is an invalid byte sequence, not an unfinished one, and is released as
# it is, so the window stays bounded.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._ids = list(prompt[-_CONTEXT:])
        self._prefix = 0  # start of the window decoded for context
        self._read = len(self._ids)  # ids before this are already turned into text
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded text not yet released: it may be the start of a stop string
        self.matched: str | None = None  # the stop string found; nothing more will be released

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def add(self, token: int) -> str:
        """The text that ``token`` makes safe to release (often "", never part of a stop string)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        pending = len(self._ids) - self._read
        if (len(after) <= len(before) or after.endswith(_REPLACEMENT)) and pending < _MAX_PENDING:
            return ""  # an incomplete character: wait for the bytes that finish it
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(after[len(before):])

    def flush(self) -> str:
        """At the end of generation: whatever is held back, including a trailing partial character."""
        if self.stopped:
            return ""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        text = self._release(after[len(before):]) + self._held
        self._held = ""
        return text

    def _release(self, text: str) -> str:
        text = self._held + text
        if not self._stop:
            self._held = ""
            return text
        found = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: (f[0], -len(f[1])))
            self._held = ""
            return text[:cut]
        keep = _longest_stop_prefix_suffix(text, self._stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that some stop string begins with."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if stop.startswith(text[-n:]):
                best = n
                break
    return best
