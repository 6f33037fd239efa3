"""``mesh-llm bench --concurrency``: N streamed requests at once, for each level N, one backend at a time.

Per backend: started configured for N at each level when its command line depends on N
(``Backend.restarts_per_level``), otherwise once for all levels. Per level and case: ``warmup``
unrecorded rounds, then ``runs`` recorded ones. A round builds N prompts of the same token length, each
with its own session tag (no stream can reuse another's prompt from a cache), releases N threads at
once, each streaming one request, and records every request and the round. Token counts that a server
gives only without streaming are asked for after the round's streams have ended (not timed).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx

from mesh_llm.bench.backends import Backend, BackendError, Server
from mesh_llm.bench.cases import Case, PromptBuilder
from mesh_llm.bench.concurrency_summary import round_figures
from mesh_llm.bench.measure import Measured, RequestError, measure, paired_usage
from mesh_llm.bench.runner import ModelPair, Plan, Runner
from mesh_llm.bench.tokenizer import load_tokenizer

_FAILURES = (RequestError, httpx.HTTPError, ValueError, threading.BrokenBarrierError)


@dataclass(frozen=True)
class ConcurrencyPlan(Plan):
    levels: tuple[int, ...] = (1,)

    def requests_per_backend(self) -> int:
        """Progress steps per backend: here rounds, each of N requests."""
        return len(self.levels) * len(self.cases) * (self.warmup + self.runs)


class ConcurrencyRunner(Runner):
    """Runs a :class:`ConcurrencyPlan`; records ``startup``, ``request`` and ``round`` records."""

    plan: ConcurrencyPlan

    def run(self) -> list[dict]:
        for pair in self.plan.pairs:
            builder = PromptBuilder(load_tokenizer(pair.mlx, pair.gguf))
            for backend in self.plan.backends:
                self._backend_levels(pair, backend, builder)
        return self.records

    def _backend_levels(self, pair: ModelPair, backend: Backend, builder: PromptBuilder) -> None:
        plan, base = self.plan, {"pair": pair.name, "backend": backend.name}
        model = pair.file_for(backend)
        if model is None:
            self._unsent(base, plan.levels, f"the model pair has no {backend.serves} file")
            return
        per_level = backend.restarts_per_level(plan.settings)
        starts = [(n,) for n in plan.levels] if per_level else [plan.levels]
        tags = _session_tags(random.Random(f"{pair.name}/{backend.name}"))
        log = self.out / "logs" / f"{pair.name}.{backend.name}.log"
        for levels in starts:
            server = Server(backend, model, replace(plan.settings, concurrency=max(levels)), log)
            try:
                error = self._start(server, base, levels[0] if per_level else None)
                if error:
                    self._unsent(base, levels, f"did not start: {error}")
                    continue
                most = max(levels)
                with httpx.Client(limits=httpx.Limits(max_connections=most, max_keepalive_connections=most)) as c:
                    rounds = _Rounds(self, server, c, builder, tags, base)
                    for level in levels:
                        for case in plan.cases:
                            for w in range(plan.warmup):
                                rounds.run(case, level, None, f"warm-up {w + 1}/{plan.warmup}")
                            for r in range(plan.runs):
                                rounds.run(case, level, r, f"run {r + 1}/{plan.runs}")
            finally:
                server.stop()

    def _start(self, server: Server, base: dict, level: int | None) -> str | None:
        """Start ``server`` and record it (``level`` None: it serves every level); the error, if any."""
        what = f"×{level}" if level else "all levels"
        self.progress(f"{base['pair']} · {base['backend']} · startup for {what}", 0)
        try:
            startup = server.start()
            ready = server.wait_ready()
        except (BackendError, OSError, ValueError) as exc:
            server.stop()
            self.record(kind="startup", **base, level=level, ok=False, error=str(exc), startup_ms=None,
                        ready_ms=None)
            return str(exc)
        self.record(kind="startup", **base, level=level, ok=True, error=None, startup_ms=round(startup, 1),
                    ready_ms=round(ready, 1))
        return None

    def _unsent(self, base: dict, levels: tuple[int, ...], error: str) -> None:
        """Levels a backend could not serve: each of their recorded rounds is a failure."""
        plan = self.plan
        for level in levels:
            for case in plan.cases:
                self.progress("", plan.warmup + plan.runs)
                for run in range(plan.runs):
                    self.record(**unsent_round(base, case.name, level, run, error))


def unsent_round(base: dict, case: str, level: int, run: int, error: str) -> dict:
    return {"kind": "round", **base, "case": case, "level": level, "run": run, **round_figures([]),
            "requests": level, "error": error}


class _Rounds:
    """Rounds of concurrent requests to one running server; after it has died, rounds are not sent."""

    def __init__(self, runner: ConcurrencyRunner, server: Server, client: httpx.Client, builder: PromptBuilder,
                 tags: Iterator[str], base: dict):
        self.runner, self.server, self.client, self.builder, self.tags, self.base = (
            runner, server, client, builder, tags, base)
        self.dead: str | None = None

    def run(self, case: Case, level: int, run: int | None, label: str) -> None:
        """One round of ``level`` requests of ``case``; recorded unless it is a warm-up (``run`` None)."""
        runner, backend = self.runner, self.server.backend
        runner.progress(f"{self.base['pair']} · {backend.name} · ×{level} · {case.name} · {label}", 0)
        key = {**self.base, "case": case.name, "level": level, "run": run}
        if self.dead:
            runner.progress("", 1)
            if run is not None:
                runner.record(**unsent_round(self.base, case.name, level, run, self.dead))
            return
        max_tokens = case.max_tokens or runner.plan.max_tokens
        sessions = [next(self.tags) for _ in range(level)]
        prompts = [self.builder.build(case, session) for session in sessions]
        eos = backend.eos_fields(max_tokens, self.builder.tokenizer.eos_ids)
        bodies = [{"model": self.server.model_id, "messages": p.messages, "max_tokens": max_tokens,
                   "temperature": 0.0, **eos} for p in prompts]
        outcomes = self._send(bodies)
        begin = min(start for start, _, _ in outcomes)
        requests = []
        for i, ((start, measured, error), prompt, body) in enumerate(zip(outcomes, prompts, bodies)):
            measured, error = self._counted(measured, error, body)
            request = {"kind": "request", **key, "stream": i, "session": sessions[i], "ok": measured is not None,
                       "error": error, "eos": backend.eos, "max_tokens": max_tokens,
                       "prompt_tokens_target": case.prompt_tokens, "prompt_tokens_sent": prompt.tokens,
                       "start_ms": round((start - begin) * 1000, 2)}
            if measured is not None:
                request.update({k: round(v, 2) if isinstance(v, float) else v for k, v in vars(measured).items()})
            requests.append(request)
        figures = round_figures(requests)
        error = next((r["error"] for r in requests if not r["ok"]), None)
        if error and not self.server.alive():
            self.dead = f"server exited with code {self.server.proc.returncode}:\n{self.server.log_tail()}"
            error += "\n" + self.dead
        runner.progress("", 1)
        if run is not None:
            for request in requests:
                runner.record(**request)
            runner.record(kind="round", **key, **figures, error=error)

    def _counted(self, measured: Measured | None, error: str | None, body: dict) -> tuple[Measured | None, str | None]:
        """A stream without usage gets its token counts now, from the same request unstreamed."""
        if measured is None or measured.tokens_from != "none":
            return measured, error
        try:
            return paired_usage(self.client, self.server.url, body, self.runner.plan.request_timeout, measured), None
        except _FAILURES as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _send(self, bodies: list[dict]) -> list[tuple[float, Measured | None, str | None]]:
        """Stream every body at once, one thread each: (start time, Measured or None, error)."""
        gate = threading.Barrier(len(bodies))
        url, timeout = self.server.url, self.runner.plan.request_timeout

        def stream(body: dict):
            start = None
            try:
                gate.wait(timeout=60)
                start = time.perf_counter()
                return start, measure(self.client, url, body, timeout, count_later=True), None
            except _FAILURES as exc:
                return start or time.perf_counter(), None, f"{type(exc).__name__}: {exc}"

        pool = ThreadPoolExecutor(max_workers=len(bodies))
        try:
            return list(pool.map(stream, bodies))
        finally:  # on Ctrl-C, do not wait for the streams: stopping the server ends them
            pool.shutdown(wait=False, cancel_futures=True)


def _session_tags(rng: random.Random) -> Iterator[str]:
    """Six-digit session tags (the same token count for each), never the same one twice."""
    seen: set[str] = set()
    while True:
        tag = f"{rng.randrange(10**6):06d}"
        if tag not in seen:
            seen.add(tag)
            yield tag
