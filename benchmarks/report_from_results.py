"""Rebuild summary.json, report.md and the charts of `mesh-llm bench` (or `mesh-llm bench --concurrency`)
from results.jsonl files, e.g. to merge several runs (one per model shape, each with its own levels)
into one report, and print its tables.

    .venv/bin/python benchmarks/report_from_results.py OUT_DIR --settings-from SUMMARY.json \\
        [--settings-from ...] RESULTS.jsonl... [--note TEXT]

The settings and machine are those of the first --settings-from; the backends and model pairs of all of
them are listed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rich.console import Console

os.environ.setdefault("MESH_LLM_LLAMA_FIRST", "0")  # matplotlib runs here, llama.cpp never (mesh_llm/system/native.py)

from mesh_llm.bench.charts import write_charts, write_concurrency_charts  # noqa: E402
from mesh_llm.bench.concurrency_report import concurrency_tables, write_concurrency_report  # noqa: E402
from mesh_llm.bench.concurrency_summary import summarize_levels  # noqa: E402
from mesh_llm.bench.report import console_tables, write_report  # noqa: E402
from mesh_llm.bench.summary import summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--settings-from", type=Path, required=True, action="append",
                        help="a summary.json whose settings and environment describe the runs (repeatable)")
    parser.add_argument("--note", default="", help="added to the settings as 'note'")
    args = parser.parse_args()
    records = [json.loads(line) for path in args.results for line in path.read_text().splitlines() if line]
    bases = [json.loads(path.read_text()) for path in args.settings_from]
    settings = {**bases[0]["settings"], **({"note": args.note} if args.note else {})}
    settings["levels"] = sorted({n for base in bases for n in base["settings"]["levels"]})
    settings["pairs"] = list({p["name"]: p for base in bases for p in base["settings"]["pairs"]}.values())
    # a backend's command as each bench started it (--max-batch follows that bench's highest level)
    settings["backends"] = list({json.dumps(b, sort_keys=True): b for base in bases
                                 for b in base["settings"]["backends"]}.values())
    levels = any(r["kind"] in ("round", "request") for r in records)
    summary = (summarize_levels if levels else summarize)(records, settings, bases[0]["environment"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    charts = (write_concurrency_charts if levels else write_charts)(summary, args.out)
    report = (write_concurrency_report if levels else write_report)(summary, args.out, charts)
    console = Console(width=160)
    for table in (concurrency_tables if levels else console_tables)(summary):
        console.print(table)
    print(report)


if __name__ == "__main__":
    main()
