"""A ``--concurrency`` summary, readable: the console tables (rich) and ``report.md``."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from mesh_llm.bench.report import EOS_NOTES, chart_section, fmt, machine_lines, write_sections

FIGURES_NOTE = (
    "Per round of N requests sent at once: **summed tok/s** = completion tokens of all N ÷ wall time (first "
    "request sent to last stream ended), the median (min–max) over the rounds; **summed decode** = tokens "
    "after each stream's first ÷ (last stream's end − first stream's first token); **per stream** = each "
    "request's own decode rate (tokens after its first ÷ its first token to its end), median over the "
    "requests; **TTFT p50/p95** over every request of the level (queueing included); **×1** = summed tok/s "
    "over the same backend's at one stream, and TTFT p95 over its one-stream median TTFT. Only rounds in "
    "which all N requests succeeded count.")
DETAIL_HEADER = ("| backend | streams | rounds ok | summed tok/s | ×1 (tok/s / p95) | summed decode tok/s | "
                 "per-stream tok/s | TTFT p50 ms | TTFT p95 ms | tokens/round | prompt tokens | cached |")
LEADERS_NOTE = ("Per level, the best summed tok/s and TTFT p95, then how many times slower each other backend "
                "is. A ratio above 1 always favours the leader.")


def ttft(entry: dict, which: str) -> str:
    return f"{entry['ttft_ms'][which]:,.0f}" if entry["ttft_ms"] else "–"


def vs_one(entry: dict) -> str:
    """``throughput× / p95×`` against one stream of the same backend."""
    ratios = entry.get("vs_one_stream") or {}
    parts = [f"{ratios[k]:g}×" if k in ratios else "–" for k in ("throughput", "ttft_p95")]
    return " / ".join(parts) if ratios else "–"


def concurrency_tables(summary: dict) -> list[Table]:
    startup = Table("pair", "backend", "configured for", "ok", "/v1/models ms", "first completion ms",
                    title="startup")
    for e in summary["startup"]:
        startup.add_row(e["pair"], e["backend"], _configured(e["level"]), "yes" if e["ok"] else "[red]no",
                        fmt(_one(e["startup_ms"])), fmt(_one(e["ready_ms"])))
    levels = Table("pair", "case", "backend", "N", "rounds", "sum tok/s", "vs ×1", "decode sum", "per stream",
                   "TTFT p50", "TTFT p95", "tok/round",
                   title="concurrency: medians per level (tok/s; ms; vs ×1: tok/s, TTFT p95; report.md has ranges)")
    for e in summary["levels"]:
        if e["rounds_ok"]:
            cells = [_median(e["throughput_tps"], 1), vs_one(e), _median(e["decode_tps"], 1),
                     _median(e["stream_decode_tps"], 1), ttft(e, "p50"), ttft(e, "p95"),
                     _median(e["completion_tokens"])]
        else:
            cells = ["[red]failed", "", "", "", "", "", ""]
        levels.add_row(e["pair"], e["case"], e["backend"], str(e["level"]), f"{e['rounds_ok']}/{e['rounds']}",
                       *cells)
    return [startup, levels]


def write_concurrency_report(summary: dict, out: Path, charts: list[Path]) -> Path:
    return write_sections(out, [_header(summary), _setup(summary), _startup(summary), _levels(summary),
                                chart_section(charts), _leaders(summary["leaders"]), _failures(summary)])


def _header(summary: dict) -> list[str]:
    s, env = summary["settings"], summary["environment"]
    levels = ", ".join(str(n) for n in s["levels"])
    return [
        f"# mesh-llm bench --concurrency {','.join(str(n) for n in s['levels'])}, {s['started']}",
        "",
        *machine_lines(env),
        (f"- Every backend: {s['threads']} threads, a context of {s['ctx_size']} per stream, greedy (temperature "
         f"0), {s['max_tokens']} tokens per request unless a case says otherwise, streamed chat completions over "
         "HTTP, one backend at a time."),
        (f"- Levels: {levels} requests sent at once (one thread each, released together); per level and case "
         f"{s['warmup']} unrecorded warm-up round(s), then {s['runs']} recorded round(s)."),
        *([f"- Note: {s['note']}"] if s.get("note") else []),
        ("- Each request starts with its own session tag: the N prompts of a round are distinct and of the same "
         "token length, so no stream reuses another's prompt from a cache beyond the chat template's first few "
         "tokens (the `cached` column)."),
    ]


def _setup(summary: dict) -> list[str]:
    s = summary["settings"]
    lines = ["## Models", "", "| pair | MLX folder | GGUF |", "| --- | --- | --- |"]
    lines += [f"| {p['name']} | `{p['mlx']}` | `{p['gguf']}` |" for p in s["pairs"]]
    names = [b["name"] for b in s["backends"]]
    started = ("as each merged bench started them, for its highest level" if len(set(names)) < len(names)
               else f"as started for {max(s['levels'])} streams")
    lines += ["", "## Backends", "",
              (f"Commands {started}; a backend whose command depends on the level is started anew for each "
               "level, configured for it."), "",
              "| backend | serves | exact token count | started | command |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {b['name']} | {b['serves']} | {EOS_NOTES[b['eos']]} | "
              f"{'per level' if b['per_level'] else 'once for all levels'} | `{b['command']}` |"
              for b in s["backends"]]
    paired = sorted({e["backend"] for e in summary["levels"] if "paired" in e["tokens_from"]})
    if paired:
        lines += ["", (f"No token usage in the stream from {', '.join(paired)}: each of its requests was sent again "
                       "without streaming, after the round, to read the counts (not timed).")]
    return lines


def _startup(summary: dict) -> list[str]:
    lines = ["## Startup", "",
             "| pair | backend | configured for | ok | `/v1/models` answers, ms | first completion, ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    return lines + [f"| {e['pair']} | {e['backend']} | {_configured(e['level'])} | {'yes' if e['ok'] else 'no'} | "
                    f"{fmt(_one(e['startup_ms']))} | {fmt(_one(e['ready_ms']))} |" for e in summary["startup"]]


def _levels(summary: dict) -> list[str]:
    lines = ["## Levels", "", FIGURES_NOTE]
    entries = summary["levels"]
    for pair, case in dict.fromkeys((e["pair"], e["case"]) for e in entries):
        mine = [e for e in entries if (e["pair"], e["case"]) == (pair, case)]
        levels = sorted({e["level"] for e in mine})
        lines += ["", f"### {pair}, {case}", "", "Summed tok/s (TTFT p95 ms):", "",
                  "| backend | " + " | ".join(f"×{n}" for n in levels) + " |",
                  "| --- |" + " --- |" * len(levels)]
        for backend in dict.fromkeys(e["backend"] for e in mine):
            cells = {e["level"]: _headline(e) for e in mine if e["backend"] == backend}
            lines.append(f"| {backend} | " + " | ".join(cells.get(n, "") for n in levels) + " |")
        lines += ["", DETAIL_HEADER, "|" + " --- |" * (DETAIL_HEADER.count("|") - 1)]
        lines += [f"| {e['backend']} | {e['level']} | {e['rounds_ok']}/{e['rounds']} | "
                  f"{fmt(e['throughput_tps'], 1)} | {vs_one(e)} | {fmt(e['decode_tps'], 1)} | "
                  f"{fmt(e['stream_decode_tps'], 1)} | {ttft(e, 'p50')} | {ttft(e, 'p95')} | "
                  f"{fmt(e['completion_tokens'])} | {fmt(e['prompt_tokens'])} | {fmt(e['cached_tokens'])} |"
                  for e in mine]
    return lines


def _headline(entry: dict) -> str:
    if not entry["rounds_ok"]:
        return "failed"
    return f"{entry['throughput_tps']['median']:,.0f} ({ttft(entry, 'p95')})"


def _leaders(leaders: list[dict]) -> list[str]:
    lines = ["## Who leads", "", LEADERS_NOTE, ""]
    by_level: dict[tuple, list[dict]] = {}
    for w in leaders:
        by_level.setdefault((w["pair"], w["case"], w["level"]), []).append(w)
    for (pair, case, level), ws in by_level.items():
        parts = []
        for w in ws:
            name, unit = ("summed", "tok/s") if w["metric"] == "throughput_tps" else ("TTFT p95", "ms")
            others = ", ".join(f"{b} {r:g}×" for b, r in w["ratios"].items())
            parts.append(f"{name}: **{w['winner']}** {w['value']:,.1f} {unit}" + (f" ({others})" if others else ""))
        lines.append(f"- {pair} · {case} · ×{level}: " + "; ".join(parts))
    return lines


def _failures(summary: dict) -> list[str]:
    lines = []
    for e in summary["startup"]:
        if not e["ok"]:
            lines += _failure(f"{e['pair']} · {e['backend']} · startup for {_configured(e['level'])}", e["error"])
    for e in summary["levels"]:
        for error in e["errors"]:
            lines += _failure(f"{e['pair']} · {e['backend']} · {e['case']} · ×{e['level']}", error)
    return ["## Failures", "", *lines] if lines else []


def _failure(where: str, error: str) -> list[str]:
    return [f"- {where}:", "", "  ```", *("  " + line for line in (error or "").splitlines()), "  ```"]


def _median(stat: dict | None, digits: int = 0) -> str:
    return f"{stat['median']:,.{digits}f}" if stat else "–"


def _configured(level: int | None) -> str:
    return "all levels" if level is None else f"×{level}"


def _one(value: float | None) -> dict | None:
    return None if value is None else {"median": value, "min": value, "max": value}
