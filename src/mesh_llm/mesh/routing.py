"""Which node should serve a request, in order of preference. Pure policy: no I/O, no clock.

The order: an explicit ``x-mesh-target`` first (``x-mesh-exclude`` removes nodes), then the node that
last served the same prompt prefix (system prompt + tools + first user message) so its prompt cache
hits, unless it is much busier than another, then the least loaded node whose context fits the
prompt. A prefix this entry node has not routed yet has a home instead: the node a hash of the
prefix picks among those that can take it (rendezvous hashing), kept on the same terms. So every
entry node sends a conversation to the same node, whatever load figures each happens to hold for
the seconds after a turn, and different conversations still spread over the nodes. A node that
failed this entry node for the model lately (demoted) comes after every other whose context fits,
whatever its load says."""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from dataclasses import dataclass

PREFIX_CHARS = 256  # of a text-completion prompt: what a conversation's turns share
PREFIX_TOKENS = 64  # of a token-id prompt
CHARS_PER_TOKEN = 4  # for estimating a prompt's length without its model's tokenizer


@dataclass(frozen=True)
class Candidate:
    id: str
    local: bool
    context_length: int | None
    active: int = 0
    waiting: int = 0
    max_batch: int = 1
    free_kv: int | None = None
    reachable: bool = True  # this node's last heartbeat to it was answered
    demoted: bool = False  # it failed a request for this model lately (hung, refused, not serving it)

    @property
    def busy(self) -> float:
        """Work per batch slot: under 1 the node has spare batch room, over 1 requests wait."""
        return (self.active + self.waiting) / max(self.max_batch, 1)

    def saturated(self, need_tokens: int) -> bool:
        full_kv = self.free_kv is not None and self.free_kv < need_tokens
        return self.active + self.waiting > self.max_batch or full_kv

    def fits(self, need_tokens: int) -> bool:
        return self.context_length is None or need_tokens <= self.context_length


def order(candidates: list[Candidate], *, need_tokens: int, prefix: str | None = None,
          affinity: str | None = None, target: str | None = None,
          exclude: frozenset[str] = frozenset()) -> list[Candidate]:
    """Candidates, best first; every candidate stays in the list, as a fallback."""
    pool = [c for c in candidates if c.id not in exclude]
    salt = prefix if prefix is not None else str(random.random())
    pool.sort(key=lambda c: (not c.reachable, not c.fits(need_tokens), c.demoted, c.saturated(need_tokens),
                             c.busy, _rendezvous(salt, c.id)))
    if affinity is None and prefix is not None:
        able = [c for c in pool if c.reachable and c.fits(need_tokens) and not c.demoted]
        affinity = min(able, key=lambda c: _rendezvous(prefix, c.id)).id if able else None
    sticky = next((c for c in pool if c.id == affinity), None)
    if sticky is not None and pool and sticky is not pool[0] and _keeps_affinity(sticky, pool[0], need_tokens):
        pool.remove(sticky)
        pool.insert(0, sticky)
    chosen = next((c for c in pool if c.id == target), None)
    if chosen is not None:
        pool.remove(chosen)
        pool.insert(0, chosen)
    return pool


def _keeps_affinity(sticky: Candidate, best: Candidate, need_tokens: int) -> bool:
    """The cache-warm node keeps the conversation unless it cannot take it or is much busier: it
    has requests waiting (no spare batch room) while the best other node is a full batch less busy."""
    if not sticky.reachable or sticky.demoted or not sticky.fits(need_tokens):
        return False
    much_busier = sticky.saturated(need_tokens) and sticky.busy - best.busy >= 1.0
    return not much_busier


def _rendezvous(salt: str, node_id: str) -> str:
    return hashlib.blake2b(f"{salt}\0{node_id}".encode(), digest_size=8).hexdigest()


def prefix_key(model: str, body: dict) -> str | None:
    """A digest of what a conversation's requests share at their start, or None when the body has
    no recognisable prompt: chat messages up to the first user message with the tools, a Responses
    API call's instructions, tools and first input, or a text prompt's first characters."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list):
        head = []
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        parts = [head, body.get("tools")]
    elif "input" in body:
        given = body["input"]
        first = given[0] if isinstance(given, list) and given else given
        if isinstance(given, list):
            first = next((i for i in given if isinstance(i, dict) and i.get("role") == "user"), first)
        parts = [body.get("instructions"), body.get("tools"), first]
    elif isinstance(prompt, str):
        parts = [prompt[:PREFIX_CHARS]]
    elif isinstance(prompt, list) and prompt:
        parts = [prompt[0][:PREFIX_CHARS]] if isinstance(prompt[0], str) else [prompt[:PREFIX_TOKENS]]
    else:
        return None
    text = json.dumps([model, *parts], sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def estimate_tokens(body: dict) -> int:
    """Prompt plus requested output, in tokens, without the model's tokenizer: generous enough to
    rank nodes by context size; a node that still finds the prompt too long answers 400 and the next
    one is tried."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        count = len(prompt)
    else:
        parts = [body.get(k) for k in ("messages", "input", "instructions", "prompt", "tools")]
        text = json.dumps([p for p in parts if p is not None], ensure_ascii=False, default=str)
        count = len(text.encode()) // CHARS_PER_TOKEN
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                  if isinstance(body.get(k), int) and not isinstance(body.get(k), bool)), 0)
    return count + max(limit, 0)


class Affinity:
    """Which node last served each prompt prefix: a bounded LRU, per entry node."""

    def __init__(self, max_entries: int = 10_000):
        self.max_entries = max_entries
        self._nodes: OrderedDict[str, str] = OrderedDict()

    def get(self, prefix: str | None) -> str | None:
        if prefix is None or prefix not in self._nodes:
            return None
        self._nodes.move_to_end(prefix)
        return self._nodes[prefix]

    def record(self, prefix: str | None, node_id: str) -> None:
        if prefix is None:
            return
        self._nodes[prefix] = node_id
        self._nodes.move_to_end(prefix)
        while len(self._nodes) > self.max_entries:
            self._nodes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._nodes)
