"""Running sequences alone and batched through the Engine interface, and comparing them: shared by
test_mlx_batch.py (this CPU) and test_mlx_gpu.py (the GPU machine)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mesh_llm.engines.base import NoCapacity, SamplingParams, Step


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits along the last axis."""
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@dataclass
class Case:
    """One sequence: its prompt, a maker of its sampling parameters (a constraint is stateful, so each
    run gets its own), how many tokens it takes before the test removes it, and the batch step at
    which it is added."""

    prompt: list[int]
    params: Callable[[], SamplingParams]
    tokens: int
    start: int = 0


_solo_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {case: steps}


def run_alone(engine, case: Case) -> list[Step]:
    """The case's sequence alone. A run without a constraint is computed once per engine and case:
    tests compare many batches with the same solo runs, which cost most of their time on a CPU."""
    params = case.params()
    runs = _solo_runs.setdefault(engine, {})
    key = (tuple(case.prompt), params, case.tokens) if params.constraint is None else None
    if key in runs:
        return list(runs[key])
    steps = engine.generate(case.prompt, params, case.tokens)
    out = list(itertools.islice(steps, case.tokens))
    steps.close()
    if key is not None:
        runs[key] = out
    return list(out)


def run_batched(engine, cases: list[Case], budget: int, leave: dict[int, int] | None = None,
                params: list[SamplingParams] | None = None,
                max_tokens: dict[int, int] | None = None) -> dict[int, list[Step]]:
    """Add each case at its start step (or, while the engine has no room for it, at the first step
    after with room, later cases waiting behind it, as the runtime does), step until every case has
    its tokens, removing each once it has them (as the runtime does), or ``leave[i]`` steps after it
    was added. ``max_tokens[i]``: what case i's add says it may reach (default: its tokens)."""
    params = params or [c.params() for c in cases]
    leave = leave or {}
    max_tokens = max_tokens or {}
    steps: dict[int, list[Step]] = {i: [] for i in range(len(cases))}
    added: dict[int, int] = {}
    done: set[int] = set()
    for k in itertools.count():
        for i, case in enumerate(cases):
            if i not in added and case.start <= k:
                try:
                    engine.add(i, case.prompt, params[i], max_tokens.get(i, case.tokens))
                except NoCapacity:
                    break
                added[i] = k
        for i in [i for i, at in added.items() if i not in done and leave.get(i) == k - at]:
            engine.remove(i)
            done.add(i)
        for seq, step in engine.step(budget):
            if seq in done:  # a step's second token, after the one that ended it: the runtime skips it too
                continue
            steps[seq].append(step)
            if len(steps[seq]) == cases[seq].tokens:
                engine.remove(seq)
                done.add(seq)
        if len(done) == len(cases):
            return steps


@dataclass
class Comparison:
    diverged_at: int | None  # first position whose token differs (a near-tie in the solo run)
    max_error: float  # largest logprob difference over the positions compared
    margin: float | None  # the solo run's top-2 margin where the tokens diverged


def compare(alone: list[Step], batched: list[Step], tolerance: float) -> Comparison:
    """Logprobs of the chosen token and of the alternatives both runs report, position by position,
    up to and including the first position whose token differs; that one must be a near-tie in the
    solo run (its top-2 margin within ``tolerance``)."""
    assert len(batched) == len(alone)
    worst = 0.0
    for k, (a, b) in enumerate(zip(alone, batched)):
        if a.logprob is not None:
            errors = [abs(a.logprob - b.logprob)]
            theirs = dict(b.top_logprobs)
            errors += [abs(lp - theirs[t]) for t, lp in a.top_logprobs if t in theirs]
            worst = max(worst, *errors)
            assert worst <= tolerance, f"position {k}: logprobs differ by {worst}"
        if a.token != b.token:
            assert len(a.top_logprobs) >= 2, f"position {k}: tokens differ with no margin to excuse it"
            margin = a.top_logprobs[0][1] - a.top_logprobs[1][1]
            assert margin <= tolerance, f"position {k}: tokens differ though the margin is {margin}"
            return Comparison(k, worst, margin)
    return Comparison(None, worst, None)


class AllowOnly:
    """A constraint that allows a fixed set of token ids; it records the tokens it is told of."""

    def __init__(self, ids: list[int], vocab: int):
        self._mask = np.zeros(vocab, dtype=bool)
        self._mask[ids] = True
        self.seen: list[int] = []

    def mask(self) -> np.ndarray:
        return self._mask

    failed = None  # it never gives up

    def advance(self, token: int) -> None:
        self.seen.append(token)


class Forced:
    """A constraint that allows exactly one token a position, the next of ``tokens``: its mask
    changes every step, so it shows that each mask is asked for after the previous token is known."""

    def __init__(self, tokens: list[int], vocab: int):
        self.tokens, self.vocab, self.seen = tokens, vocab, []

    def mask(self) -> np.ndarray:
        mask = np.zeros(self.vocab, dtype=bool)
        mask[self.tokens[len(self.seen) % len(self.tokens)]] = True
        return mask

    failed = None  # it never gives up

    def advance(self, token: int) -> None:
        self.seen.append(token)
