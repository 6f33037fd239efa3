"""Summary statistics, winners, the report and the charts, from hand-made records (no servers)."""

from __future__ import annotations

from matplotlib.image import imread

from mesh_llm.bench.charts import write_charts
from mesh_llm.bench.report import console_tables, write_report
from mesh_llm.bench.summary import stats, summarize

SETTINGS = {"started": "2026-12-02T10:00:00", "threads": 2, "ctx_size": 4096, "runs": 3, "warmup": 1,
            "max_tokens": 8, "pairs": [{"name": "m", "mlx": "/m-mlx", "gguf": "/m.gguf"}],
            "backends": [{"name": "fast", "serves": "gguf", "eos": "ignore_eos", "command": "fast -m MODEL"},
                         {"name": "slow", "serves": "mlx", "eos": "logit_bias", "command": "slow MODEL"},
                         {"name": "broken", "serves": "gguf", "eos": None, "command": "broken"}]}
ENVIRONMENT = {"cpu": "test CPU", "physical_cores": 2, "gpu": None, "os": "Linux", "python": "3.11",
               "versions": {"mlx": "0"}}


def run(backend, case, ttft, total, tps, phase="main", cached=0, tokens_from="usage"):
    return {"kind": "run", "pair": "m", "backend": backend, "phase": phase, "case": case, "run": 0, "ok": True,
            "error": None, "eos": "ignore_eos", "max_tokens": 8, "prompt_tokens_target": 100,
            "prompt_tokens_sent": 100, "prompt_tokens": 100, "cached_tokens": cached, "completion_tokens": 8,
            "ttft_ms": ttft, "total_ms": total, "decode_tps": tps, "tokens_from": tokens_from,
            "finish_reason": "length"}


def records():
    out = [{"kind": "startup", "pair": "m", "backend": b, "run": 0, "ok": True, "error": None,
            "startup_ms": ms, "ready_ms": ms + 100} for b, ms in (("fast", 900), ("slow", 2000))]
    out.append({"kind": "startup", "pair": "m", "backend": "broken", "run": 0, "ok": False,
                "error": "did not start: exited with code 3\nTraceback line", "startup_ms": None, "ready_ms": None})
    for ttft in (10, 12, 30):
        out.append(run("fast", "chat", ttft, ttft + 70, 100.0, tokens_from="paired"))
        out.append(run("slow", "chat", ttft * 4, ttft * 4 + 140, 50.0))
    out.append(run("fast", "extend", 5, 80, 90.0, phase="cache-sequence", cached=90))
    out.append(run("slow", "extend", 50, 300, 30.0, phase="cache-sequence"))
    out.append({"kind": "run", "pair": "m", "backend": "broken", "phase": "main", "case": "chat", "run": 0,
                "ok": False, "error": "did not start: exited with code 3\nTraceback line"})
    return out


def test_stats():
    assert stats([3, None, 1, 2]) == {"median": 2, "min": 1, "max": 3}
    assert stats([None]) is None


def test_summary_medians_and_winners():
    summary = summarize(records(), SETTINGS, ENVIRONMENT)
    chat = {e["backend"]: e for e in summary["cases"] if e["case"] == "chat"}
    assert chat["fast"]["ttft_ms"] == {"median": 12, "min": 10, "max": 30}
    assert chat["slow"]["ttft_ms"]["median"] == 48
    assert chat["fast"]["tokens_from"] == ["paired"]
    assert chat["broken"]["ok"] == 0 and chat["broken"]["ttft_ms"] is None
    assert chat["broken"]["errors"] == ["did not start: exited with code 3\nTraceback line"]
    startup = {e["backend"]: e for e in summary["startup"]}
    assert startup["fast"]["ready_ms"]["median"] == 1000 and startup["broken"]["ok"] == 0
    wins = {(w["case"], w["metric"]): w for w in summary["winners"]}
    assert wins[("chat", "ttft_ms")]["winner"] == "fast" and wins[("chat", "ttft_ms")]["ratios"] == {"slow": 4.0}
    assert wins[("chat", "decode_tps")]["ratios"] == {"slow": 2.0}
    assert wins[("extend", "ttft_ms")]["ratios"] == {"slow": 10.0}
    assert all(r >= 1 for w in summary["winners"] for r in w["ratios"].values())


def test_report_and_charts(tmp_path):
    summary = summarize(records(), SETTINGS, ENVIRONMENT)
    charts = write_charts(summary, tmp_path)
    assert [c.name for c in charts] == ["ttft.png", "total.png", "decode.png", "startup.png"]
    for chart in charts:
        height, width, _ = imread(chart).shape
        assert height > 200 and width > 400
    text = write_report(summary, tmp_path, charts).read_text()
    assert "| chat | fast | 3/3 | 100 | 12 (10–30) |" in text
    assert "- m · chat: TTFT: **fast** 12.0 ms (slow 4×)" in text
    assert "![ttft](ttft.png)" in text and "![startup](startup.png)" in text
    assert "## Failures" in text and "exited with code 3" in text
    assert "No token usage in the stream from fast" in text
    assert "`logit_bias` of -1e9" in text and "cannot be told to ignore EOS" in text
    tables = console_tables(summary)
    assert [t.title for t in tables] == ["startup", "requests: median (min–max)"]
    assert tables[1].row_count == 5
