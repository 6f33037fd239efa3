"""A summary, readable: the console table (rich) and ``report.md`` (tables, charts, winners, failures)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

EOS_NOTES = {
    "ignore_eos": "`ignore_eos: true`: exactly `max_tokens` tokens",
    "min_tokens": "no `ignore_eos`; `min_tokens` = `max_tokens` (its min-tokens logits processor holds EOS "
                  "back), so exactly `max_tokens` tokens",
    "logit_bias": "no `ignore_eos` or `min_tokens`; the EOS ids get a `logit_bias` of -1e9, so exactly "
                  "`max_tokens` tokens",
    None: "cannot be told to ignore EOS: the token count is what it generated",
}
METRIC_NAMES = {"ttft_ms": "TTFT", "total_ms": "total", "decode_tps": "decode"}
REQUESTS_NOTE = ("Median (min–max) over the runs; TTFT is to the first streamed content, decode counts the tokens "
                 "after the first to the end of the stream.")
WINNERS_NOTE = ("Per case, the best median, then how many times slower each other backend is (for decode: how "
                "many times fewer tokens per second). A ratio above 1 always favours the winner.")


def fmt(stat: dict | None, digits: int = 0) -> str:
    """``median (min–max)``, or the one value when they agree; "–" for none."""
    if not stat:
        return "–"
    med, lo, hi = (f"{v:,.{digits}f}" for v in (stat["median"], stat["min"], stat["max"]))
    return med if lo == hi else f"{med} ({lo}–{hi})"


def console_tables(summary: dict) -> list[Table]:
    startup = Table("pair", "backend", "starts ok", "/v1/models ms", "first completion ms", title="startup")
    for e in summary["startup"]:
        startup.add_row(e["pair"], e["backend"], f"{e['ok']}/{e['runs']}", fmt(e["startup_ms"]),
                        fmt(e["ready_ms"]) if e["ok"] else f"[red]{_first_line(e['errors'])}[/] (report.md)")
    cases = Table("pair", "phase", "case", "backend", "ok", "TTFT ms", "total ms", "decode tok/s", "tokens",
                  "cached", title="requests: median (min–max)")
    for e in summary["cases"]:
        if e["ok"]:
            cells = [fmt(e["ttft_ms"]), fmt(e["total_ms"]), fmt(e["decode_tps"], 1),
                     fmt(e["completion_tokens"]), fmt(e["cached_tokens"])]
        else:
            cells = ["[red]failed", "", "", "", ""]
        cases.add_row(e["pair"], e["phase"], e["case"], e["backend"], f"{e['ok']}/{e['runs']}", *cells)
    return [startup, cases]


def write_report(summary: dict, out: Path, charts: list[Path]) -> Path:
    return write_sections(out, [_header(summary), _setup(summary), _startup(summary), _requests(summary),
                                chart_section(charts), _winners(summary["winners"]), _failures(summary)])


def write_sections(out: Path, sections: list[list[str]]) -> Path:
    """report.md from its sections (lists of lines; empty ones left out)."""
    path = out / "report.md"
    path.write_text("\n\n".join("\n".join(lines) for lines in sections if lines) + "\n")
    return path


def chart_section(charts: list[Path]) -> list[str]:
    return ["## Charts", "", *(f"![{p.stem}]({p.name})" for p in charts)]


def machine_lines(env: dict) -> list[str]:
    """The machine and library versions a report's figures were measured with."""
    gpu = f", GPU {env['gpu']}" if env.get("gpu") else ", no GPU"
    return [(f"- Machine: {env['cpu']}, {env['physical_cores']} physical cores{gpu}; {env['os']}; "
             f"Python {env['python']}."),
            "- Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + "."]


def _header(summary: dict) -> list[str]:
    s, env = summary["settings"], summary["environment"]
    return [
        f"# mesh-llm bench, {s['started']}",
        "",
        *machine_lines(env),
        (f"- Every backend: {s['threads']} threads, context {s['ctx_size']}, greedy (temperature 0), "
         f"{s['max_tokens']} tokens per request unless a case says otherwise, streamed over HTTP, one backend "
         "at a time."),
        (f"- Runs: {s['runs']} recorded per case, and {s['runs']} start(s) per backend; {s['warmup']} unrecorded "
         "warm-up request(s) per case in the `main` phase; the `cache-sequence` phase has no warm-up and runs "
         "its cases in order."),
        ("- Each request starts with its own session tag, so a prefix cache only helps a case that extends the "
         "one before it (`cache-extend`)."),
    ]


def _setup(summary: dict) -> list[str]:
    s = summary["settings"]
    lines = ["## Models", "", "| pair | MLX folder | GGUF |", "| --- | --- | --- |"]
    lines += [f"| {p['name']} | `{p['mlx']}` | `{p['gguf']}` |" for p in s["pairs"]]
    lines += ["", "## Backends", "", "| backend | serves | exact token count | command |", "| --- | --- | --- | --- |"]
    lines += [f"| {b['name']} | {b['serves']} | {EOS_NOTES[b['eos']]} | `{b['command']}` |" for b in s["backends"]]
    paired = sorted({e["backend"] for e in summary["cases"] if "paired" in e["tokens_from"]})
    if paired:
        note = (f"No token usage in the stream from {', '.join(paired)}: each of its requests was sent again "
                "without streaming to read the counts (not timed).")
        lines += ["", note]
    return lines


def _startup(summary: dict) -> list[str]:
    lines = ["## Startup", "", "| pair | backend | starts ok | `/v1/models` answers, ms | first completion, ms |",
             "| --- | --- | --- | --- | --- |"]
    return lines + [f"| {e['pair']} | {e['backend']} | {e['ok']}/{e['runs']} | {fmt(e['startup_ms'])} | "
                    f"{fmt(e['ready_ms'])} |" for e in summary["startup"]]


def _requests(summary: dict) -> list[str]:
    lines = ["## Requests", "", REQUESTS_NOTE]
    entries = summary["cases"]
    for pair in dict.fromkeys(e["pair"] for e in entries):
        for phase in dict.fromkeys(e["phase"] for e in entries if e["pair"] == pair):
            lines += ["", f"### {pair}, {phase}", "",
                      "| case | backend | ok | prompt tokens | TTFT ms | total ms | decode tok/s | tokens | cached |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {e['case']} | {e['backend']} | {e['ok']}/{e['runs']} | {fmt(e['prompt_tokens'])} | "
                      f"{fmt(e['ttft_ms'])} | {fmt(e['total_ms'])} | {fmt(e['decode_tps'], 1)} | "
                      f"{fmt(e['completion_tokens'])} | {fmt(e['cached_tokens'])} |"
                      for e in entries if e["pair"] == pair and e["phase"] == phase]
    return lines


def _failures(summary: dict) -> list[str]:
    lines = []
    for e in summary["startup"] + summary["cases"]:
        for error in e["errors"]:
            lines += [f"- {e['pair']} · {e['backend']} · {e.get('case', 'startup')}:", "", "  ```",
                      *("  " + line for line in error.splitlines()), "  ```"]
    return ["## Failures", "", *lines] if lines else []


def _winners(winners: list[dict]) -> list[str]:
    lines = ["## Who wins", "", WINNERS_NOTE, ""]
    by_case = {}
    for w in winners:
        by_case.setdefault((w["pair"], w["phase"], w["case"]), []).append(w)
    for (pair, phase, case), ws in by_case.items():
        parts = []
        for w in ws:
            unit = "tok/s" if w["metric"] == "decode_tps" else "ms"
            others = ", ".join(f"{b} {r:g}×" for b, r in w["ratios"].items())
            parts.append(f"{METRIC_NAMES[w['metric']]}: **{w['winner']}** {w['value']:,.1f} {unit}"
                         + (f" ({others})" if others else ""))
        lines.append(f"- {pair} · {case}: " + "; ".join(parts))
    return lines


def _first_line(errors: list[str]) -> str:
    return errors[0].splitlines()[0][:60] if errors else ""
