"""Prompt-cache reuse across requests, the part every engine shares: which stored state to resume
from, and which to evict.

Clients resend whole conversations and share long system prompts, so the model state left by one
request usually covers a prefix of the next. :class:`PromptCache` keeps such states under exactly the
token ids whose state they hold and, for a new prompt, resumes from the entry sharing the longest
prefix with it, among all entries:

- a *trimmable* state (a plain KV cache) can be cut back to any shorter prefix: it serves an exact
  repeat, a continuation (the next turn of a chat) and a branch (same document, another question);
- any other state (recurrent/SSM layers, a sliding window that has wrapped) is usable only when all
  of its tokens are a prefix of the prompt; engines store such states at fixed strides during
  prefill (checkpoints) so that branches still find one.

At least one prompt token is always left to compute, so that there are logits to sample from
(``recompute``: llama.cpp leaves two, see ``engines/llama/engine.py``). An engine whose live state already
holds part of the prompt passes that length to :meth:`PromptCache.lookup`, which resumes a stored
state only when it saves more, so that the common case (the next turn of a chat) copies nothing.
Memory is bounded by an LRU over the bytes the stored states really occupy, and an entry count.

The cache never looks inside a state: an engine stores objects that follow :class:`CacheState`.
All methods may be called from any thread (``stats`` is read by the HTTP server).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class CacheState(Protocol):
    """An engine's model state after exactly the tokens it is stored under."""

    nbytes: int  # the bytes it occupies (read once, when stored)
    trimmable: bool  # whether it can resume from any shorter prefix of its tokens

    def resume(self, n: int, owned: bool) -> Any:
        """The engine's live state holding this state's first ``n`` tokens. ``owned``: the cache
        has dropped this state (a continuation will supersede it), so it may be changed in place;
        otherwise the result must share nothing that the engine will modify."""


@dataclass
class _Entry:
    tokens: np.ndarray  # int32
    state: CacheState
    nbytes: int
    trimmable: bool


