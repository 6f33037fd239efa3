"""What a change to the mesh's relay does to the decode rate through one hop: an entry node on the
code of git revision REV and one on the working tree, in front of the same serving node, measured
in the same minutes.

    .venv/bin/python benchmarks/hop_ab.py REV [--triples 40] [--tokens 128] [--threads N] [--out DIR]

Starts a serving node (the embedded SmolLM2 on llama.cpp, ``--alias bench``, the working tree's
code), then two API-only nodes joined to it: ``old`` runs REV's ``src/`` (``git archive``, put
first on PYTHONPATH) and ``new`` the working tree. Then triples of streamed chats of ``--tokens``
tokens (EOS ignored): straight to the serving node, through ``old``, through ``new``, in an order
that rotates triple by triple. On a machine whose engine holds every core, the decode rate
through a hop varies by ±10% from one request to the next, so a before/after figure from two
separate runs of ``benchmarks/mesh.py`` cannot show a change of a few percent; side by side it can.
Reports, per entry node, the median of the paired ratios hop / direct and its CPU time per
streamed token (user + system, heartbeats included), and the median of new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from mesh import cpu_seconds, node, stream  # benchmarks/, the script's own folder

from mesh_llm.bench.backends import Settings
from mesh_llm.bench.environment import describe
from mesh_llm.machine import physical_cores

ROOT = Path(__file__).resolve().parents[1]


def export_src(rev: str, folder: Path) -> Path:
    """REV's ``src/`` in ``folder``; the working tree is left alone."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the git revision the old entry node runs")
    parser.add_argument("--old-src", type=Path, help="run the old entry node on this src/ folder instead "
                        "(REV then only names it in the results)")
    parser.add_argument("--triples", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results/hop-ab-<date>/)")
    args = parser.parse_args()
    started, load_before = datetime.now(timezone.utc), os.getloadavg()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"], check=True,
                           capture_output=True, text=True).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip()]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    logs = Path(tempfile.mkdtemp(prefix="hop-ab-"))
    old_src = args.old_src.resolve() if args.old_src else export_src(rev, logs)
    token = secrets.token_urlsafe(24)
    settings = Settings(threads=args.threads, ctx_size=4096, startup_timeout=600)
    body = {"model": "bench", "max_tokens": args.tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}

    with ExitStack() as stack:
        serving = node(stack, settings, logs, token, "serving", ["--alias", "bench"])
        old = node(stack, settings, logs, token, "old", ["--client", "--join", serving.url], "bench",
                   pythonpath=old_src)
        new = node(stack, settings, logs, token, "new", ["--client", "--join", serving.url], "bench")
        servers = {"direct": serving, "old": old, "new": new}
        for _ in range(2):  # warm: the prompt is in the cache, connections are open
            for server in servers.values():
                stream(server, body)
        names, triples = list(servers), []
        cpu, tokens = {"old": 0.0, "new": 0.0}, {"old": 0, "new": 0}
        for i in range(args.triples):
            order = names[i % 3:] + names[:i % 3]
            order = order[::-1] if i % 2 else order
            triple = {}
            for name in order:
                before = cpu_seconds(servers[name]) if name != "direct" else 0.0
                triple[name] = stream(servers[name], body)
                if name != "direct":
                    cpu[name] += cpu_seconds(servers[name]) - before
                    tokens[name] += triple[name]["completion_tokens"]
            triples.append(triple)
            print(f"triple {i + 1}/{args.triples}: " + ", ".join(
                f"{n} {triple[n]['decode_tps']:.1f}" for n in names) + " tok/s", file=sys.stderr)

    summary = {"direct_decode_tps": statistics.median(t["direct"]["decode_tps"] for t in triples)}
    for name in ("old", "new"):
        ratios = [t[name]["decode_tps"] / t["direct"]["decode_tps"] for t in triples]
        summary[name] = {"decode_tps": statistics.median(t[name]["decode_tps"] for t in triples),
                         "paired_ratio_median": statistics.median(ratios),
                         "paired_ratio_mean": statistics.mean(ratios),
                         "entry_cpu_us_per_token": cpu[name] / tokens[name] * 1e6}
    summary["new_over_old_median"] = statistics.median(t["new"]["decode_tps"] / t["old"]["decode_tps"]
                                                       for t in triples)
    results = {"started": started.isoformat(timespec="seconds"), "load_average_before": load_before,
               "load_average_after": os.getloadavg(),
               "old": f"{args.rev} ({rev})" + (f", src/ from {args.old_src}" if args.old_src else ""),
               "new": f"working tree at {head}" + (f" (uncommitted in src/: {', '.join(dirty)})" if dirty else ""),
               "settings": vars(args) | {"out": str(args.out), "old_src": str(args.old_src)},
               "environment": describe(None),
               "triples": triples, "summary": summary}
    out = args.out or Path(__file__).parent / "results" / f"hop-ab-{started:%Y%m%d}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nload average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"old = {results['old']}, new = {results['new']}")
    print(f"direct: {summary['direct_decode_tps']:.1f} tok/s (median)")
    for name in ("old", "new"):
        s = summary[name]
        print(f"through {name}: {s['decode_tps']:.1f} tok/s; hop / direct paired median "
              f"{s['paired_ratio_median']:.3f} (mean {s['paired_ratio_mean']:.3f}); "
              f"entry CPU {s['entry_cpu_us_per_token']:.0f} µs a token")
    print(f"new / old paired median {summary['new_over_old_median']:.3f}\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
