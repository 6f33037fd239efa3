"""Benchmark cases and the chat prompts they turn into, at exact token lengths where a case says so.

A case is a system message, a user message with an optional ``{context}`` slot, and an optional target
length of the whole rendered chat prompt (template included, as the server will tokenize it). The
context is cut from a long generated text to the number of characters whose prompt is exactly that
many tokens long. Every request also starts with its own session tag, so no request can reuse another
request's prompt from a server's prefix cache unless the case means it to (``extends``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

from mesh_llm.bench.tokenizer import PromptTokenizer

MAIN, CACHE_SEQUENCE = "main", "cache-sequence"


@dataclass(frozen=True)
class Case:
    """One kind of request. ``extends`` names an earlier case of the same sequence: this case's user
    message is that case's user message plus this one's ``user``, so its prompt extends the other's."""

    name: str
    user: str
    system: str = "You are a helpful assistant."
    context: str | None = None  # "briefing", "records", "code", or literal text to repeat
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    phase: str = MAIN
    extends: str | None = None


@dataclass(frozen=True)
class Prompt:
    """The messages of one request and the token count of their rendered chat prompt."""

    messages: list[dict] = field(hash=False)
    tokens: int


# the long-prompt cases' request: a briefing of the case's length, summarized
SUMMARIZE_BRIEFING = ("Here is this week's project briefing.\n\n{context}\n\nSummarize the briefing for an "
                      "executive in five bullet points.")

DEFAULT_CASES = [
    Case("short-chat", "Explain in a few sentences why the sky is blue."),
    Case("long-briefing", SUMMARIZE_BRIEFING, context="briefing", prompt_tokens=1024),
    Case("context-extraction", "Customer records:\n\n{context}\n\nList every customer who lives in Porto, "
         "with their balance.", context="records", prompt_tokens=512,
         system="You extract facts from the text you are given. Answer only from it."),
    Case("code-context", "```python\n{context}\n```\n\nExplain what this module does and point out one bug.",
         context="code", prompt_tokens=512, system="You are a senior Python reviewer."),
]

CACHE_CASES = [
    Case("cache-base", "Here is this week's project briefing.\n\n{context}\n\nWhich teams shipped something?",
         context="briefing", prompt_tokens=768, phase=CACHE_SEQUENCE),
    Case("cache-extend", "\n\nAlso: which of those changes lowered an error rate?", phase=CACHE_SEQUENCE,
         extends="cache-base"),
]

# `--concurrency`: N of these at once, each with its own session tag, so no stream reuses another's prompt.
CONCURRENCY_CASES = [
    Case("briefing-640", SUMMARIZE_BRIEFING, context="briefing", prompt_tokens=640),
]

# `--cases lengths`: one stream's first token and decode rate against the prompt's length (a short
# chat turn, a file, a long agent context), 256 tokens each so the decode rate is read at each depth.
LENGTH_CASES = [
    Case(f"prompt-{n}", SUMMARIZE_BRIEFING, context="briefing", prompt_tokens=n, max_tokens=256)
    for n in (128, 512, 2048)
]

CASE_SETS = {"default": DEFAULT_CASES, CACHE_SEQUENCE: CACHE_CASES, "concurrency": CONCURRENCY_CASES,
             "lengths": LENGTH_CASES}


def load_cases(names: list[str]) -> list[Case]:
    """The cases of each named set or JSON file, in order. A JSON file holds ``{"cases": [{...}]}``
    (or a bare list) with the fields of :class:`Case`."""
    cases: list[Case] = []
    for name in names:
        if name in CASE_SETS:
            cases += CASE_SETS[name]
            continue
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--cases {name!r} is neither {' nor '.join(CASE_SETS)} nor a JSON file")
        data = json.loads(path.read_text())
        items = data["cases"] if isinstance(data, dict) else data
        known = {f.name for f in fields(Case)}
        for item in items:
            unknown = set(item) - known
            if unknown or "name" not in item or "user" not in item:
                raise ValueError(f"{path}: a case needs 'name' and 'user'; unknown fields: {sorted(unknown)}")
            cases.append(Case(**item))
    seen: set[str] = set()
    for case in cases:
        if case.name in seen:
            raise ValueError(f"case {case.name!r} appears twice")
        if case.phase not in (MAIN, CACHE_SEQUENCE):
            raise ValueError(f"case {case.name!r}: phase must be {MAIN!r} or {CACHE_SEQUENCE!r}")
        if case.extends and case.extends not in seen:
            raise ValueError(f"case {case.name!r} extends {case.extends!r}, which must come before it")
        if case.extends and case.context:
            raise ValueError(f"case {case.name!r}: an extending case adds text, not another context")
        seen.add(case.name)
    return cases


