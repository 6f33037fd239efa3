"""From ``--concurrency`` records to ``summary.json``.

A round is N requests sent at once. Its throughput is the completion tokens of all N over its wall
time (the first request sent to the last stream's end); its summed decode rate is the tokens after
each stream's first over the time from the first stream's first token to the last stream's end (a
server that serves one request at a time gets its real rate there, not N times one stream's). A level
(pair × case × backend × N) summarizes its recorded rounds: medians over the rounds, per-stream decode
rates and TTFT percentiles over every request of its complete rounds (a round counts only when all N
requests succeeded), and how it compares with one stream of the same backend and with the other
backends at the same N.
"""

from __future__ import annotations

import numpy as np

from mesh_llm.bench.summary import stats, winners

# metric -> True when lower is better; how the leaders per level are picked
LEVEL_METRICS = {"throughput_tps": False, "ttft_p95_ms": True}


def round_figures(requests: list[dict]) -> dict:
    """What one round adds up to, from its request records (``start_ms``: when each was sent)."""
    ok = [r for r in requests if r["ok"]]
    figures = {"requests": len(requests), "requests_ok": len(ok), "ok": bool(requests) and len(ok) == len(requests),
               "wall_ms": None, "completion_tokens": None, "throughput_tps": None, "decode_window_ms": None,
               "decode_tps": None}
    if not ok:
        return figures
    end = max(r["start_ms"] + r["total_ms"] for r in ok)
    wall = end - min(r["start_ms"] for r in requests)
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    figures.update(wall_ms=round(wall, 2), completion_tokens=tokens,
                   throughput_tps=round(tokens / wall * 1000, 2) if wall > 0 else None)
    firsts = [r["start_ms"] + r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    if firsts and end > min(firsts):
        window = end - min(firsts)
        after_first = sum(max(0, (r["completion_tokens"] or 0) - 1) for r in ok)
        figures.update(decode_window_ms=round(window, 2), decode_tps=round(after_first / window * 1000, 2))
    return figures


def percentiles(values: list) -> dict | None:
    """p50, p95 (linear interpolation between samples, as numpy's default), min and max."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    p50, p95 = np.percentile(values, [50, 95])
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2), "min": min(values), "max": max(values)}


def summarize_levels(records: list[dict], settings: dict, environment: dict) -> dict:
    rounds: dict[tuple, list[dict]] = {}
    requests: dict[tuple, list[dict]] = {}
    for r in records:
        if r["kind"] in ("round", "request"):
            key = (r["pair"], r["case"], r["backend"], r["level"])
            (rounds if r["kind"] == "round" else requests).setdefault(key, []).append(r)
    levels = [_level_entry(key, runs, requests.get(key, [])) for key, runs in rounds.items()]
    _compare_with_one_stream(levels)
    return {
        "settings": settings,
        "environment": environment,
        "startup": [{k: r.get(k) for k in ("pair", "backend", "level", "ok", "error", "startup_ms", "ready_ms")}
                    for r in records if r["kind"] == "startup"],
        "levels": levels,
        "leaders": winners(levels, LEVEL_METRICS, keys=("pair", "case", "level"), value=level_value),
    }


def level_value(entry: dict, metric: str) -> float | None:
    """The number a level is ranked by: the median throughput over rounds, or the TTFT p95."""
    if metric == "ttft_p95_ms":
        return entry["ttft_ms"] and entry["ttft_ms"]["p95"]
    return entry[metric] and entry[metric]["median"]


def _level_entry(key: tuple, rounds: list[dict], requests: list[dict]) -> dict:
    complete = [r for r in rounds if r["ok"]]
    counted = {r["run"] for r in complete}
    streams = [r for r in requests if r["run"] in counted]
    errors = [r["error"] for r in rounds + requests if not r["ok"] and r.get("error")]
    return {
        "pair": key[0], "case": key[1], "backend": key[2], "level": key[3],
        "rounds": len(rounds), "rounds_ok": len(complete),
        "requests": sum(r["requests"] for r in rounds), "requests_ok": sum(r["requests_ok"] for r in rounds),
        "errors": list(dict.fromkeys(errors)),
        "eos": next((r["eos"] for r in requests), None),
        "tokens_from": sorted({r["tokens_from"] for r in streams}),
        "prompt_tokens_target": next((r["prompt_tokens_target"] for r in requests), None),
        **{name: stats([r[name] for r in complete])
           for name in ("throughput_tps", "decode_tps", "wall_ms", "completion_tokens")},
        "stream_decode_tps": stats([r["decode_tps"] for r in streams]),
        "ttft_ms": percentiles([r["ttft_ms"] for r in streams]),
        "prompt_tokens": stats([r["prompt_tokens"] for r in streams]),
        "cached_tokens": stats([r["cached_tokens"] for r in streams]),
    }


def _compare_with_one_stream(levels: list[dict]) -> None:
    """``vs_one_stream``: this level's throughput over the same backend's at one stream, and its TTFT
    p95 over that one stream's median (p50) TTFT."""
    one = {(e["pair"], e["case"], e["backend"]): e for e in levels if e["level"] == 1}
    for e in levels:
        base = one.get((e["pair"], e["case"], e["backend"]))
        ratios = {}
        if base and e["throughput_tps"] and base["throughput_tps"]:
            ratios["throughput"] = round(e["throughput_tps"]["median"] / base["throughput_tps"]["median"], 2)
        if base and e["ttft_ms"] and base["ttft_ms"]:
            ratios["ttft_p95"] = round(e["ttft_ms"]["p95"] / base["ttft_ms"]["p50"], 2)
        e["vs_one_stream"] = ratios or None
