"""`--concurrency` aggregation, report and charts from recorded records (no servers): what a round adds
up to, percentiles, ratios to one stream and between backends, and failed rounds kept out of the figures."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from matplotlib.image import imread

from mesh_llm.bench.charts import write_concurrency_charts
from mesh_llm.bench.concurrency import unsent_round
from mesh_llm.bench.concurrency_report import concurrency_tables, write_concurrency_report
from mesh_llm.bench.concurrency_summary import percentiles, round_figures, summarize_levels

SETTINGS = {"started": "2026-12-03T10:00:00", "threads": 2, "ctx_size": 1024, "runs": 2, "warmup": 1,
            "max_tokens": 10, "levels": [1, 4],
            "pairs": [{"name": "m", "mlx": "/m-mlx", "gguf": "/m.gguf"}],
            "backends": [{"name": "batched", "serves": "gguf", "eos": "ignore_eos", "per_level": True,
                          "command": "batched -np 4"},
                         {"name": "serial", "serves": "gguf", "eos": "min_tokens", "per_level": False,
                          "command": "serial"}]}
ENVIRONMENT = {"cpu": "test CPU", "physical_cores": 2, "gpu": None, "os": "Linux", "python": "3.11",
               "versions": {"mlx": "0"}}


def request(backend, level, run, stream, start, ttft, total, tokens=10, ok=True, tokens_from="usage"):
    base = {"kind": "request", "pair": "m", "backend": backend, "case": "c", "level": level, "run": run,
            "stream": stream, "session": f"{run}{stream}{level}", "ok": ok, "eos": "ignore_eos", "max_tokens": 10,
            "prompt_tokens_target": 64, "prompt_tokens_sent": 64, "start_ms": start}
    if not ok:
        return {**base, "error": "RequestError: HTTP 500: boom"}
    decode = (tokens - 1) / ((total - ttft) / 1000)
    return {**base, "error": None, "ttft_ms": ttft, "total_ms": total, "prompt_tokens": 64,
            "completion_tokens": tokens, "cached_tokens": 3, "decode_tps": decode, "tokens_from": tokens_from,
            "finish_reason": "length"}


def round_of(requests):
    first = requests[0]
    key = {k: first[k] for k in ("pair", "backend", "case", "level", "run")}
    error = next((r["error"] for r in requests if not r["ok"]), None)
    return [*requests, {"kind": "round", **key, **round_figures(requests), "error": error}]


# One stream: 10 tokens, the first after 10 ms (serial: 10 and 20 ms), done at 110 ms (batched) or 210 ms.
# Four streams, batched: ends at 200, 200, 220 and 100 ms; serial: one after another.
BATCHED_4 = [(0, 20, 200), (1, 30, 199), (2, 40, 218), (0, 50, 100)]
SERIAL_4 = [(0, 10, 100), (0, 110, 200), (1, 209, 299), (1, 299, 399)]


def records():
    out = [{"kind": "startup", "pair": "m", "backend": "batched", "level": n, "ok": True, "error": None,
            "startup_ms": 900.0, "ready_ms": 1000.0} for n in (1, 4)]
    out.append({"kind": "startup", "pair": "m", "backend": "serial", "level": None, "ok": True, "error": None,
                "startup_ms": 500.0, "ready_ms": 600.0})
    for run in (0, 1):
        out += round_of([request("batched", 1, run, 0, 0, 10, 110)])
        out += round_of([request("batched", 4, run, i, *t) for i, t in enumerate(BATCHED_4)])
        out += round_of([request("serial", 1, run, 0, 0, 10 + run * 10, 210, tokens_from="paired")])
    out += round_of([request("serial", 4, 0, i, *t, tokens_from="paired") for i, t in enumerate(SERIAL_4)])
    out += round_of([request("serial", 4, 1, 0, 0, 10, 100, tokens_from="paired"),
                     request("serial", 4, 1, 1, 0, 0, 0, ok=False),
                     request("serial", 4, 1, 2, 1, 15, 120, tokens_from="paired"),
                     request("serial", 4, 1, 3, 1, 20, 130, tokens_from="paired")])
    return out


def test_round_figures_add_up_the_streams():
    figures = round_figures([request("b", 4, 0, i, *t) for i, t in enumerate(BATCHED_4)])
    assert figures["ok"] and (figures["requests"], figures["requests_ok"]) == (4, 4)
    assert figures["wall_ms"] == 220 and figures["completion_tokens"] == 40
    assert figures["throughput_tps"] == pytest.approx(40 / 0.220, abs=0.01)
    # decode: 9 tokens after the first of each, from the first first token (20 ms) to the last end (220 ms)
    assert figures["decode_window_ms"] == 200 and figures["decode_tps"] == pytest.approx(36 / 0.2, abs=0.01)


def test_a_round_with_a_failed_request_is_not_ok():
    figures = round_figures([request("b", 2, 0, 0, 0, 10, 100), request("b", 2, 0, 1, 0, 0, 0, ok=False)])
    assert not figures["ok"] and (figures["requests"], figures["requests_ok"]) == (2, 1)
    assert figures["completion_tokens"] == 10 and figures["wall_ms"] == 100
    empty = round_figures([])
    assert not empty["ok"] and empty["throughput_tps"] is None


def test_percentiles_interpolate_between_samples():
    assert percentiles([40, 10, 30, 20]) == {"p50": 25.0, "p95": 38.5, "min": 10, "max": 40}
    assert percentiles([7]) == {"p50": 7.0, "p95": 7.0, "min": 7, "max": 7}
    assert percentiles([None]) is None


def test_levels_summarize_complete_rounds_and_compare():
    summary = summarize_levels(records(), SETTINGS, ENVIRONMENT)
    assert set(summary) == {"settings", "environment", "startup", "levels", "leaders"}
    levels = {(e["backend"], e["level"]): e for e in summary["levels"]}
    assert list(levels) == [("batched", 1), ("batched", 4), ("serial", 1), ("serial", 4)]

    one = levels[("batched", 1)]
    assert (one["rounds"], one["rounds_ok"], one["requests"], one["requests_ok"]) == (2, 2, 2, 2)
    assert one["throughput_tps"]["median"] == pytest.approx(10 / 0.110, abs=0.01)
    assert one["ttft_ms"] == {"p50": 10.0, "p95": 10.0, "min": 10, "max": 10}
    assert one["vs_one_stream"] == {"throughput": 1.0, "ttft_p95": 1.0}

    four = levels[("batched", 4)]
    assert four["completion_tokens"] == {"median": 40, "min": 40, "max": 40}
    assert four["throughput_tps"]["median"] == pytest.approx(181.82)
    assert four["ttft_ms"]["p50"] == 35.0 and four["ttft_ms"]["p95"] == 50.0  # 20, 30, 40, 50 twice
    assert four["stream_decode_tps"]["max"] == pytest.approx(9 / 0.050)  # first token at 50 ms, done at 100
    assert four["stream_decode_tps"]["min"] == pytest.approx(9 / 0.180)  # first token at 20 ms, done at 200
    assert four["vs_one_stream"]["throughput"] == 2.0
    assert four["vs_one_stream"]["ttft_p95"] == 5.0  # 50 ms against one stream's 10

    serial = levels[("serial", 4)]  # run 1 lost a request: only run 0 counts
    assert (serial["rounds"], serial["rounds_ok"], serial["requests"], serial["requests_ok"]) == (2, 1, 8, 7)
    assert serial["errors"] == ["RequestError: HTTP 500: boom"]
    assert serial["throughput_tps"] == {"median": pytest.approx(40 / 0.4), "min": 100.0, "max": 100.0}
    assert serial["ttft_ms"]["max"] == 299 and serial["tokens_from"] == ["paired"]
    assert levels[("serial", 1)]["ttft_ms"]["p50"] == 15.0
    assert serial["vs_one_stream"]["ttft_p95"] == pytest.approx(round(percentiles([10, 110, 209, 299])["p95"] / 15, 2))

    leaders = {(w["level"], w["metric"]): w for w in summary["leaders"]}
    assert leaders[(4, "throughput_tps")]["winner"] == "batched"
    assert leaders[(4, "throughput_tps")]["ratios"] == {"serial": 1.82}
    assert leaders[(1, "ttft_p95_ms")]["winner"] == "batched"
    assert all(r >= 1 for w in summary["leaders"] for r in w["ratios"].values())
    assert [s["level"] for s in summary["startup"]] == [1, 4, None]


def test_unsent_rounds_are_failures_without_figures():
    out = records()
    out.append({"kind": "startup", "pair": "m", "backend": "broken", "level": 4, "ok": False,
                "error": "exited with code 3", "startup_ms": None, "ready_ms": None})
    out += [unsent_round({"pair": "m", "backend": "broken"}, "c", 4, run, "did not start: exited with code 3")
            for run in (0, 1)]
    summary = summarize_levels(out, SETTINGS, ENVIRONMENT)
    broken = [e for e in summary["levels"] if e["backend"] == "broken"]
    assert len(broken) == 1
    assert (broken[0]["rounds_ok"], broken[0]["requests"], broken[0]["requests_ok"]) == (0, 8, 0)
    assert broken[0]["throughput_tps"] is None and broken[0]["ttft_ms"] is None
    assert broken[0]["errors"] == ["did not start: exited with code 3"]
    assert "broken" not in {w["winner"] for w in summary["leaders"]}


def test_report_charts_and_console(tmp_path):
    summary = summarize_levels(records(), SETTINGS, ENVIRONMENT)
    charts = write_concurrency_charts(summary, tmp_path)
    assert [c.name for c in charts] == ["throughput.png", "ttft-p95.png"]
    for chart in charts:
        height, width, _ = imread(chart).shape
        assert height > 200 and width > 400
    text = write_concurrency_report(summary, tmp_path, charts).read_text()
    assert text.startswith("# mesh-llm bench --concurrency 1,4, 2026-12-03T10:00:00")
    assert "| backend | ×1 | ×4 |" in text
    assert "| batched | 91 (10) | 182 (50) |" in text
    assert "| batched | 4 | 2/2 | 181.8 | 2× / 5× |" in text
    assert "| serial | 4 | 1/2 |" in text
    assert "| batched | gguf | `ignore_eos: true`: exactly `max_tokens` tokens | per level | `batched -np 4` |" in text
    assert "| serial | gguf |" in text and "| once for all levels | `serial` |" in text
    assert "No token usage in the stream from serial" in text
    assert "- m · c · ×4: summed: **batched** 181.8 tok/s (serial 1.82×)" in text
    assert "## Failures" in text and "m · serial · c · ×4" in text and "HTTP 500: boom" in text
    assert "![throughput](throughput.png)" in text and "![ttft-p95](ttft-p95.png)" in text
    startup, levels = concurrency_tables(summary)
    assert (startup.row_count, levels.row_count) == (3, 4)


def test_where_llama_cpp_came_first_the_charts_are_drawn_without_matplotlib_in_the_process(tmp_path):
    """A process that loaded a llama.cpp build carrying its own libstdc++ first must not import
    matplotlib at all: on a fresh H200 machine its font-cache build died there with SIGSEGV. The
    bench draws its charts in a child then; here the parent is told it loaded such a build."""
    summary = summarize_levels(records(), SETTINGS, ENVIRONMENT)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    code = textwrap.dedent("""
        import json, sys
        from pathlib import Path
        from mesh_llm.system import native
        native.loaded_first = lambda: True
        from mesh_llm.bench.cli import _charts
        out = Path(sys.argv[1])
        charts = _charts("write_concurrency_charts", json.loads((out / "summary.json").read_text()), out)
        print([c.name for c in charts], "matplotlib" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['throughput.png', 'ttft-p95.png'] False"
    assert imread(tmp_path / "throughput.png").shape[0] > 200