class PromptBuilder:
    """Turns cases into chat messages with ``tokenizer``; each prompt is tagged with ``session``."""

    def __init__(self, tokenizer: PromptTokenizer):
        self.tokenizer = tokenizer

    def build(self, case: Case, session: str, base: Prompt | None = None) -> Prompt:
        """The prompt of ``case``; ``base`` is the prompt of the case it extends."""
        if case.extends:
            if base is None:
                raise ValueError(f"case {case.name!r} needs the prompt of {case.extends!r}")
            messages = [dict(m) for m in base.messages]
            messages[-1]["content"] += case.user
            return Prompt(messages, self.tokenizer.count(messages))
        system = f"Session {session}. {case.system}"
        if case.context is None:
            messages = self._messages(system, case.user)
            tokens = self.tokenizer.count(messages)
            if case.prompt_tokens not in (None, tokens):
                raise ValueError(f"case {case.name!r}: its prompt is {tokens} tokens, not {case.prompt_tokens}; "
                                 "give it a context to fill to an exact length")
            return Prompt(messages, tokens)
        text = context_text(case.context, 8 * (case.prompt_tokens or 1024) + 4096)

        def count(chars: int) -> int:
            return self.tokenizer.count(self._messages(system, case.user.replace("{context}", text[:chars])))

        chars = len(text) if case.prompt_tokens is None else self._search(case, count, len(text))
        messages = self._messages(system, case.user.replace("{context}", text[:chars]))
        return Prompt(messages, count(chars))

    def _messages(self, system: str, user: str) -> list[dict]:
        if self.tokenizer.supports_system:
            return [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return [{"role": "user", "content": f"{system}\n\n{user}"}]

    @staticmethod
    def _search(case: Case, count, limit: int) -> int:
        """The number of context characters whose prompt is exactly ``case.prompt_tokens`` long.

        Token counts grow with the text but not strictly (a character can merge into the previous
        token), so: bisect to the first length that reaches the target, then look around it."""
        target = case.prompt_tokens
        if count(0) > target or count(limit) < target:
            raise ValueError(f"case {case.name!r}: {target} tokens is out of reach "
                             f"({count(0)} to {count(limit)} with this tokenizer)")
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi) // 2
            if count(mid) < target:
                lo = mid + 1
            else:
                hi = mid
        for delta in range(64):
            for chars in (lo - delta, lo + delta):
                if 0 <= chars <= limit and count(chars) == target:
                    return chars
        raise ValueError(f"case {case.name!r}: no context length gives exactly {target} tokens")


def context_text(kind: str, chars: int) -> str:
    """At least ``chars`` characters of deterministic text of a kind; other values repeat as given."""
    make = {"briefing": _briefing, "records": _records, "code": _code}.get(kind)
    if make is None:
        return (kind + "\n") * (chars // max(1, len(kind) + 1) + 1)
    rng, parts, size = random.Random(kind), [], 0
    while size < chars:
        parts.append(make(rng, len(parts) + 1))
        size += len(parts[-1]) + 1
    return "\n".join(parts)


_TEAMS = ["Lisbon", "Oslo", "Nairobi", "Austin", "Seoul", "Porto", "Lyon", "Quito", "Dublin", "Pune"]
_SYSTEMS = ["billing service", "search index", "mobile app", "data pipeline", "login flow",
            "pricing engine", "support portal", "release tooling", "payments gateway", "report builder"]
_CHANGES = ["moved the {s} to the new cluster", "rewrote the retry logic of the {s}", "shipped a redesign of the {s}",
            "added caching in front of the {s}", "split the {s} into two services", "fixed a memory leak in the {s}"]
_EFFECTS = ["error rates fell {n}%", "p95 latency dropped by {n} ms", "costs rose {n}% for now",
            "support tickets fell by {n}", "throughput grew {n}%", "nothing measurable changed yet"]
_NAMES = ["Ana Silva", "Bo Chen", "Carla Mendes", "David Okoro", "Eva Novak", "Farid Haddad", "Grace Kim",
          "Hugo Laurent", "Ines Duarte", "Jonas Berg", "Kofi Mensah", "Lena Vogel", "Mateo Rossi"]
_CITIES = ["Porto", "Lisbon", "Madrid", "Berlin", "Porto", "Accra", "Toronto", "Osaka", "Lima", "Oslo"]


def _briefing(rng: random.Random, i: int) -> str:
    team, system = rng.choice(_TEAMS), rng.choice(_SYSTEMS)
    change = rng.choice(_CHANGES).format(s=system)
    effect = rng.choice(_EFFECTS).format(n=rng.randint(2, 40))
    owner = rng.choice(_NAMES)
    return (f"{i}. On day {rng.randint(1, 30)} the {team} team {change}; {effect}. {owner} owns the "
            f"follow-up and expects a review by week {rng.randint(1, 52)}.")


def _records(rng: random.Random, i: int) -> str:
    return (f"Record {i:04d}: name={rng.choice(_NAMES)}; city={rng.choice(_CITIES)}; "
            f"plan={rng.choice(['free', 'silver', 'gold'])}; balance={rng.randint(0, 9999)}.{rng.randint(0, 99):02d}; "
            f"joined=20{rng.randint(10, 24)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}.")


def _code(rng: random.Random, i: int) -> str:
    op, other = rng.choice([("+", "-"), ("*", "//"), ("-", "+")])
    return (f"def step_{i}(values, factor={rng.randint(2, 9)}):\n"
            f"    \"\"\"Scale the {rng.choice(['positive', 'even', 'recent'])} values and total them.\"\"\"\n"
            f"    total = 0\n"
            f"    for index, value in enumerate(values):\n"
            f"        if value % factor == {rng.randint(0, 1)}:\n"
            f"            total = total {op} value * factor\n"
            f"        elif index > {rng.randint(1, 5)}:\n"
            f"            total = total {other} index\n"
            f"    return total\n")
