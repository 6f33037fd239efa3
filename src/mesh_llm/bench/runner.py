"""The benchmark loop: each backend in turn, never two at once, over every case; one record per run.

Per backend: start it ``runs`` times to time startup (the last start stays up), then the ``main``
phase (each case: ``warmup`` unrecorded requests, then ``runs`` recorded ones) and the
``cache-sequence`` phase (its cases in order, ``runs`` times, no warm-up), then stop it. Every
request carries its own session tag at the start of the prompt, so a server's prefix cache only helps
where a case extends the previous one. Records are appended to ``results.jsonl`` as they come.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from mesh_llm.bench.backends import Backend, BackendError, Server, Settings
from mesh_llm.bench.cases import CACHE_SEQUENCE, MAIN, Case, Prompt, PromptBuilder
from mesh_llm.bench.measure import RequestError, measure
from mesh_llm.bench.tokenizer import load_tokenizer


@dataclass(frozen=True)
class ModelPair:
    """The same model as an MLX folder and as a GGUF file (either may be missing)."""

    name: str
    mlx: Path | None
    gguf: Path | None

    def file_for(self, backend: Backend) -> Path | None:
        return self.mlx if backend.serves == "mlx" else self.gguf


@dataclass(frozen=True)
class Plan:
    pairs: list[ModelPair]
    backends: list[Backend]
    cases: list[Case]
    settings: Settings
    runs: int = 3
    warmup: int = 1
    max_tokens: int = 64
    request_timeout: float = 900.0

    def requests_per_backend(self) -> int:
        main = sum(self.warmup + self.runs for c in self.cases if c.phase == MAIN)
        return self.runs + main + self.runs * sum(c.phase == CACHE_SEQUENCE for c in self.cases)


Progress = Callable[[str, int], None]  # (what is running now, steps done since the last call)


class Runner:
    """Runs a plan, writing ``out/results.jsonl`` and one server log per backend under ``out/logs``."""

    def __init__(self, plan: Plan, out: Path, progress: Progress = lambda what, steps: None):
        self.plan, self.out, self.progress = plan, out, progress
        self.records: list[dict] = []
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self._results = out / "results.jsonl"
        self._results.write_text("")

    def run(self) -> list[dict]:
        for pair in self.plan.pairs:
            builder = PromptBuilder(load_tokenizer(pair.mlx, pair.gguf))
            for backend in self.plan.backends:
                self._backend(pair, backend, builder)
        return self.records

    def _backend(self, pair: ModelPair, backend: Backend, builder: PromptBuilder) -> None:
        plan = self.plan
        base = {"pair": pair.name, "backend": backend.name}
        if pair.file_for(backend) is None:
            self._failed(base, 0, f"the model pair has no {backend.serves} file")
            return
        log = self.out / "logs" / f"{pair.name}.{backend.name}.log"
        server = Server(backend, pair.file_for(backend), plan.settings, log)
        try:
            for run in range(plan.runs):
                self.progress(f"{pair.name} · {backend.name} · startup {run + 1}/{plan.runs}", 0)
                server.stop()
                startup = server.start()
                ready = server.wait_ready()
                self.record(kind="startup", **base, run=run, ok=True, error=None,
                            startup_ms=round(startup, 1), ready_ms=round(ready, 1))
                self.progress("", 1)
        except (BackendError, OSError, ValueError) as exc:
            server.stop()
            self._failed(base, run, f"did not start: {exc}")
            return
        try:
            rng = random.Random(f"{pair.name}/{backend.name}")
            with httpx.Client() as client:
                session = _Session(self, client, server, builder, rng, base)
                main = [c for c in plan.cases if c.phase == MAIN]
                for case in main:
                    for w in range(plan.warmup):
                        session.request(case, None, label=f"warm-up {w + 1}/{plan.warmup}")
                    for r in range(plan.runs):
                        session.request(case, r, label=f"run {r + 1}/{plan.runs}")
                sequence = [c for c in plan.cases if c.phase == CACHE_SEQUENCE]
                for r in range(plan.runs if sequence else 0):
                    for case in sequence:
                        session.request(case, r, label=f"run {r + 1}/{plan.runs}")
        finally:
            server.stop()

    def _failed(self, base: dict, run: int, error: str) -> None:
        """A backend that cannot run: its startup and every case it would have run are failures."""
        self.record(kind="startup", **base, run=run, ok=False, error=error, startup_ms=None, ready_ms=None)
        self.progress("", self.plan.requests_per_backend() - run)
        for case in self.plan.cases:
            for r in range(self.plan.runs):
                self.record(kind="run", **base, phase=case.phase, case=case.name, run=r, ok=False, error=error)

    def record(self, **record) -> None:
        record["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.records.append(record)
        with open(self._results, "a") as f:
            f.write(json.dumps(record) + "\n")


class _Session:
    """Requests to one running backend; remembers each case's last prompt for cases that extend it."""

    def __init__(self, runner: Runner, client: httpx.Client, server: Server, builder: PromptBuilder,
                 rng: random.Random, base: dict):
        self.runner, self.client, self.server, self.builder, self.rng, self.base = (
            runner, client, server, builder, rng, base)
        self.prompts: dict[str, Prompt] = {}
        self.dead: str | None = None

    def request(self, case: Case, run: int | None, label: str) -> None:
        """One request of ``case``; recorded unless it is a warm-up (``run`` None)."""
        plan = self.runner.plan
        backend, pair = self.server.backend, self.base["pair"]
        self.runner.progress(f"{pair} · {backend.name} · {case.name} · {label}", 0)
        tag = f"{self.rng.randrange(10**6):06d}"  # six digits: the same token count for every request
        prompt = self.builder.build(case, tag, self.prompts.get(case.extends))
        self.prompts[case.name] = prompt
        max_tokens = case.max_tokens or plan.max_tokens
        record = {"kind": "run", **self.base, "phase": case.phase, "case": case.name, "run": run,
                  "eos": backend.eos, "max_tokens": max_tokens, "prompt_tokens_target": case.prompt_tokens,
                  "prompt_tokens_sent": prompt.tokens}
        try:
            if self.dead:
                raise RequestError(self.dead)
            body = {"model": self.server.model_id, "messages": prompt.messages, "max_tokens": max_tokens,
                    "temperature": 0.0, **backend.eos_fields(max_tokens, self.builder.tokenizer.eos_ids)}
            result = measure(self.client, self.server.url, body, plan.request_timeout)
            record.update(ok=True, error=None, **{k: _round(v) for k, v in vars(result).items()})
        except (RequestError, httpx.HTTPError, ValueError) as exc:
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            if not self.server.alive() and not self.dead:
                self.dead = f"server exited with code {self.server.proc.returncode}:\n{self.server.log_tail()}"
                record["error"] += "\n" + self.dead
        self.runner.progress("", 1)
        if run is not None:
            self.runner.record(**record)


def _round(value):
    return round(value, 2) if isinstance(value, float) else value
