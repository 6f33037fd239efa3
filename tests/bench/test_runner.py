"""The loop goes on past a backend that cannot start, records why, and leaves no process behind."""

from __future__ import annotations

import json
import sys

from mesh_llm.bench.backends import Backend, Settings
from mesh_llm.bench.cases import load_cases
from mesh_llm.bench.runner import ModelPair, Plan, Runner


def crashing(model, port, settings):
    return [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]


def test_failed_backends_are_recorded_and_the_rest_still_run(tmp_path, tiny_pair):
    pair = ModelPair("tiny", tiny_pair.mlx, None)  # no GGUF: GGUF backends cannot run at all
    backends = [Backend("crashes", "mlx", None, crashing), Backend("needs-gguf", "gguf", None, crashing)]
    plan = Plan([pair], backends, load_cases(["default", "cache-sequence"]), Settings(threads=1, ctx_size=1024),
                runs=2, warmup=0)
    steps = []
    records = Runner(plan, tmp_path, lambda what, n: steps.append(n)).run()
    assert sum(steps) == 2 * plan.requests_per_backend()
    startups = [r for r in records if r["kind"] == "startup"]
    assert [(r["backend"], r["ok"]) for r in startups] == [("crashes", False), ("needs-gguf", False)]
    assert "exited with code 3" in startups[0]["error"] and "boom" in startups[0]["error"]
    assert "no gguf file" in startups[1]["error"]
    runs = [r for r in records if r["kind"] == "run"]
    assert len(runs) == 2 * 6 * 2 and not any(r["ok"] for r in runs)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    log = (tmp_path / "logs" / "tiny.crashes.log").read_text()
    assert log.startswith(f"\n$ {sys.executable} -c ") and "\nboom\n" in log
