"""Keep benchmarks/results/history.csv, one row per figure: date, machine, benchmark, model,
backend, metric, value, command.

    .venv/bin/python benchmarks/history.py add RESULTS... --machine cpu|h100|h200|NAME
        [--date YYYY-MM-DD] [--command "what produced it"] [--dry-run]
    .venv/bin/python benchmarks/history.py show [--machine M] [--benchmark TEXT] [--metric TEXT]

``add`` reads what the maintained benchmarks write and appends their headline figures:

- ``mesh-llm bench``'s ``summary.json`` (single-stream cases and startup, or ``--concurrency`` levels);
  a folder is searched for ``summary.json``;
- ``startup.py``'s ``startup.jsonl`` (the median of each label's runs);
- the JSON written by ``engines.py``, ``prompt_cache.py``, ``mesh.py``, ``blas.py`` and ``constrain.py``.

The date comes from the results where they record it (else today's, or ``--date``); the command from
the summary's settings for ``mesh-llm bench`` (else ``--command``). A row whose date, machine,
benchmark, model, backend and metric are already in the table is replaced, so adding a result twice
changes nothing. ``show`` prints the latest value of each figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from datetime import date as Date
from pathlib import Path

CSV = Path(__file__).parent / "results" / "history.csv"
FIELDS = ["date", "machine", "benchmark", "model", "backend", "metric", "value", "command"]
KEY = FIELDS[:6]


def bench_command(settings: dict) -> str:
    """The `mesh-llm bench` command a summary's settings describe (model paths left out)."""
    parts = ["mesh-llm bench"]
    if settings.get("levels"):
        parts.append("--concurrency " + ",".join(str(n) for n in settings["levels"]))
    names = sorted({b["name"] for b in settings.get("backends", [])})
    if names:
        parts.append("--backends " + ",".join(names))
    for flag, key in (
        ("--runs", "runs"),
        ("--warmup", "warmup"),
        ("--max-tokens", "max_tokens"),
        ("--ctx-size", "ctx_size"),
        ("--threads", "threads"),
    ):
        if settings.get(key) is not None:
            parts.append(f"{flag} {settings[key]}")
    return " ".join(parts)


def from_bench(s: dict) -> list[dict]:
    cmd, rows = bench_command(s["settings"]), []
    for r in s.get("levels", []):  # --concurrency
        bench = f"concurrency {r['case']} x{r['level']}"
        rows += [
            {
                "benchmark": bench,
                "model": r["pair"],
                "backend": r["backend"],
                "metric": "summed_tok_s",
                "value": r["throughput_tps"]["median"],
            },
            {
                "benchmark": bench,
                "model": r["pair"],
                "backend": r["backend"],
                "metric": "ttft_p50_ms",
                "value": r["ttft_ms"]["p50"],
            },
            {
                "benchmark": bench,
                "model": r["pair"],
                "backend": r["backend"],
                "metric": "ttft_p95_ms",
                "value": r["ttft_ms"]["p95"],
            },
        ]
    for r in s.get("cases", []):  # single-stream cases
        for metric, key in (("ttft_ms", "ttft_ms"), ("decode_tok_s", "decode_tps")):
            if (r.get(key) or {}).get("median") is not None:
                rows.append(
                    {
                        "benchmark": f"bench {r['case']}",
                        "model": r["pair"],
                        "backend": r["backend"],
                        "metric": metric,
                        "value": r[key]["median"],
                    }
                )
    for r in s.get("startup", []):  # a median over runs, or (--concurrency) one start a level
        for metric in ("startup_ms", "ready_ms"):
            value = r.get(metric)
            value = value.get("median") if isinstance(value, dict) else value
            if value is not None:
                level = f" x{r['level']}" if r.get("level") else ""
                rows.append(
                    {
                        "benchmark": "bench startup" + level,
                        "model": r["pair"],
                        "backend": r["backend"],
                        "metric": metric,
                        "value": value,
                    }
                )
    for row in rows:
        row["command"] = cmd
    return rows


