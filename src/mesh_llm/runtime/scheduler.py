"""The step planner both engines share: which sequences run, how many prompt tokens each reads, which
one waits for a prefix another is reading, and which gives its memory back when the KV runs out.

As in vLLM v1, the scheduler decides and an engine (a *runner*, :class:`Runner`) executes. Each step
is planned from facts the runner reports (whether the sequences' KV fits its memory, how much of a
prompt it could reuse now, where a prompt chunk may end) and nothing else: no model, no arrays, no
threads, no I/O, so the policy is tested with a scripted runner in milliseconds. The policy:

- **Admission**, first come first served: a sequence is admitted while fewer than ``max_batch`` run
  and their KV fits with its claim; sequences waiting to resume after preemption go first, and a
  sequence that does not fit keeps later ones waiting (a long prompt is never starved).
- **Claims**: the tokens a sequence is given room for: its prompt and the runner's
  ``answer_headroom`` answer tokens at first, then what it holds and its next token, never past its
  end; a runner whose sequences may not be preempted (``reserves_answers``) gets whole answers
  claimed instead.
- **A step**: one decode row for every sequence whose prompt is read, then prompt chunks in arrival
  order within the token budget (and the runner's ``pass_tokens``). Chunks end where the runner's
  ``chunk_end`` says (multiples of its prefill step, so a prompt is split the same way alone or
  batched); the first sequence in line always progresses, cut to the budget if need be, and a later
  one reads only a whole chunk.
- **Prefix waits**: a newcomer whose prompt shares with an earlier sequence still reading its own a
  longer prefix than it could reuse now waits for that sequence to read it, then shares it (one
  document, many questions), rather than computing it twice.
- **Preemption**: when the running sequences' claims outgrow the memory, the newest but the oldest
  gives its state back (to the runner's prompt cache) and waits to read again what it held and the
  tokens it sampled since, then samples on; the oldest preempted sequence resumes first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class NoCapacity(Exception):
    """The sequence cannot be admitted now (every slot, or the memory its claim needs, is in use); it
    waits, and is offered again once a sequence has ended."""


@dataclass
class Chunk:
    """Prompt positions ``[start, end)`` of sequence ``seq`` to read this step; ``end`` equal to the
    prompt's length makes it the last, and the sequence samples its first token in this step."""

    seq: int
    start: int
    end: int


@dataclass
class Plan:
    """One step: the sequences that feed their last token and sample the next (``decode``) and the
    prompt chunks to read (``chunks``). A runner that cannot read a chunk this step adds its
    sequence to ``deferred``; it is planned again."""

    decode: list[int]
    chunks: list[Chunk]
    deferred: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks)


class Runner(Protocol):
    """What the scheduler needs of an engine (``engines/base.Engine`` implements it)."""

    @property
    def max_batch(self) -> int:
        """The most sequences held at once."""

    @property
    def pass_tokens(self) -> int | None:
        """The most tokens one forward pass holds, decode rows included (None: no limit)."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether a sequence can start from a prefix another one holds (so waiting for it pays)."""

    @property
    def least_shared_wait(self) -> int:
        """A shared prefix shorter than this is read again rather than waited for."""

    @property
    def reserves_answers(self) -> bool:
        """Whether claims hold whole answers (the runner's sequences must never be preempted)."""

    @property
    def answer_headroom(self) -> int:
        """Answer tokens a sequence is given room for beyond its prompt before it holds them: not
        max_tokens, which clients set high or leave to the context."""

    def fits(self, claims: Mapping[int, int], new: tuple[Sequence[int], int, int] | None = None) -> bool:
        """Whether the held sequences, each at its claim in tokens, fit the KV memory, and ``new``
        (a sequence to admit or resume: its prompt, claim and max_tokens) beside them; a runner may
        ask a starting sequence for more room than its claim. It may free what no running sequence
        needs (ended sequences' cells, rows left vacant) to make them fit."""

    def start_step(self) -> None:
        """A step begins: the runner may rearrange what it holds before any sequence begins."""

    def claimed(self, claims: Mapping[int, int]) -> None:
        """The running sequences' claims as they stand (after every admission, removal and plan), for
        a runner that sizes what it keeps beside them (its prompt cache)."""

    def reusable(self, seq: int) -> int:
        """Prompt tokens :meth:`begin` would reuse now, from the prompt cache or a live sequence."""

    def begin(self, seq: int) -> int:
        """Give ``seq`` its state, resumed from the longest prefix it can reuse; returns its length."""

    def chunk_end(self, start: int, stop: int, budget: int | None) -> int | None:
        """Where the next prompt chunk from ``start`` (toward ``stop``, the prompt's length) ends,
        within ``budget`` tokens (None: the whole chunk, however long); None: no chunk fits."""

    def run(self, plan: Plan) -> list[tuple[int, Any]]:
        """Execute ``plan``: one forward pass; returns ``(seq, step)`` for each token sampled."""

    def preempt(self, seq: int) -> list[tuple[int, Any]]:
        """Take back ``seq``'s state (offered to the prompt cache); returns any token it had
        sampled but not yet returned (a pipelined runner's step in flight)."""

    def readmit(self, seq: int, prompt: Sequence[int], max_tokens: int) -> None:
        """After :meth:`preempt`: ``seq`` reads ``prompt`` (what it held and sampled) again, then
        samples up to ``max_tokens`` more."""


