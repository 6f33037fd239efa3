"""PNG charts of a summary: per case × backend (TTFT, total time, decode rate) and startup per backend;
for ``--concurrency``, summed tokens/s and TTFT p95 over the levels, per backend.

Bars are medians, whiskers span min to max; one panel per model pair. A logarithmic axis is used when
the bars of a panel differ by more than 30×, so that fast and slow backends both stay readable. A
backend that failed a case gets "failed" where its bar would be.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CASE_CHARTS = [("ttft_ms", "ttft.png", "time to first token", "ms (lower is better)"),
               ("total_ms", "total.png", "total time", "ms (lower is better)"),
               ("decode_tps", "decode.png", "decode rate", "tokens/s after the first (higher is better)")]


def write_charts(summary: dict, out: Path) -> list[Path]:
    written = []
    pairs = list(dict.fromkeys(e["pair"] for e in summary["cases"] + summary["startup"]))
    for metric, name, title, label in CASE_CHARTS:
        if summary["cases"]:
            written.append(_case_chart(summary["cases"], pairs, metric, title, label, out / name))
    if summary["startup"]:
        written.append(_startup_chart(summary["startup"], pairs, out / "startup.png"))
    return written


def _case_chart(entries: list[dict], pairs: list[str], metric: str, title: str, label: str, path: Path) -> Path:
    cases = list(dict.fromkeys(e["case"] for e in entries))
    fig, axes = plt.subplots(len(pairs), 1, figsize=(max(8, 1.9 * len(cases) + 2), 4.2 * len(pairs)),
                             squeeze=False)
    for ax, pair in zip(axes[:, 0], pairs):
        mine = {(e["backend"], e["case"]): e for e in entries if e["pair"] == pair}
        backends = list(dict.fromkeys(b for b, _ in mine))
        groups = [[mine.get((b, c)) for c in cases] for b in backends]
        _bars(ax, cases, backends, [[e and e[metric] for e in row] for row in groups], label, f"{pair}: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _startup_chart(entries: list[dict], pairs: list[str], path: Path) -> Path:
    fig, axes = plt.subplots(len(pairs), 1, figsize=(9, 4 * len(pairs)), squeeze=False)
    for ax, pair in zip(axes[:, 0], pairs):
        mine = [e for e in entries if e["pair"] == pair]
        backends = [e["backend"] for e in mine]
        series = [[e["startup_ms"] for e in mine], [e["ready_ms"] for e in mine]]
        _bars(ax, backends, ["/v1/models answers", "first completion"], series,
              "ms since the process started", f"{pair}: startup")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bars(ax, groups: list[str], series_names: list[str], series: list[list[dict | None]], label: str,
          title: str) -> None:
    """Grouped bars: one group per ``groups`` entry, one bar per series; None values say "failed"."""
    width = 0.8 / max(1, len(series_names))
    medians = [s["median"] for row in series for s in row if s and s["median"]]
    log = bool(medians) and max(medians) / max(min(medians), 1e-9) > 30
    for i, (name, row) in enumerate(zip(series_names, series)):
        xs = [g + (i - (len(series_names) - 1) / 2) * width for g in range(len(groups))]
        med = [s["median"] if s else 0 for s in row]
        err = [[s["median"] - s["min"] if s else 0 for s in row], [s["max"] - s["median"] if s else 0 for s in row]]
        bars = ax.bar(xs, med, width, yerr=err, capsize=2, label=name)
        for x, s, bar in zip(xs, row, bars):
            if s is None:
                ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7, color="red",
                        transform=ax.get_xaxis_transform())
            else:
                ax.annotate(_short(s["median"]), (x, bar.get_height()), ha="center", va="bottom", fontsize=6,
                            xytext=(0, 1), textcoords="offset points")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), groups, rotation=12)
    ax.set_ylabel(label + (" (log scale)" if log else ""), fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def _short(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


LEVEL_CHARTS = [
    ("throughput_tps", "throughput.png", "summed tokens/s", "completion tokens / wall time (higher is better)"),
    ("ttft_p95_ms", "ttft-p95.png", "TTFT p95", "ms (lower is better)"),
]


def write_concurrency_charts(summary: dict, out: Path) -> list[Path]:
    """``--concurrency``: one line per backend over the levels, one panel per model pair and case."""
    entries = summary["levels"]
    if not entries:
        return []
    panels = list(dict.fromkeys((e["pair"], e["case"]) for e in entries))
    return [_level_chart(entries, panels, metric, title, label, out / name)
            for metric, name, title, label in LEVEL_CHARTS]


def _level_chart(entries: list[dict], panels: list[tuple], metric: str, title: str, label: str, path: Path) -> Path:
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 4.2 * len(panels)), squeeze=False)
    for ax, (pair, case) in zip(axes[:, 0], panels):
        mine = [e for e in entries if (e["pair"], e["case"]) == (pair, case)]
        levels = sorted({e["level"] for e in mine})
        values = []
        for backend in dict.fromkeys(e["backend"] for e in mine):
            points = sorted((e["level"], _level_point(e, metric)) for e in mine if e["backend"] == backend)
            shown = [(level, p) for level, p in points if p]
            failed = [f"×{level}" for level, p in points if not p]
            name = backend + (f" (failed: {', '.join(failed)})" if failed else "")
            if not shown:
                ax.plot([], [], marker="x", linestyle="", label=name)
                continue
            xs, ys = [level for level, _ in shown], [p[0] for _, p in shown]
            ax.errorbar(xs, ys, yerr=[[p[1] for _, p in shown], [p[2] for _, p in shown]], marker="o", capsize=3,
                        label=name)
            for x, y in zip(xs, ys):
                ax.annotate(_short(y), (x, y), ha="center", va="bottom", fontsize=6, xytext=(0, 3),
                            textcoords="offset points")
            values += ys
        if values and max(values) / max(min(values), 1e-9) > 30:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
        ax.set_xlabel("streams sent at once", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.set_title(f"{pair} · {case}: {title}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _level_point(entry: dict, metric: str) -> tuple[float, float, float] | None:
    """(value, distance down to the min, up to the max): the median over rounds with its range, or the
    TTFT p95 alone (one figure over every request of the level)."""
    if metric == "ttft_p95_ms":
        return entry["ttft_ms"] and (entry["ttft_ms"]["p95"], 0.0, 0.0)
    s = entry[metric]
    return s and (s["median"], s["median"] - s["min"], s["max"] - s["median"])