def from_startup(lines: list[dict]) -> list[dict]:
    by_label: dict[str, list[dict]] = {}
    for line in lines:
        by_label.setdefault(line.get("label", ""), []).append(line)
    rows = []
    for label, runs in by_label.items():
        args = runs[0].get("serve_args", [])
        model = Path(args[args.index("--model") + 1]).name if "--model" in args else "default"
        engine = args[args.index("--engine") + 1] if "--engine" in args else "auto"
        cmd = "benchmarks/startup.py -- " + " ".join(args)
        for metric in ("listening_s", "ok_s", "first_token_s"):
            values = [r[metric] for r in runs if r.get(metric) is not None]
            if values:
                rows.append(
                    {
                        "benchmark": "startup",
                        "model": model,
                        "backend": label or f"mesh-llm {engine}",
                        "metric": "health_ok_s" if metric == "ok_s" else metric,
                        "value": statistics.median(values),
                        "command": cmd,
                    }
                )
    return rows


def from_json(d: dict) -> list[dict]:
    rows = []
    if isinstance(d.get("results"), list):  # engines.py
        for r in d["results"]:
            model, backend = Path(r["path"]).name, f"{r['engine']} ({r.get('backend', '')})"
            if "batches" in r:
                for b in r["batches"]:
                    for metric in ("decode_tok_s", "step_ms", "ttft_last_s"):
                        if b.get(metric) is not None:
                            rows.append(
                                {
                                    "benchmark": f"engine batch x{b['batch']}",
                                    "model": model,
                                    "backend": backend,
                                    "metric": metric,
                                    "value": b[metric],
                                    "command": f"benchmarks/engines.py --batch ... --prompt-tokens "
                                    f"{r.get('prompt_tokens')} --decode-tokens {r.get('decode_tokens')}",
                                }
                            )
            else:
                cmd = "benchmarks/engines.py"
                rows.append(
                    {
                        "benchmark": "engine",
                        "model": model,
                        "backend": backend,
                        "metric": "load_s",
                        "value": r["load_s"],
                        "command": cmd,
                    }
                )
                rows.append(
                    {
                        "benchmark": "engine",
                        "model": model,
                        "backend": backend,
                        "metric": "decode_tok_s",
                        "value": r["decode_tok_s"],
                        "command": cmd,
                    }
                )
                for n, s in r["ttft_s"].items():
                    rows.append(
                        {
                            "benchmark": "engine",
                            "model": model,
                            "backend": backend,
                            "metric": f"ttft_ms_{n}",
                            "value": 1000 * s,
                            "command": cmd,
                        }
                    )
    elif "verdict" in d and "extend" in d:  # prompt_cache.py
        cmd = f"benchmarks/prompt_cache.py --engine {d['engine']}"
        rows += [
            {
                "benchmark": "prompt-cache",
                "model": Path(d["model"]).name,
                "backend": f"mesh-llm {d['engine']}",
                "metric": k,
                "value": v,
                "command": cmd,
            }
            for k, v in d["verdict"].items()
            if k != "pass"
        ]
    elif "proxy_overhead" in d:  # mesh.py
        s, threads = d["summary"], d["settings"].get("threads")
        cmd, backend = f"benchmarks/mesh.py --threads {threads}", f"mesh-llm llama, {threads} threads"
        figures = {
            k: s[k] for k in ("ttft_paired_delta_ms", "decode_ratio", "fifth_turn_affinity_over_random")
        }
        figures["entry_cpu_us_per_token"] = s["entry_cpu"]["us_per_token"]
        figures |= {f"forget_s_{how.replace(' ', '')}": v for how, v in s["forget_s"].items()}
        rows += [
            {
                "benchmark": "mesh",
                "model": "default",
                "backend": backend,
                "metric": k,
                "value": v,
                "command": cmd,
            }
            for k, v in figures.items()
        ]
    elif isinstance(d.get("results"), dict):  # blas.py
        size, threads, rounds = d.get("size"), d.get("threads"), d.get("rounds")
        cmd = f"benchmarks/blas.py --size {size} --threads {threads} --rounds {rounds}"
        rows += [
            {
                "benchmark": "blas matmul",
                "model": f"float32 {d.get('size')}^3",
                "backend": r["blas"],
                "metric": "gflops",
                "value": r["median_gflops"],
                "command": cmd,
            }
            for r in d["results"].values()
        ]
    elif isinstance(d.get("rows"), list):  # constrain.py
        for r in d["rows"]:
            if "library" in r:
                for metric in ("compile_ms_median", "mask_us_median", "mask_us_p95", "mask_us_mean"):
                    rows.append(
                        {
                            "benchmark": "constrain",
                            "model": f"vocab {r['vocab']}",
                            "backend": r["library"],
                            "metric": metric,
                            "value": r[metric],
                            "command": "benchmarks/constrain.py",
                        }
                    )
    return rows