class _Sequence:
    """A sequence as the scheduler sees it: its prompt, where reading it stands, what it sampled."""

    __slots__ = ("id", "order", "prompt", "max_tokens", "computed", "started", "sampled", "preempted")

    def __init__(self, seq: int, order: int, prompt: list[int], max_tokens: int):
        self.id, self.order, self.prompt, self.max_tokens = seq, order, prompt, max_tokens
        self.computed = 0  # prompt tokens its state holds
        self.started = False  # the runner gave it its state (:meth:`Runner.begin`)
        self.sampled: list[int] = []  # tokens sampled since its prompt was set
        self.preempted = False  # holds nothing; reads its prompt again once room frees

    @property
    def decoding(self) -> bool:
        return self.started and self.computed >= len(self.prompt)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens ``a`` and ``b`` (lists or arrays) share, up to ``limit``."""
    n = max(0, min(len(a), len(b), len(a) if limit is None else limit))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


class Scheduler:
    """Plans and runs the steps of one runner's sequences (see the module's docstring)."""

    def __init__(self, runner: Runner):
        self._runner = runner
        self._seqs: dict[int, _Sequence] = {}  # admitted, in arrival order
        self._arrivals = 0
        self.preemptions = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq: int) -> bool:
        return seq in self._seqs

    # -- sequences -------------------------------------------------------------------------------

    def admit(self, seq: int, prompt: Sequence[int], max_tokens: int) -> None:
        """Check that ``seq`` can be admitted now; raises :class:`NoCapacity` otherwise. The caller
        then registers it with the runner and calls :meth:`add`."""
        if len(self._seqs) >= self._runner.max_batch:
            raise NoCapacity(f"all {self._runner.max_batch} sequences are running")
        if any(s.preempted for s in self._seqs.values()):
            raise NoCapacity("preempted sequences wait to resume first")
        claim = self._claim_tokens(len(prompt), max_tokens, 0)
        if not self._runner.fits(self._claims(self._running()), (prompt, claim, max_tokens)):
            raise NoCapacity("the KV cells of the running sequences and this one would not fit the memory")

    def add(self, seq: int, prompt: Sequence[int], max_tokens: int) -> None:
        """Hold ``seq``, admitted (:meth:`admit`) and registered with the runner."""
        if seq in self._seqs:
            raise ValueError(f"sequence {seq} is already held")
        self._seqs[seq] = _Sequence(seq, self._arrivals, [int(t) for t in prompt], max_tokens)
        self._arrivals += 1
        self._runner.claimed(self._claims(self._running()))

    def remove(self, seq: int) -> bool:
        """Forget ``seq`` (the caller releases it in the runner first); whether it was held."""
        if self._seqs.pop(seq, None) is None:
            return False
        self._runner.claimed(self._claims(self._running()))
        return True

    def clear(self) -> None:
        self._seqs.clear()

    def claims(self) -> dict[int, int]:
        """Each running sequence's claim, in tokens."""
        return self._claims(self._running())

    # -- steps -----------------------------------------------------------------------------------

    def step(self, budget: int) -> list[tuple[int, Any]]:
        """Plan one step (``budget``: the most prompt tokens it reads), run it, and return the
        tokens sampled, ``(seq, step)`` in order."""
        self._runner.start_step()
        out, running, claims = self._make_room()
        plan = self._plan(budget, running, claims)
        if not plan:
            return out
        ran = self._runner.run(plan)
        for chunk in plan.chunks:
            if chunk.seq not in plan.deferred:
                self._seqs[chunk.seq].computed = chunk.end
        self._sampled(ran)  # what preempted sequences had in flight is counted already
        return out + ran

    def _plan(self, budget: int, running: list[_Sequence], claims: dict[int, int]) -> Plan:
        """This step's decode rows and prompt chunks; sequences start (:meth:`Runner.begin`) as
        their first chunk is planned."""
        self._runner.claimed(claims)
        plan = Plan([s.id for s in running if s.decoding], [])
        self._plan_chunks(plan, running, budget, patient=True)
        if not plan and any(not s.decoding for s in running):  # all wait on one another: the first goes
            self._plan_chunks(plan, running, budget, patient=False)
        return plan

    def _plan_chunks(self, plan: Plan, running: list[_Sequence], budget: int, patient: bool) -> None:
        runner = self._runner
        if runner.pass_tokens is not None:
            budget = min(budget, runner.pass_tokens - len(plan.decode))
        budget, progressed = max(1, budget), False
        for s in running:
            if budget <= 0:
                break
            if s.decoding:
                continue
            if not s.started:
                if patient and self._waits(s, running):
                    continue
                s.computed, s.started = runner.begin(s.id), True
            stop = len(s.prompt)
            if progressed:  # a later sequence reads a whole chunk or nothing
                end = runner.chunk_end(s.computed, stop, None)
                if end is None or end - s.computed > budget:
                    continue
            else:  # the first in line always progresses
                end = runner.chunk_end(s.computed, stop, budget)
                if end is None:
                    continue
            plan.chunks.append(Chunk(s.id, s.computed, end))
            budget -= end - s.computed
            progressed = True

    def _waits(self, s: _Sequence, running: list[_Sequence]) -> bool:
        """Whether ``s`` should let an earlier sequence read the prefix they share first, then
        start from it, rather than compute it again."""
        runner = self._runner
        if not runner.shares_prefixes:
            return False
        reusable = None
        for other in running:
            if other is s:
                return False
            if other.decoding:
                continue
            shared = min(common_prefix(other.prompt, s.prompt), len(s.prompt) - 1)
            if shared <= other.computed or shared < runner.least_shared_wait:
                continue
            if reusable is None:
                reusable = runner.reusable(s.id)
            if shared > reusable:
                return True
        return False

    # -- memory ----------------------------------------------------------------------------------

    def _make_room(self) -> tuple[list[tuple[int, Any]], list[_Sequence], dict[int, int]]:
        """Before a step: while the running sequences' claims do not fit, the newest but the oldest
        is preempted; then preempted sequences resume, oldest first, while they fit again. Returns
        the tokens preempted sequences had in flight, and the running sequences and their claims."""
        out: list[tuple[int, Any]] = []
        running = self._running()
        claims = self._claims(running)
        while not self._runner.fits(claims) and len(running) > 1:  # fits() may free what ended
            victim = running.pop()
            del claims[victim.id]
            out += self._preempt(victim)
        for s in self._seqs.values():
            if not s.preempted:
                continue
            claim = self._claim(s)
            if not self._runner.fits(claims, (s.prompt, claim, s.max_tokens)):
                break
            s.preempted, claims = False, {**claims, s.id: claim}
        if len(claims) != len(running):  # some resumed: in arrival order with the rest
            running = self._running()
        return out, running, claims

    def _preempt(self, s: _Sequence) -> list[tuple[int, Any]]:
        out = self._runner.preempt(s.id) if s.started else []
        self._sampled(out)
        s.prompt = s.prompt + s.sampled
        s.max_tokens = max(1, s.max_tokens - len(s.sampled))
        s.sampled, s.computed, s.started, s.preempted = [], 0, False, True
        self._runner.readmit(s.id, s.prompt, s.max_tokens)
        self.preemptions += 1
        return out

    def _running(self) -> list[_Sequence]:
        return [s for s in self._seqs.values() if not s.preempted]

    def _claims(self, seqs: list[_Sequence]) -> dict[int, int]:
        return {s.id: self._claim(s) for s in seqs}

    def _claim(self, s: _Sequence) -> int:
        held = len(s.prompt) + len(s.sampled) - 1 if s.decoding else s.computed  # its last token unfed
        return self._claim_tokens(len(s.prompt), s.max_tokens, held)

    def _claim_tokens(self, prompt: int, max_tokens: int, held: int) -> int:
        end = prompt + max_tokens
        if self._runner.reserves_answers:
            return end
        return min(end, max(prompt + min(max_tokens, self._runner.answer_headroom), held + 2))

    def _sampled(self, out: list[tuple[int, Any]]) -> None:
        for seq, step in out:
            s = self._seqs.get(seq)
            if s is not None:
                s.sampled.append(int(step.token))
