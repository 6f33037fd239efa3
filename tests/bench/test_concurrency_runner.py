"""The `--concurrency` loop: backends that cannot start are recorded at every level they would have
served (started per level or once), and a server that sends no usage in its streams is counted after
the round (llama_cpp.server, for real, on a tiny model)."""

from __future__ import annotations

import json
import sys

import pytest

from mesh_llm.bench.backends import BACKENDS, Backend, Settings
from mesh_llm.bench.cases import Case
from mesh_llm.bench.concurrency import ConcurrencyPlan, ConcurrencyRunner
from mesh_llm.bench.runner import ModelPair

CASE = Case("short", "Notes:\n{context}\nSummarize.", context="briefing", prompt_tokens=48)


def crashing(model, port, settings):
    return [sys.executable, "-c", f"import sys; print('boom at {settings.concurrency}', file=sys.stderr); sys.exit(3)"]


def crashing_once(model, port, settings):
    return [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]


def test_failed_starts_are_recorded_per_level_or_once(tmp_path, tiny_pair):
    backends = [Backend("per-level", "mlx", None, crashing), Backend("once", "mlx", None, crashing_once),
                Backend("needs-gguf", "gguf", None, crashing_once)]
    plan = ConcurrencyPlan([ModelPair("tiny", tiny_pair.mlx, None)], backends, [CASE],
                           Settings(threads=1, ctx_size=1024), runs=2, warmup=1, levels=(1, 3))
    steps = []
    records = ConcurrencyRunner(plan, tmp_path, lambda what, n: steps.append(n)).run()
    assert sum(steps) == len(backends) * plan.requests_per_backend() == 3 * 2 * 3
    startups = [(r["backend"], r["level"], r["ok"]) for r in records if r["kind"] == "startup"]
    assert startups == [("per-level", 1, False), ("per-level", 3, False), ("once", None, False)]
    errors = {(r["backend"], r["level"]): r["error"] for r in records if r["kind"] == "startup"}
    assert "boom at 1" in errors[("per-level", 1)] and "boom at 3" in errors[("per-level", 3)]
    rounds = [r for r in records if r["kind"] == "round"]
    assert [(r["backend"], r["level"], r["run"]) for r in rounds] == [
        (b, n, run) for b in ("per-level", "once", "needs-gguf") for n in (1, 3) for run in (0, 1)]
    assert not any(r["ok"] for r in rounds) and all(r["requests"] == r["level"] for r in rounds)
    assert all(r["requests_ok"] == 0 and r["throughput_tps"] is None for r in rounds)
    assert all("no gguf file" in r["error"] for r in rounds if r["backend"] == "needs-gguf")
    assert all(r["error"].startswith("did not start: exited with code 3") for r in rounds[:8])
    assert not any(r["kind"] == "request" for r in records)
    assert [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()] == records


def test_usage_from_an_unstreamed_request_after_the_round(tmp_path, tiny_pair):
    plan = ConcurrencyPlan([tiny_pair], [BACKENDS["llama-cpp-python"]], [CASE], Settings(threads=2, ctx_size=512),
                           runs=1, warmup=0, max_tokens=5, levels=(2,))
    runner = ConcurrencyRunner(plan, tmp_path)
    records = runner.run()
    requests = [r for r in records if r["kind"] == "request"]
    (round_,) = [r for r in records if r["kind"] == "round"]
    assert len(requests) == 2 and len({r["session"] for r in requests}) == 2
    for r in requests:
        assert r["ok"], r["error"]
        assert r["tokens_from"] == "paired" and r["completion_tokens"] == 5 and r["prompt_tokens"] == 48
        assert 0 < r["ttft_ms"] <= r["total_ms"] and r["decode_tps"] > 0
    assert round_["ok"] and round_["completion_tokens"] == 10
    # the round ends with the last stream, not with the requests that counted its tokens afterwards
    assert round_["wall_ms"] == pytest.approx(max(r["start_ms"] + r["total_ms"] for r in requests), abs=0.01)
    log = (tmp_path / "logs" / f"{tiny_pair.name}.llama-cpp-python.log").read_text()
    assert "--interrupt_requests false" in log and log.splitlines()[-1].startswith("[bench] pid")  # stopped