def read(path: Path) -> tuple[list[dict], str | None]:
    """Rows and the date the results record (ISO), from one file."""
    if path.suffix == ".jsonl":
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return (from_startup(lines) if lines and "ok_s" in lines[0] else []), None
    d = json.loads(path.read_text())
    started = (d.get("settings") or {}).get("started") or d.get("started")
    if isinstance(started, (int, float)):
        started = None
    rows = from_bench(d) if "settings" in d and ("levels" in d or "cases" in d) else from_json(d)
    return rows, (started or "")[:10] or None


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def add(args) -> None:
    found: list[Path] = []
    for p in args.results:
        found += sorted(p.rglob("summary.json")) + sorted(p.rglob("startup.jsonl")) if p.is_dir() else [p]
    new = []
    for path in found:
        rows, when = read(path)
        if not rows:
            print(f"{path}: nothing this script knows", file=sys.stderr)
        for row in rows:
            value = row["value"]
            row.update(
                date=args.date or when or Date.today().isoformat(),
                machine=args.machine,
                value=f"{round(value, 4):.6g}" if isinstance(value, float) else str(value),
            )
            if args.command:
                row["command"] = args.command
            new.append({k: row.get(k, "") for k in FIELDS})
    if args.dry_run:
        writer = csv.DictWriter(sys.stdout, FIELDS)
        writer.writerows(new)
        return
    new = list({tuple(r[k] for k in KEY): r for r in new}.values())  # the last of a figure added twice
    keys = {tuple(r[k] for k in KEY) for r in new}
    table = [r for r in load(args.csv) if tuple(r[k] for k in KEY) not in keys] + new
    table.sort(key=lambda r: (r["machine"], r["benchmark"], r["model"], r["backend"], r["metric"], r["date"]))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(table)
    print(f"{len(new)} rows into {args.csv} ({len(table)} in all)")


def show(args) -> None:
    latest: dict[tuple, dict] = {}
    for r in load(args.csv):
        if args.machine and r["machine"] != args.machine:
            continue
        if (args.benchmark and args.benchmark not in r["benchmark"]) or (
            args.metric and args.metric not in r["metric"]
        ):
            continue
        key = (r["machine"], r["benchmark"], r["model"], r["backend"], r["metric"])
        if key not in latest or r["date"] >= latest[key]["date"]:
            latest[key] = r
    print("| date | machine | benchmark | model | backend | metric | value |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in latest.values():
        print(
            f"| {r['date']} | {r['machine']} | {r['benchmark']} | {r['model']} | {r['backend']} | "
            f"{r['metric']} | {r['value']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CSV)
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("add", help="append a result's figures")
    p.add_argument(
        "results", type=Path, nargs="+", help="summary.json, startup.jsonl, a script's JSON, or a folder"
    )
    p.add_argument("--machine", required=True, help="cpu, h100, h200, ...")
    p.add_argument("--date", help="YYYY-MM-DD (default: what the results record, else today)")
    p.add_argument("--command", help="the command that produced them (default: from the results)")
    p.add_argument("--dry-run", action="store_true", help="print the rows instead of writing them")
    p = sub.add_parser("show", help="the latest value of each figure, as a Markdown table")
    p.add_argument("--machine")
    p.add_argument("--benchmark")
    p.add_argument("--metric")
    args = parser.parse_args()
    (add if args.action == "add" else show)(args)


if __name__ == "__main__":
    main()
