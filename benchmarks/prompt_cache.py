"""Prompt-cache reuse as clients see it, over HTTP against spawned `mesh-llm serve` processes of one
engine: first with its prompt cache, then with `--cache-bytes 0` for the cold figures (never both at
once). Three scenarios, each against its target:

- cache-extend: the next turn of a chat over a ~1,000-token briefing; its TTFT against the cold
  TTFT of the very same prompt (target <= 25%);
- shared document: a 4,000-token document and five different questions; the TTFT of questions 2-5
  against question 1's (target <= 20%);
- 10-turn chat: TTFT of every turn, with and without the cache; with it, turn 10 must stay within
  1.5x of turn 2 (flat) where the cold TTFT grows with the conversation.

TTFT is the time to the first streamed content (or to the end, for a reply with none). Not a test.

    .venv/bin/python benchmarks/prompt_cache.py [--engine mlx|llama] [--model PATH] [--out FILE.json]

Writes the results as JSON with ``--out`` (``benchmarks/history.py add`` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from mesh_llm.bench.backends import Backend, Server, Settings
from mesh_llm.bench.cases import context_text
from mesh_llm.bench.environment import describe
from mesh_llm.bench.tokenizer import load_tokenizer
from mesh_llm.system.machine import physical_cores

TARGETS = {"extend": 0.25, "document": 0.20, "flat": 1.5}
QUESTIONS = ["Which team added caching in front of the search index, and when?",
             "Who owns the follow-up of item 12?", "List three items where error rates fell.",
             "Which changes made costs rise?", "Summarize items 20 to 25 in two sentences."]
TOPICS = ["the sea", "volcanoes", "bees", "the moon", "glaciers", "owls", "deserts", "coral reefs",
          "thunderstorms", "tea"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "llama"], default="mlx")
    parser.add_argument("--model", type=Path, help="a model folder or .gguf file (default: the embedded one)")
    parser.add_argument("--runs", type=int, default=3, help="cache-extend repetitions (median)")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    tokenizer = _tokenizer(args.model)
    settings = Settings(threads=args.threads, ctx_size=8192, startup_timeout=1800)
    logs = Path(tempfile.mkdtemp(prefix="prompt-cache-"))
    started, load_before = datetime.now(timezone.utc), os.getloadavg()

    with _running(args, settings, logs, []) as warm:
        extend = [_extend(warm, tokenizer, f"{args.engine}-{i}") for i in range(args.runs)]
        document = _document(warm, tokenizer)
        chat = _chat(warm)
        details = _details(warm)
    with _running(args, settings, logs, ["--cache-bytes", "0"]) as cold:
        for run in extend:
            run["cold"] = _ask(cold, run.pop("messages"), 1)
        for turn in chat:
            turn["cold"] = _ask(cold, turn.pop("messages"), 1)

    results = {"engine": args.engine, "model": str(args.model or "embedded SmolLM2-135M-Instruct"),
               "started": started.isoformat(timespec="seconds"), "load_average_before": load_before,
               "load_average_after": os.getloadavg(), "server": details, "targets": TARGETS,
               "environment": describe(None), "extend": extend, "document": document, "chat": chat}
    results["verdict"] = _report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    print(f"server logs in {logs}")


def _tokenizer(model: Path | None):
    if model is None:
        from mesh_llm.models import default_gguf

        return load_tokenizer(None, default_gguf())
    return load_tokenizer(model, None) if model.is_dir() else load_tokenizer(None, model)


class _running:
    """A `mesh-llm serve` for the benchmark's engine and model, stopped on leaving."""

    def __init__(self, args, settings: Settings, logs: Path, extra: list[str]):
        model = [] if args.model is None else ["--model", str(args.model)]

        def argv(_model: Path, port: int, s: Settings) -> list[str]:
            return [sys.executable, "-m", "mesh_llm", "serve", *model, "--engine", args.engine,
                    "--host", "127.0.0.1", "--port", str(port), "--threads", str(s.threads),
                    "--ctx-size", str(s.ctx_size), *extra]

        name = f"mesh-{args.engine}" + ("-cold" if extra else "")
        self.server = Server(Backend(name, "any", None, argv), Path("model"), settings, logs / f"{name}.log")

    def __enter__(self) -> Server:
        print(f"starting {self.server.backend.name} …", file=sys.stderr)
        self.server.start()
        self.server.wait_ready()  # one completion: first-use costs stay out of the figures
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.stop()


