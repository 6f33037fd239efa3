"""The engine-agnostic prompt cache with fake states: lookup over all entries, trimmable and
checkpoint-only states, ownership, redundancy, LRU eviction by bytes, the entry cap, stats."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from mesh_llm.engines.prompt_cache import DEFAULT_CACHE_CAP, PromptCache, default_cache_bytes


@dataclass
class FakeState:
    tokens: list[int]
    trimmable: bool = True
    nbytes: int = -1
    resumed: list = field(default_factory=list)

    def __post_init__(self):
        if self.nbytes < 0:
            self.nbytes = 10 * len(self.tokens)

    def resume(self, n: int, owned: bool):
        assert 0 < n <= len(self.tokens) and (self.trimmable or n == len(self.tokens))
        self.resumed.append((n, owned))
        return self.tokens[:n], owned


def store(cache: PromptCache, tokens, trimmable=True, nbytes=-1) -> FakeState:
    state = FakeState(list(tokens), trimmable, nbytes)
    cache.insert(tokens, state)
    return state


def test_miss_then_exact_repeat_keeps_one_token_to_compute():
    cache = PromptCache(10_000)
    assert cache.lookup([1, 2, 3]) == (None, 0)
    state = store(cache, [1, 2, 3])
    (tokens, owned), reused = cache.lookup([1, 2, 3])
    assert (tokens, reused) == ([1, 2], 2)
    assert owned  # the next entry (the same prompt and more) supersedes it
    assert cache.stats()["entries"] == 0 and state.resumed == [(2, True)]
    assert cache.lookup([7]) == (None, 0)  # a one-token prompt has nothing to reuse


def test_extension_takes_the_entry_and_branch_copies_the_longest_of_all_entries():
    cache = PromptCache(10_000)
    doc = list(range(100, 140))
    store(cache, doc + [1, 2, 3])
    store(cache, [5, 6, 7, 8])  # the most recent entry shares nothing
    (tokens, owned), reused = cache.lookup(doc + [9, 9])
    assert (reused, owned) == (40, False)  # a branch: trimmed back, the entry stays
    assert tokens == doc and cache.stats()["entries"] == 2
    (tokens, owned), reused = cache.lookup(doc + [1, 2, 3, 4])
    assert (reused, owned) == (43, True)  # a continuation: handed over
    assert cache.stats()["entries"] == 1


def test_a_lookup_reuses_nothing_under_its_least():
    """``least`` (the MLX engine's minimum reuse while reading prompts together): a stored entry or
    a live prefix under it is not reused, and the lookup counts a miss; from it up, as before."""
    cache = PromptCache(10_000)
    doc = list(range(100, 140))
    state = store(cache, doc)
    assert cache.lookup(doc[:10] + [9], least=16) == (None, 0)
    assert cache.lookup(doc + [9], live=12, least=64) == (None, 0)
    assert cache.lookup(doc[:20] + [9] * 10, live=25, least=16) == (None, 25)  # live holds more
    assert state.resumed == [] and cache.stats()["misses"] == 2
    (tokens, _), reused = cache.lookup(doc + [9], live=12, least=16)
    assert (tokens, reused) == (doc, 40)


def test_checkpoints_are_used_only_when_wholly_a_prefix():
    cache = PromptCache(10_000)
    base = list(range(1, 33))
    for end in (8, 16, 24, 32):
        store(cache, base[:end], trimmable=False)
    (tokens, owned), reused = cache.lookup(base[:20] + [99])
    assert (reused, owned, tokens) == (16, False, base[:16])  # the longest not past the shared prefix
    assert cache.lookup(base[:32])[1] == 24  # the whole-prompt state would leave nothing to compute
    assert cache.lookup([0] + base)[1] == 0
    assert cache.stats()["entries"] == 4  # never taken: a later state cannot be cut back to them


def test_trimmable_insert_drops_its_prefixes_and_covered_inserts_are_skipped():
    cache = PromptCache(10_000)
    store(cache, [1, 2])
    store(cache, [1, 2, 3], trimmable=False)
    store(cache, [1, 9])
    store(cache, [1, 2, 3, 4])  # trimmable: [1, 2] and the [1, 2, 3] checkpoint are redundant
    assert cache.stats()["entries"] == 2
    assert cache.stats()["bytes"] == 20 + 40
    assert not store(cache, [1, 2, 3]).resumed and cache.stats()["entries"] == 2  # covered
    store(cache, [1, 2, 3, 4, 5], trimmable=False)  # not trimmable: keeps its prefixes
    assert cache.stats()["entries"] == 3


def test_lru_eviction_by_bytes_and_count_and_oversized_entries():
    cache = PromptCache(max_bytes=100, max_entries=3)
    store(cache, [1], trimmable=False, nbytes=40)  # checkpoints: a lookup leaves them stored
    store(cache, [2], trimmable=False, nbytes=40)
    cache.lookup([1, 5])  # [1] becomes the most recently used
    store(cache, [3], trimmable=False, nbytes=40)  # evicts [2]
    assert cache.lookup([2, 5])[1] == 0 and cache.lookup([1, 5])[1] == 1
    assert not cache.insert([4], FakeState([4], nbytes=101))  # larger than the whole budget
    store(cache, [5], nbytes=10)
    store(cache, [6], nbytes=10)  # the count cap evicts the least recently used, [3]
    assert cache.lookup([3, 5])[1] == 0 and cache.lookup([1, 5])[1] == 1
    stats = cache.stats()
    assert stats["entries"] == 3 and stats["bytes"] == 60
    assert stats["rejected"] == 1 and stats["evictions"] == 2


def test_randomized_lookups_match_a_brute_force_search_and_stay_in_budget():
    rng = random.Random(5)
    cache = PromptCache(max_bytes=3_000, max_entries=12)
    stored: dict[tuple, FakeState] = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    for _ in range(400):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 40)] + [rng.randrange(50)
                                                                  for _ in range(rng.randrange(0, 8))]
        live = {k: s for k, s in stored.items() if s in _states(cache)}

        def usable(tokens, state, prompt=prompt):
            common = next((i for i, (a, b) in enumerate(zip(tokens, prompt)) if a != b),
                          min(len(tokens), len(prompt)))
            if state.trimmable:
                return min(common, len(prompt) - 1)
            return len(tokens) if common == len(tokens) < len(prompt) else 0

        expected = max([usable(list(k), s) for k, s in live.items()], default=0)
        result, reused = cache.lookup(prompt)
        assert reused == expected
        if result is not None:
            assert result[0] == prompt[:reused]
        extra = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        state = store(cache, prompt + extra, trimmable=rng.random() < 0.6,
                      nbytes=rng.randrange(1, 800))
        stored[tuple(prompt + extra)] = state
        stats = cache.stats()
        assert stats["bytes"] <= 3_000 and stats["entries"] <= 12
        assert stats["bytes"] == sum(s.nbytes for s in _states(cache))


def _states(cache: PromptCache) -> list[FakeState]:
    return [e.state for e in cache._entries.values()]


def test_disabled_cache_stores_nothing():
    cache = PromptCache(0)
    assert not cache.enabled
    assert not cache.insert([1, 2], FakeState([1, 2]))
    assert cache.lookup([1, 2, 3]) == (None, 0)


def test_stats_count_hits_misses_and_reused_tokens():
    cache = PromptCache(10_000)
    store(cache, [1, 2, 3, 4])
    cache.lookup([1, 2, 3, 9])
    cache.lookup([8, 9])
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["tokens_reused"]) == (1, 1, 3)
    cache.clear()
    assert cache.stats()["entries"] == cache.stats()["bytes"] == 0


@pytest.mark.parametrize("free, expected", [(8 * 2**30, 2 * 2**30), (2**40, DEFAULT_CACHE_CAP), (-5, 0)])
def test_default_cache_bytes(free, expected):
    assert default_cache_bytes(free) == expected


def test_the_engines_live_state_wins_unless_an_entry_saves_more():
    cache = PromptCache(10_000)
    doc = list(range(100, 120))
    state = store(cache, doc + [1, 2])
    assert cache.lookup(doc + [7, 8], live=20) == (None, 20)  # a tie: the live state, no copy
    assert state.resumed == [] and cache.stats()["entries"] == 1
    (tokens, owned), reused = cache.lookup(doc + [1, 2, 3], live=10)
    assert (tokens, reused, owned) == (doc + [1, 2], 22, True)
    assert cache.lookup([5, 6, 7], live=0) == (None, 0)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["tokens_reused"]) == (2, 1, 42)


def test_recompute_leaves_that_many_prompt_tokens_to_compute():
    cache = PromptCache(10_000, recompute=2)
    store(cache, [1, 2, 3, 4])
    assert cache.lookup([1, 2, 3, 4])[1] == 2  # an exact repeat computes its last two tokens
    store(cache, [1, 2, 3], trimmable=False)
    assert cache.lookup([1, 2, 3, 9])[1] == 0  # a checkpoint must leave two to compute
    assert cache.lookup([1, 2, 3, 9, 9])[1] == 3
    assert cache.lookup([1, 2]) == (None, 0)


def test_peek_tells_what_a_lookup_would_reuse_and_changes_nothing_and_record_counts_outside_reuse():
    cache = PromptCache(10_000)
    doc = list(range(100, 120))
    state = store(cache, doc + [1, 2])
    before = cache.stats()
    assert cache.peek(doc + [7, 8]) == 20 and cache.peek(doc + [1, 2, 3]) == 22 and cache.peek([5, 6]) == 0
    assert cache.stats() == before and state.resumed == []  # nothing handed over, nothing counted
    cache.record(30)  # a sequence that shared a running one's cells
    cache.record(0)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["tokens_reused"], stats["entries"]) == (1, 1, 30, 1)


def test_resize_evicts_least_recently_used_entries_until_they_fit():
    cache = PromptCache(1_000)
    for start in (10, 20, 30):
        store(cache, list(range(start, start + 10)))  # 100 bytes each
    cache.lookup(list(range(10, 15)) + [99])  # a branch of the oldest: now the most recent
    cache.resize(250)
    stats = cache.stats()
    assert (stats["entries"], stats["bytes"], stats["max_bytes"], stats["evictions"]) == (2, 200, 250, 1)
    assert cache.lookup(list(range(20, 30)) + [99]) == (None, 0)  # the one evicted
    cache.resize(1_000)  # growing evicts nothing
    assert cache.stats()["entries"] == 2 and not store(cache, [1] * 20, nbytes=900).resumed
    assert cache.stats()["bytes"] <= 1_000
