"""Rebuild summary.json, report.md and the charts of `mesh-llm bench` from results.jsonl files, e.g.
when one benchmark was run in several device calls (benchmarks/gpu_session.sh).

    python benchmarks/report_from_results.py OUT_DIR --settings-from SUMMARY.json RESULTS.jsonl...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mesh_llm.bench.charts import write_charts
from mesh_llm.bench.report import write_report
from mesh_llm.bench.summary import summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--settings-from", type=Path, required=True,
                        help="a summary.json whose settings and environment describe the runs")
    parser.add_argument("--note", default="", help="added to the settings as 'note'")
    args = parser.parse_args()
    records = [json.loads(line) for path in args.results for line in path.read_text().splitlines() if line]
    base = json.loads(args.settings_from.read_text())
    settings = {**base["settings"], **({"note": args.note} if args.note else {})}
    summary = summarize(records, settings, base["environment"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(write_report(summary, args.out, write_charts(summary, args.out)))


if __name__ == "__main__":
    main()
