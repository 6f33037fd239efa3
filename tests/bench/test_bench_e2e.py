"""`mesh-llm bench` end to end on a tiny model: mesh-llm's two engines and the two peers it is compared
with, each a real server process; then every output file is read back and checked."""

from __future__ import annotations

import json
import sys

import pytest
from matplotlib.image import imread

from mesh_llm import children
from support import processes_using

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

BACKENDS = ["mesh-mlx", "mesh-llama", "mlx-lm", "llama-cpp-python"]
CASES = [
    {"name": "hello", "user": "Say hello."},
    {"name": "exact", "user": "Notes:\n{context}\nSummarize.", "context": "briefing", "prompt_tokens": 300},
    {"name": "seq-base", "user": "Records:\n{context}\nWho lives in Porto?", "context": "records",
     "prompt_tokens": 256, "max_tokens": 3, "phase": "cache-sequence"},
    {"name": "seq-extend", "user": " And who lives in Oslo?", "extends": "seq-base", "phase": "cache-sequence"},
]
MAX_TOKENS = 4
RUN_FIELDS = {"kind", "pair", "backend", "phase", "case", "run", "ok", "error", "eos", "max_tokens",
              "prompt_tokens_target", "prompt_tokens_sent", "prompt_tokens", "cached_tokens", "completion_tokens",
              "ttft_ms", "total_ms", "decode_tps", "tokens_from", "finish_reason", "time"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory, tiny_pair):
    root = tmp_path_factory.mktemp("bench")
    (root / "cases.json").write_text(json.dumps({"cases": CASES}))
    out = root / "out"
    argv = [sys.executable, "-m", "mesh_llm", "bench", "--model-pair", f"{tiny_pair.mlx},{tiny_pair.gguf}",
            "--backends", ",".join(BACKENDS), "--cases", str(root / "cases.json"), "--runs", "1", "--warmup", "1",
            "--max-tokens", str(MAX_TOKENS), "--threads", "2", "--ctx-size", "2048", "--out", str(out)]
    done = children.run(argv, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


@pytest.mark.slow
def test_results_jsonl(bench):
    out, _ = bench
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    startups = [r for r in records if r["kind"] == "startup"]
    assert [r["backend"] for r in startups] == BACKENDS
    for r in startups:
        assert r["ok"], r["error"]
        assert 0 < r["startup_ms"] <= r["ready_ms"]
    runs = [r for r in records if r["kind"] == "run"]
    assert sorted((r["backend"], r["case"]) for r in runs) == sorted((b, c["name"]) for b in BACKENDS for c in CASES)
    for r in runs:
        assert set(r) == RUN_FIELDS
        assert r["ok"], (r["backend"], r["case"], r["error"])
        want = 3 if r["case"] == "seq-base" else MAX_TOKENS
        assert r["completion_tokens"] == r["max_tokens"] == want, (r["backend"], r["case"])
        assert r["finish_reason"] == "length"
        assert 0 < r["ttft_ms"] <= r["total_ms"] and r["decode_tps"] > 0
        assert r["prompt_tokens"] == r["prompt_tokens_sent"], (r["backend"], r["case"])  # same template, same ids
        if r["prompt_tokens_target"]:
            assert r["prompt_tokens_sent"] == r["prompt_tokens_target"]
        assert r["cached_tokens"] is None or 0 <= r["cached_tokens"] < r["prompt_tokens"]
        assert r["tokens_from"] == ("paired" if r["backend"] == "llama-cpp-python" else "usage")
        assert r["eos"] == {"mlx-lm": "logit_bias", "llama-cpp-python": "min_tokens"}.get(r["backend"], "ignore_eos")
        assert r["phase"] == ("cache-sequence" if r["case"].startswith("seq") else "main")
    extend = {r["backend"]: r for r in runs if r["case"] == "seq-extend"}
    base = {r["backend"]: r for r in runs if r["case"] == "seq-base"}
    assert all(extend[b]["prompt_tokens"] > base[b]["prompt_tokens"] for b in BACKENDS)


@pytest.mark.slow
def test_summary_json(bench):
    out, _ = bench
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"settings", "environment", "startup", "cases", "winners"}
    settings = summary["settings"]
    assert (settings["runs"], settings["warmup"], settings["max_tokens"], settings["threads"]) == (1, 1, 4, 2)
    assert [b["name"] for b in settings["backends"]] == BACKENDS
    assert "--threads 2" in settings["backends"][0]["command"]
    assert summary["environment"]["versions"]["mlx-lm"]
    assert len(summary["cases"]) == len(BACKENDS) * len(CASES)
    for e in summary["cases"]:
        assert (e["runs"], e["ok"], e["errors"]) == (1, 1, [])
        for metric in ("ttft_ms", "total_ms", "decode_tps", "completion_tokens", "prompt_tokens"):
            s = e[metric]
            assert s["min"] <= s["median"] <= s["max"], (e["backend"], e["case"], metric)
    assert [e["backend"] for e in summary["startup"]] == BACKENDS
    assert all(e["ok"] == 1 and e["ready_ms"]["median"] > 0 for e in summary["startup"])
    assert {(w["case"], w["metric"]) for w in summary["winners"]} == {
        (c["name"], m) for c in CASES for m in ("ttft_ms", "total_ms", "decode_tps")}
    for w in summary["winners"]:
        assert w["winner"] in BACKENDS and set(w["ratios"]) == set(BACKENDS) - {w["winner"]}
        assert all(r >= 1 for r in w["ratios"].values())


@pytest.mark.slow
def test_report_charts_logs_and_console(bench):
    out, done = bench
    report = (out / "report.md").read_text()
    for name in BACKENDS + [c["name"] for c in CASES]:
        assert f"| {name} |" in report
    assert "## Who wins" in report and "## Failures" not in report
    for chart in ("ttft", "total", "decode", "startup"):
        assert f"![{chart}]({chart}.png)" in report
        height, width, _ = imread(out / f"{chart}.png").shape
        assert height > 200 and width > 400
    for backend in BACKENDS:
        assert (out / "logs" / f"tiny.{backend}.log").stat().st_size > 0
    assert "requests: median (min–max)" in done.stdout and "startup" in done.stdout
    assert f"results in {out}" in done.stderr.replace("\n", "")


@pytest.mark.slow
def test_no_server_is_left_running(bench, tiny_pair):
    assert processes_using(tiny_pair.mlx) == [] and processes_using(tiny_pair.gguf) == []
