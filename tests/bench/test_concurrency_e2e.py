"""`mesh-llm bench --concurrency 1,2` end to end on the embedded default model, mesh-llm's two engines
as real server processes (batching or not: both are measured alike); then every output file is read
back and checked for structure and consistency."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from matplotlib.image import imread

from mesh_llm.bench.backends import mesh_takes_max_batch
from support import processes_using

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

BACKENDS = ["mesh-llama", "mesh-mlx"]
LEVELS = [1, 2]
RUNS, MAX_TOKENS, PROMPT_TOKENS = 2, 4, 64
CASE = {"name": "notes", "user": "Notes:\n{context}\nSummarize.", "context": "records", "prompt_tokens": PROMPT_TOKENS}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrency")
    (root / "cases.json").write_text(json.dumps({"cases": [CASE]}))
    out = root / "out"
    argv = [sys.executable, "-m", "mesh_llm", "bench", "--concurrency", ",".join(map(str, LEVELS)),
            "--backends", ",".join(BACKENDS), "--cases", str(root / "cases.json"), "--runs", str(RUNS),
            "--warmup", "1", "--max-tokens", str(MAX_TOKENS), "--threads", "2", "--ctx-size", "1024",
            "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return out, done, records


@pytest.mark.slow
def test_startups_follow_the_servers_settings(bench):
    _, _, records = bench
    startups = [(r["backend"], r["level"], r["ok"]) for r in records if r["kind"] == "startup"]
    per_level = mesh_takes_max_batch()  # mesh-llm serve --max-batch N: started anew for each level
    assert startups == [(b, n, True) for b in BACKENDS for n in (LEVELS if per_level else [None])]


@pytest.mark.slow
def test_requests_are_distinct_exact_and_complete(bench):
    _, _, records = bench
    requests = [r for r in records if r["kind"] == "request"]
    assert sorted((r["backend"], r["level"], r["run"], r["stream"]) for r in requests) == sorted(
        (b, n, run, i) for b in BACKENDS for n in LEVELS for run in range(RUNS) for i in range(n))
    assert len({r["session"] for r in requests}) == len(requests)  # no two streams share a prompt
    for r in requests:
        assert r["ok"], r["error"]
        assert r["completion_tokens"] == r["max_tokens"] == MAX_TOKENS and r["finish_reason"] == "length"
        assert r["prompt_tokens"] == r["prompt_tokens_sent"] == PROMPT_TOKENS
        assert r["cached_tokens"] is None or r["cached_tokens"] < PROMPT_TOKENS // 4  # the template's first tokens
        assert r["tokens_from"] == "usage" and r["eos"] == "ignore_eos"
        assert r["start_ms"] >= 0 and 0 < r["ttft_ms"] <= r["total_ms"] and r["decode_tps"] > 0


@pytest.mark.slow
def test_rounds_add_up_their_requests(bench):
    _, _, records = bench
    rounds = [r for r in records if r["kind"] == "round"]
    assert [(r["backend"], r["level"], r["run"]) for r in rounds] == [
        (b, n, run) for b in BACKENDS for n in LEVELS for run in range(RUNS)]
    for rnd in rounds:
        mine = [r for r in records if r["kind"] == "request" and
                all(r[k] == rnd[k] for k in ("backend", "level", "run"))]
        assert rnd["ok"] and rnd["error"] is None
        assert rnd["requests"] == rnd["requests_ok"] == rnd["level"] == len(mine)
        assert rnd["completion_tokens"] == rnd["level"] * MAX_TOKENS
        assert min(r["start_ms"] for r in mine) == 0
        assert rnd["wall_ms"] == pytest.approx(max(r["start_ms"] + r["total_ms"] for r in mine), abs=0.01)
        assert rnd["throughput_tps"] == pytest.approx(rnd["completion_tokens"] / rnd["wall_ms"] * 1000, abs=0.01)
        assert 0 < rnd["decode_window_ms"] <= rnd["wall_ms"]


@pytest.mark.slow
def test_summary_levels_are_consistent(bench):
    out, _, records = bench
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"settings", "environment", "startup", "levels", "leaders"}
    assert summary["settings"]["levels"] == LEVELS and summary["settings"]["runs"] == RUNS
    assert [b["per_level"] for b in summary["settings"]["backends"]] == [mesh_takes_max_batch()] * 2
    assert [(e["backend"], e["level"]) for e in summary["levels"]] == [(b, n) for b in BACKENDS for n in LEVELS]
    for e in summary["levels"]:
        assert (e["rounds"], e["rounds_ok"], e["errors"]) == (RUNS, RUNS, [])
        assert e["requests"] == e["requests_ok"] == RUNS * e["level"]
        assert e["completion_tokens"]["median"] == e["level"] * MAX_TOKENS
        rounds = [r["throughput_tps"] for r in records if r["kind"] == "round" and
                  (r["backend"], r["level"]) == (e["backend"], e["level"])]
        assert (e["throughput_tps"]["min"], e["throughput_tps"]["max"]) == (min(rounds), max(rounds))
        t = e["ttft_ms"]
        assert t["min"] <= t["p50"] <= t["p95"] <= t["max"]
        assert e["stream_decode_tps"]["min"] <= e["stream_decode_tps"]["median"] <= e["stream_decode_tps"]["max"]
        if e["level"] == 1:
            assert e["vs_one_stream"] == {"throughput": 1.0, "ttft_p95": pytest.approx(t["p95"] / t["p50"], abs=0.01)}
    assert {(w["level"], w["metric"]) for w in summary["leaders"]} == {
        (n, m) for n in LEVELS for m in ("throughput_tps", "ttft_p95_ms")}


@pytest.mark.slow
def test_report_charts_console_and_no_server_left(bench, default_gguf):
    out, done, _ = bench
    report = (out / "report.md").read_text()
    assert "| backend | ×1 | ×2 |" in report and "## Failures" not in report
    for backend in BACKENDS:
        assert f"| {backend} | 2 | {RUNS}/{RUNS} |" in report
    for chart in ("throughput", "ttft-p95"):
        assert f"![{chart}]({chart}.png)" in report
        height, width, _ = imread(out / f"{chart}.png").shape
        assert height > 200 and width > 400
    assert "concurrency: medians per level" in done.stdout
    assert processes_using(default_gguf) == []
