"""From run records to ``summary.json``: median, min and max per case × backend, startup per backend,
and for each case who wins each metric and by what ratio."""

from __future__ import annotations

import statistics

# metric -> True when lower is better
METRICS = {"ttft_ms": True, "total_ms": True, "decode_tps": False}
_STATS = [*METRICS, "completion_tokens", "prompt_tokens", "cached_tokens"]


def stats(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def summarize(records: list[dict], settings: dict, environment: dict) -> dict:
    startup: dict[tuple, list[dict]] = {}
    cases: dict[tuple, list[dict]] = {}
    for r in records:
        if r["kind"] == "startup":
            startup.setdefault((r["pair"], r["backend"]), []).append(r)
        else:
            cases.setdefault((r["pair"], r["backend"], r["phase"], r["case"]), []).append(r)
    summary_cases = [_case_entry(key, runs) for key, runs in cases.items()]
    return {
        "settings": settings,
        "environment": environment,
        "startup": [_startup_entry(key, runs) for key, runs in startup.items()],
        "cases": summary_cases,
        "winners": winners(summary_cases),
    }


def _startup_entry(key: tuple, runs: list[dict]) -> dict:
    ok = [r for r in runs if r["ok"]]
    return {"pair": key[0], "backend": key[1], "runs": len(runs), "ok": len(ok), "errors": _errors(runs),
            "startup_ms": stats([r["startup_ms"] for r in ok]), "ready_ms": stats([r["ready_ms"] for r in ok])}


def _case_entry(key: tuple, runs: list[dict]) -> dict:
    ok = [r for r in runs if r["ok"]]
    entry = {"pair": key[0], "backend": key[1], "phase": key[2], "case": key[3], "runs": len(runs),
             "ok": len(ok), "errors": _errors(runs), "eos": runs[0].get("eos"),
             "tokens_from": sorted({r["tokens_from"] for r in ok}),
             "prompt_tokens_target": runs[0].get("prompt_tokens_target")}
    entry.update({name: stats([r.get(name) for r in ok]) for name in _STATS})
    return entry


def _errors(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["error"] for r in runs if not r["ok"] and r.get("error")))


def winners(entries: list[dict], metrics: dict[str, bool] = METRICS,
            keys: tuple[str, ...] = ("pair", "phase", "case"),
            value=lambda entry, metric: entry[metric] and entry[metric]["median"]) -> list[dict]:
    """Per group of ``keys`` (pair, phase, case) and metric: the best backend by ``value`` (the median),
    and how each other backend compares (``ratio`` >= 1: how many times slower, or fewer tokens per
    second, than the winner)."""
    groups: dict[tuple, list[dict]] = {}
    for e in entries:
        groups.setdefault(tuple(e[k] for k in keys), []).append(e)
    out = []
    for key, group in groups.items():
        for metric, lower in metrics.items():
            values = {e["backend"]: value(e, metric) for e in group}
            values = {b: v for b, v in values.items() if v}
            if not values:
                continue
            ranked = sorted(values, key=values.get, reverse=not lower)
            best = values[ranked[0]]
            ratios = {b: round(values[b] / best if lower else best / values[b], 2) for b in ranked[1:]}
            out.append({**dict(zip(keys, key)), "metric": metric, "winner": ranked[0], "value": best,
                        "ratios": ratios})
    return out
