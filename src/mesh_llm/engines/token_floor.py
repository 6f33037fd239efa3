"""A lower bound on how many tokens a text encodes to, found in linear time without tokenizing it,
so that a prompt which cannot fit the context is refused before a tokenizer spends minutes on it.

Why it exists: llama.cpp splits a prompt at its special tokens (``tokenizer_st_partition``) in time
that grows with the square of their number (at each match it walks its fragment list from the head),
so a chat of 200,000 empty messages (6.4 MB) kept a core busy for more than ten minutes before the
context check could refuse it; 40,000 messages took 13.6 s. Hugging Face's tokenizers are linear,
but still spent 4 s on it. Both engines' tokenizers build a :class:`TokenFloor` once, at load.

The bound is the larger of two counts, each provably at most the number of tokens:

- **Atomic special texts.** The texts a tokenizer splits out before ordinary tokenizing (llama.cpp:
  its control, user-defined and unknown tokens; Hugging Face: the added tokens) are each encoded as
  one token wherever they occur, unless another such text overlaps the occurrence and is split out
  instead. A text is *atomic* when nothing can take it over: no other special text contains it or
  overlaps it (shares a prefix/suffix with it), it does not overlap itself, and it neither starts nor
  ends with whitespace (which a neighbour with ``lstrip``/``rstrip`` may eat). Then every occurrence
  of an atomic text is one token of its own in llama.cpp (longest-first, fragment by fragment) and
  in Hugging Face (leftmost-longest), and occurrences of two atomic texts never overlap, so counting
  them (one trie-shaped regex, linear) counts distinct tokens. Texts that are not atomic are not
  counted: the bound stays a bound, only weaker.
- **Bytes.** Where the tokenizer covers each byte of its input with a token whose text holds it (no
  byte merged into an unknown token, no whitespace stripped), a token stands for at most as many
  bytes as the longest token's text: ``ceil(bytes / longest)`` tokens at least. Bytes the vocab has
  no token for may be dropped (SmolLM2 lacks six ASCII control characters), so they are not counted.
  Each tokenizer says whether that holds for it; ``bytes_per_token`` is None where it does not.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

# C's isspace() in the "C" locale, which llama.cpp's lstrip/rstrip use
_C_SPACE = frozenset(b" \t\n\v\f\r")


class TokenFloor:
    """``min_tokens(data)``: at most the number of tokens ``data`` (UTF-8) encodes to."""

    def __init__(self, specials: Iterable[bytes], countable: Collection[bytes] | None = None,
                 bytes_per_token: int | None = None, dropped: bytes = b""):
        """``specials``: every text the tokenizer splits out before ordinary tokenizing;
        ``countable``: those of them it always splits out wherever they occur (None: all of them);
        ``bytes_per_token``: the most input bytes one token can stand for, or None;
        ``dropped``: bytes (values) the tokenizer may drop, not counted."""
        texts = {t for t in specials if t}
        candidates = texts if countable is None else texts & set(countable)
        self.atomic: frozenset[bytes] = frozenset(_atomic(candidates, texts))
        self.bytes_per_token = bytes_per_token if bytes_per_token and bytes_per_token > 0 else None
        self.dropped = bytes(sorted(set(dropped)))
        self._pattern = _trie_pattern(self.atomic) if self.atomic else None

    def occurrences(self, data: bytes) -> Iterator[re.Match]:
        """Every occurrence of an atomic special text in ``data``, in order (none overlap)."""
        return self._pattern.finditer(data) if self._pattern is not None else iter(())

    def min_tokens(self, data: bytes) -> int:
        specials = sum(1 for _ in self.occurrences(data))
        if not self.bytes_per_token:
            return specials
        counted = len(data.translate(None, self.dropped)) if self.dropped else len(data)
        return max(specials, -(-counted // self.bytes_per_token))


def byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet, as byte-level BPE vocabs spell bytes: the character each byte
    (the list's index) becomes, so a tokenizer can tell which bytes its vocab has no token for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def _atomic(candidates: set[bytes], texts: set[bytes]) -> Iterator[bytes]:
    """The candidates no text of ``texts`` can overlap or contain (see the module docstring)."""
    longest = max(map(len, candidates), default=0)
    # A candidate's own prefixes and suffixes are in these too, so one that overlaps itself is refused.
    prefixes = {u[:j] for u in texts for j in range(1, min(len(u), longest))}
    suffixes = {u[-j:] for u in texts for j in range(1, min(len(u), longest))}
    blob = b"\0".join(sorted(texts))  # no candidate holds a NUL, so none straddles a separator
    for t in candidates:
        if b"\0" in t or t[0] in _C_SPACE or t[-1] in _C_SPACE:
            continue
        if any(t[:j] in suffixes or t[-j:] in prefixes for j in range(1, len(t))):
            continue  # a text ends with t's start or starts with t's end
        if blob.count(t) > 1:
            continue  # a longer text contains it
        yield t


def _trie_pattern(texts: Iterable[bytes]) -> re.Pattern[bytes]:
    """One regex matching any of ``texts`` (none a prefix of another), shaped as their trie so that
    each position costs at most one walk down it, whatever the number of texts."""
    trie: dict = {}
    for text in texts:
        node = trie
        for byte in text:
            node = node.setdefault(byte, {})

    def branch(node: dict) -> bytes:
        alternatives = []
        for byte, child in sorted(node.items()):
            run = bytes([byte])
            while len(child) == 1:  # a chain without branches is one literal
                (byte, child), = child.items()
                run += bytes([byte])
            alternatives.append(re.escape(run) + (branch(child) if child else b""))
        return alternatives[0] if len(alternatives) == 1 else b"(?:" + b"|".join(alternatives) + b")"

    return re.compile(branch(trie))