class PromptCache:
    """Stored states keyed by their token ids: longest-prefix lookup, LRU eviction by bytes."""

    def __init__(self, max_bytes: int, max_entries: int = 64, recompute: int = 1):
        self.max_bytes, self.max_entries = max(0, int(max_bytes)), max(0, int(max_entries))
        self.recompute = max(1, int(recompute))  # trailing prompt tokens a lookup leaves to compute
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 0
        self._lock = threading.Lock()
        self._bytes = self._hits = self._misses = self._reused = self._evictions = self._rejected = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def lookup(self, prompt: Sequence[int], live: int = 0, least: int = 0) -> tuple[Any, int]:
        """``(live state, tokens it holds)`` for the best entry, or ``(None, 0)`` on a miss.
        ``live``: how many leading prompt tokens the engine's own live state holds and can keep;
        an entry is resumed only if it saves more, else the answer is ``(None, live)``. ``least``:
        neither is reused below that many tokens (a miss)."""
        query = np.asarray(prompt, dtype=np.int32)
        live = live if live >= least else 0
        with self._lock:
            best = self._best(query) if self._entries and len(query) > self.recompute else None
            if best is not None and best[1] < least:
                best = None
            if best is None or best[1] <= live:
                if live > 0:
                    self._hits += 1
                    self._reused += live
                else:
                    self._misses += 1
                return None, max(live, 0)
            key, reuse, owned = best
            entry = self._entries[key]
            if owned:
                self._remove(key)
            else:
                self._entries.move_to_end(key)
            self._hits += 1
            self._reused += reuse
        return entry.state.resume(reuse, owned), reuse

    def peek(self, prompt: Sequence[int]) -> int:
        """How many prompt tokens :meth:`lookup` would resume from a stored entry (0: none);
        changes nothing, counts nothing."""
        query = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            best = self._best(query) if self._entries and len(query) > self.recompute else None
        return best[1] if best is not None else 0

    def record(self, reused: int) -> None:
        """Count a request that reused ``reused`` prompt tokens from elsewhere (an engine's running
        sequences) without a lookup; 0 is a miss."""
        with self._lock:
            if reused > 0:
                self._hits += 1
                self._reused += reused
            else:
                self._misses += 1

    def insert(self, tokens: Sequence[int], state: CacheState) -> bool:
        """Store ``state`` under ``tokens``; False when it is larger than the whole budget. Entries
        it makes redundant (shorter prefixes, when it is trimmable) are dropped."""
        key_tokens = np.array(tokens, dtype=np.int32)
        nbytes, trimmable = int(state.nbytes), bool(state.trimmable)
        n = len(key_tokens)
        with self._lock:
            if not n or nbytes > self.max_bytes or not self.max_entries:
                self._rejected += 1
                return False
            if self._entries:
                keys = list(self._entries)
                entries = list(self._entries.values())
                common = _common_prefix_lengths(entries, key_tokens)
                for key, entry, c in zip(keys, entries, common):
                    length = len(entry.tokens)
                    if c == n and (length == n or entry.trimmable):  # it already covers this state
                        self._entries.move_to_end(key)
                        return True
                    if trimmable and c == length:  # a prefix of it, which it can be trimmed to
                        self._remove(key)
            while self._entries and (self._bytes + nbytes > self.max_bytes
                                     or len(self._entries) >= self.max_entries):
                self._remove(next(iter(self._entries)))
                self._evictions += 1
            self._entries[self._next_id] = _Entry(key_tokens, state, nbytes, trimmable)
            self._next_id += 1
            self._bytes += nbytes
            return True

    def resize(self, max_bytes: int) -> None:
        """A new byte budget (an engine's live sequences need more memory, or less): least recently
        used entries are evicted until the stored states fit it."""
        with self._lock:
            self.max_bytes = max(0, int(max_bytes))
            while self._entries and self._bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self._evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "max_entries": self.max_entries, "hits": self._hits, "misses": self._misses,
                    "tokens_reused": self._reused, "evictions": self._evictions,
                    "rejected": self._rejected}

    def _best(self, query: np.ndarray) -> tuple[int, int, bool] | None:
        """(key, tokens to reuse, owned) of the entry that saves the most prompt tokens. Ties go to
        an entry the next state will supersede (no copy), then to the most recently used."""
        keys = list(self._entries)
        entries = list(self._entries.values())
        common = _common_prefix_lengths(entries, query)
        best, best_rank = None, None
        for i, (key, entry, c) in enumerate(zip(keys, entries, common)):
            whole = c == len(entry.tokens)  # the entry is a prefix of the prompt
            if entry.trimmable:
                reuse = min(int(c), len(query) - self.recompute)
            else:
                reuse = int(c) if whole and c <= len(query) - self.recompute else 0
            rank = (reuse, whole and entry.trimmable, i)
            if reuse > 0 and (best_rank is None or rank > best_rank):
                best, best_rank = (key, reuse, whole and entry.trimmable), rank
        return best

    def _remove(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes


def _common_prefix_lengths(entries: list[_Entry], query: np.ndarray) -> np.ndarray:
    """For each entry, how many leading tokens it shares with ``query``: one vectorised comparison
    of all entries' tokens (each cut to the query's length) laid end to end."""
    rows = [e.tokens[: len(query)] for e in entries]
    lengths = np.array([len(r) for r in rows])
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    position = np.arange(lengths.sum()) - np.repeat(starts, lengths)
    flat = np.concatenate(rows)
    mismatch = np.where(flat == query[position], np.repeat(lengths, lengths), position)
    return np.minimum.reduceat(mismatch, starts)


def available_memory() -> int:
    """Bytes of RAM the system can still give (Linux MemAvailable; elsewhere half of physical)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


# A quarter of what is free once the weights are loaded: the rest stays for the live state of a full
# context, activations, the allocator's own cache and the other models of the server, which load
# after this one. Capped because past a few conversations' worth, extra entries are rarely hit again.
DEFAULT_CACHE_CAP = 16 * 2**30


def default_cache_bytes(free_bytes: int) -> int:
    return max(0, min(free_bytes // 4, DEFAULT_CACHE_CAP))