def _ask(server: Server, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion: TTFT, the reply's text, and its usage."""
    body = {"model": server.model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, first, usage = [], None, {}
    start = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=3600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if first is None and (content or choice.get("finish_reason")):
                    first = time.perf_counter()
                text.append(content or "")
            usage = chunk.get("usage") or usage
    return {"ttft_s": round(first - start, 4), "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def _system(tokenizer, tag: str, tokens: int) -> str:
    """A briefing of about ``tokens`` tokens, opened by a tag so no two runs share a prefix."""
    text = context_text("briefing", 8 * tokens + 4096)
    lo, hi = 0, len(text)
    while lo < hi:  # the shortest cut whose system message reaches the size
        mid = (lo + hi) // 2
        if tokenizer.count([{"role": "system", "content": text[:mid]}]) < tokens:
            lo = mid + 1
        else:
            hi = mid
    return f"Conversation {tag}. Answer from these notes.\n{text[:lo]}"


def _extend(server: Server, tokenizer, tag: str) -> dict:
    messages = [{"role": "system", "content": _system(tokenizer, tag, 1000)},
                {"role": "user", "content": "Summarize item 3 in one sentence."}]
    base = _ask(server, messages, 32)
    messages += [{"role": "assistant", "content": base.pop("text")},
                 {"role": "user", "content": "Now summarize item 7 in one sentence."}]
    warm = _ask(server, messages, 32)
    warm.pop("text")
    return {"base": base, "warm": warm, "messages": messages}


def _document(server: Server, tokenizer) -> list[dict]:
    system = _system(tokenizer, "document", 4000)
    asked = []
    for question in QUESTIONS:
        answer = _ask(server, [{"role": "system", "content": system}, {"role": "user", "content": question}], 16)
        answer.pop("text")
        asked.append({"question": question, **answer})
    return asked


def _chat(server: Server) -> list[dict]:
    messages = [{"role": "system", "content": "Conversation chat. You are a friendly assistant who answers "
                                              "in two or three sentences."}]
    turns = []
    for topic in TOPICS:
        messages.append({"role": "user", "content": f"Tell me something surprising about {topic}."})
        reply = _ask(server, messages, 48)
        turns.append({"messages": [dict(m) for m in messages], **reply})
        messages.append({"role": "assistant", "content": turns[-1].pop("text")})
    return turns


def _details(server: Server) -> dict:
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    cache = httpx.get(server.url + "/api/cache", timeout=30).json()["data"][0]
    device = "gpu" if "(gpu, " in server.log.read_text(errors="replace") else "cpu"  # the ready line
    return {"model_id": model["id"], "engine": model.get("engine"), "device": device, "cache": cache}


def _report(r: dict) -> dict:
    ratios = [run["warm"]["ttft_s"] / run["cold"]["ttft_s"] for run in r["extend"]]
    extend = statistics.median(ratios)
    print(f"\n{r['engine']} engine, {r['model']}, load average {r['load_average_before'][0]:.2f} "
          f"before, {r['load_average_after'][0]:.2f} after")
    print("\ncache-extend: the next chat turn over a briefing")
    for run in r["extend"]:
        w, c = run["warm"], run["cold"]
        print(f"  prompt {w['prompt_tokens']} tokens, {w['cached_tokens']} reused: TTFT {w['ttft_s']:.3f} s "
              f"with the cache, {c['ttft_s']:.3f} s cold ({w['ttft_s'] / c['ttft_s']:.1%})")
    print(f"  median {extend:.1%} of cold (target <= {TARGETS['extend']:.0%}): {_verdict(extend <= TARGETS['extend'])}")

    first, rest = r["document"][0], r["document"][1:]
    worst = max(q["ttft_s"] for q in rest) / first["ttft_s"]
    print(f"\nshared document: {first['prompt_tokens']}-token prompt, five questions")
    for i, q in enumerate(r["document"], 1):
        print(f"  question {i}: TTFT {q['ttft_s']:.3f} s, {q['cached_tokens']} reused "
              f"({q['ttft_s'] / first['ttft_s']:.1%} of question 1)")
    print(f"  worst of questions 2-5: {worst:.1%} (target <= {TARGETS['document']:.0%}): "
          f"{_verdict(worst <= TARGETS['document'])}")

    chat = r["chat"]
    flat = chat[-1]["ttft_s"] / chat[1]["ttft_s"]
    growth = chat[-1]["cold"]["ttft_s"] / chat[0]["cold"]["ttft_s"]
    print("\n10-turn chat: TTFT per turn")
    for i, t in enumerate(chat, 1):
        print(f"  turn {i:2d}: prompt {t['prompt_tokens']:5d}, reused {t['cached_tokens']:5d}: "
              f"{t['ttft_s']:.3f} s with the cache, {t['cold']['ttft_s']:.3f} s cold")
    print(f"  turn 10 / turn 2 with the cache: {flat:.2f}x (target <= {TARGETS['flat']}x): "
          f"{_verdict(flat <= TARGETS['flat'])}; cold turn 10 / turn 1: {growth:.2f}x")
    return {"extend_ratio": extend, "document_worst_ratio": worst, "chat_turn10_over_turn2": flat,
            "chat_cold_turn10_over_turn1": growth,
            "pass": extend <= TARGETS["extend"] and worst <= TARGETS["document"] and flat <= TARGETS["flat"]}


def _verdict(ok: bool) -> str:
    return "meets it" if ok else "MISSES it"


if __name__ == "__main__":
    main()
