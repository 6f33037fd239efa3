"""What the mesh costs and what its routing gains, over HTTP against `mesh-llm serve` nodes spawned on
loopback (the embedded model on the llama engine):

- proxy overhead: the same streamed chat sent straight to the serving node and through one hop (a
  client node that forwards it), interleaved pair by pair, many times, for a plain hop (nodes on
  loopback use their API ports) and an encrypted one (``--mesh-port``: TLS pinned to node keys, as
  between machines) side by side. TTFT with the prompt cached (so what is left is mostly fixed
  costs: the hop shows), and the decode rate over N tokens with EOS ignored. Medians, the paired
  difference and the ratio.
- prefix affinity vs random routing: 5-turn conversations over a long system prompt, through a
  client node in front of two replicas of one model; once routed by the mesh, once with every turn
  sent to a random replica (``x-mesh-target``); the TTFT of the 5th turn.
- forgetting a node: how long after `kill -9` (and after SIGTERM) a node's model leaves the
  entry node's /v1/models.

TTFT is the time to the first streamed content. Not a test.

    .venv/bin/python benchmarks/mesh.py [--pairs 60] [--decode-pairs 15] [--decode-tokens 128]
                                        [--conversations 8] [--threads N] [--out FILE.json]

With ``--threads 1`` the serving node leaves a core to the entry node, so what the hop itself costs
shows apart from the CPU it takes from the engine on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

import httpx

from mesh_llm.bench.backends import Backend, Server, Settings
from mesh_llm.bench.cases import context_text
from mesh_llm.bench.environment import describe
from mesh_llm.system.machine import physical_cores

USER_TURNS = ["Summarize item 3 in one sentence.", "And item 7?", "Which items mention costs?",
              "Which team appears most often?", "Name one risk from the notes."]
REPLIES = ["Item 3 is about a faster search index.", "Item 7 moved the nightly jobs.",
           "Items 4 and 9 mention costs.", "The platform team appears most often.",
           "A risk is the delayed migration."]


# the hops compared: nodes on loopback use their API ports unless given a mesh port
HOPS = {"plain": [], "encrypted": ["--mesh-port", "0"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60, help="TTFT pairs (direct, one hop)")
    parser.add_argument("--decode-pairs", type=int, default=15, help="decode-rate pairs")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--conversations", type=int, default=8, help="5-turn conversations per routing mode")
    parser.add_argument("--system-chars", type=int, default=2400, help="system prompt size (~4 chars a token)")
    parser.add_argument("--forget-runs", type=int, default=3, help="kill -9 and SIGTERM runs each")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    started, load_before = datetime.now(timezone.utc), os.getloadavg()
    logs = Path(tempfile.mkdtemp(prefix="mesh-bench-"))
    token = secrets.token_urlsafe(24)
    settings = Settings(threads=args.threads, ctx_size=4096, startup_timeout=600)

    with ExitStack() as stack:
        hops = {}
        for mode, extra in HOPS.items():
            serving = node(stack, settings, logs, token, f"serving-{mode}", ["--alias", "bench", *extra])
            hops[mode] = (serving, node(stack, settings, logs, token, f"entry-{mode}",
                                        ["--client", "--join", serving.url, *extra], "bench"))
        overhead = proxy_overhead(hops, args)
    with ExitStack() as stack:
        one = node(stack, settings, logs, token, "replica-1", ["--alias", "conv"])
        two = node(stack, settings, logs, token, "replica-2", ["--alias", "conv", "--join", one.url])
        entry = node(stack, settings, logs, token, "entry-2", ["--client", "--join", two.url], "conv")
        _wait_listed(entry, "conv", 2)
        routing = affinity_vs_random(entry, ["replica-1", "replica-2"], args)
        forgetting = time_to_forget(stack, settings, logs, token, entry, args.forget_runs)

    results = {"started": started.isoformat(timespec="seconds"), "load_average_before": load_before,
               "load_average_after": os.getloadavg(), "settings": vars(args) | {"out": str(args.out)},
               "environment": describe(None), "proxy_overhead": overhead, "routing": routing,
               "forgetting": forgetting}
    results["summary"] = report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    print(f"node logs in {logs}")


def node(stack: ExitStack, settings: Settings, logs: Path, token: str, name: str, flags: list[str],
         model_id: str | None = None) -> Server:
    """A `mesh-llm serve` node, stopped when ``stack`` closes."""
    def argv(_model: Path, port: int, s: Settings) -> list[str]:
        model = [] if "--client" in flags else ["--engine", "llama", "--threads", str(s.threads),
                                                "--ctx-size", str(s.ctx_size)]
        return [sys.executable, "-m", "mesh_llm", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
                "--mesh-token", token, "--node-name", name, *flags]

    alias = model_id or flags[flags.index("--alias") + 1]
    server = Server(Backend(name, "gguf", "ignore_eos", argv, model_id=alias), Path("default"), settings,
                    logs / f"{name}.log")
    print(f"starting {name} …", file=sys.stderr)
    server.start()
    stack.callback(server.stop)
    server.wait_ready()
    return server


def _wait_listed(server: Server, model: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        if any(m["id"] == model and len(m["nodes"]) == count for m in listed):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{server.backend.name} does not list {count} nodes for {model}")


def stream(server: Server, body: dict, headers: dict | None = None) -> dict:
    """One streamed chat completion: TTFT, decode rate between the first and last content, usage,
    and who served it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    times, usage = [], {}
    start = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=600) as reply:
        reply.raise_for_status()
        served_by = reply.headers.get("x-mesh-served-by")
        for line in reply.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    tokens = usage["completion_tokens"]
    decode = (tokens - 1) / (times[-1] - times[0]) if tokens > 1 and times[-1] > times[0] else None
    return {"ttft_s": times[0] - start, "decode_tps": decode, "completion_tokens": tokens,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "served_by": served_by}


def proxy_overhead(hops: dict[str, tuple[Server, Server]], args) -> dict:
    """Interleaved pairs for each kind of hop in turn; the order within a pair alternates so drift
    falls on both sides alike. ``hops``: kind -> (serving node, entry node)."""
    ttft_body = {"model": "bench", "max_tokens": 2,
                 "messages": [{"role": "system", "content": "You are a helpful assistant."},
                              {"role": "user", "content": "Name one color."}]}
    decode_body = {"model": "bench", "max_tokens": args.decode_tokens, "ignore_eos": True,
                   "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}
    for serving, entry in hops.values():
        for _ in range(3):  # warm: the prompt is in the cache, connections are open
            stream(serving, ttft_body)
            stream(entry, ttft_body)
    out = {mode: {"ttft": [], "decode": [], "cpu": {"ttft": 0.0, "decode": 0.0}} for mode in hops}

    def pairs(body: dict, count: int, kind: str) -> None:
        for i in range(count):
            for mode, (serving, entry) in hops.items():
                order = [("direct", serving), ("hop", entry)] if i % 2 == 0 else [("hop", entry), ("direct", serving)]
                before = cpu_seconds(entry)
                out[mode][kind].append({name: stream(server, body) for name, server in order})
                out[mode]["cpu"][kind] += cpu_seconds(entry) - before

    print(f"proxy overhead: {args.pairs} TTFT pairs per hop …", file=sys.stderr)
    pairs(ttft_body, args.pairs, "ttft")
    print(f"proxy overhead: {args.decode_pairs} decode pairs of {args.decode_tokens} tokens per hop …",
          file=sys.stderr)
    pairs(decode_body, args.decode_pairs, "decode")
    for r in out.values():
        tokens = sum(p["hop"]["completion_tokens"] for p in r["decode"])
        cpu = r.pop("cpu")
        r["entry_cpu"] = {"ms_per_request": cpu["ttft"] / len(r["ttft"]) * 1e3,
                          "us_per_token": cpu["decode"] / tokens * 1e6}
    return out


def cpu_seconds(server: Server) -> float:
    """CPU time (user + system) the node's process has used: the hop's cost, which a busy machine's
    wall clock hides."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def affinity_vs_random(entry: Server, replicas: list[str], args) -> dict:
    """Conversations alternate between the two modes, each with its own tag, so no
    conversation can reuse another's cache."""
    rng = random.Random(13)
    notes = context_text("briefing", args.system_chars)
    runs = {"affinity": [], "random": []}
    for k in range(args.conversations):
        for mode in ("affinity", "random") if k % 2 == 0 else ("random", "affinity"):
            print(f"routing: conversation {k + 1}/{args.conversations}, {mode} …", file=sys.stderr)
            system = f"Conversation {mode}-{k}-{secrets.token_hex(4)}. Answer from these notes.\n{notes}"
            messages = [{"role": "system", "content": system}]
            turns = []
            for user, canned in zip(USER_TURNS, REPLIES):
                messages.append({"role": "user", "content": user})
                headers = {"x-mesh-target": rng.choice(replicas)} if mode == "random" else None
                turns.append(stream(entry, {"model": "conv", "max_tokens": 16, "messages": messages}, headers))
                messages.append({"role": "assistant", "content": canned})
            runs[mode].append(turns)
    return runs


def time_to_forget(stack: ExitStack, settings: Settings, logs: Path, token: str, entry: Server,
                   runs: int) -> dict:
    """Start a node, wait until the entry lists its model, stop it (kill -9 or SIGTERM), and time
    how long the entry still lists it, polling every 50 ms."""
    out = {"kill -9": [], "SIGTERM": []}
    for i in range(runs):
        for how in out:
            victim = node(stack, settings, logs, token, f"victim-{i}-{how.split()[0].lower()}",
                          ["--alias", "victim", "--join", entry.url])
            _wait_listed(entry, "victim", 1)
            stopped = time.perf_counter()
            if how == "kill -9":
                victim.proc.kill()
            else:
                victim.proc.terminate()
            while any(m["id"] == "victim" for m in httpx.get(entry.url + "/v1/models", timeout=10).json()["data"]):
                time.sleep(0.05)
            out[how].append(time.perf_counter() - stopped)
            victim.proc.wait()
    return out


def report(r: dict) -> dict:
    def med(values):
        return statistics.median(values)

    print(f"\nload average {r['load_average_before'][0]:.2f} before, {r['load_average_after'][0]:.2f} after; "
          f"{r['environment']['cpu']}, {r['settings']['threads']} threads")
    hops = {}
    for mode, o in r["proxy_overhead"].items():
        ttft, decode = o["ttft"], o["decode"]
        direct_ttft, hop_ttft = med([p["direct"]["ttft_s"] for p in ttft]), med([p["hop"]["ttft_s"] for p in ttft])
        paired = med([p["hop"]["ttft_s"] - p["direct"]["ttft_s"] for p in ttft])
        direct_tps = med([p["direct"]["decode_tps"] for p in decode])
        hop_tps = med([p["hop"]["decode_tps"] for p in decode])
        print(f"\nproxy overhead, {mode} hop on loopback, medians")
        print(f"  {'':28} {'direct':>10} {'one hop':>10} {'hop - direct':>13} {'ratio':>7}")
        print(f"  {'TTFT, prompt cached (ms)':28} {direct_ttft * 1e3:10.1f} {hop_ttft * 1e3:10.1f} "
              f"{paired * 1e3:+13.1f} {hop_ttft / direct_ttft:7.3f}")
        print(f"  {'decode (tok/s)':28} {direct_tps:10.1f} {hop_tps:10.1f} {hop_tps - direct_tps:+13.1f} "
              f"{hop_tps / direct_tps:7.3f}")
        print(f"  ({len(ttft)} TTFT pairs, {len(decode)} decode pairs; goal: <= 5 ms TTFT, <= 3% decode)")
        cpu = o["entry_cpu"]
        print(f"  the entry node's CPU: {cpu['ms_per_request']:.2f} ms a request, {cpu['us_per_token']:.0f} us a "
              "streamed token")
        hops[mode] = {"ttft_direct_ms": direct_ttft * 1e3, "ttft_hop_ms": hop_ttft * 1e3,
                      "ttft_paired_delta_ms": paired * 1e3, "ttft_ratio": hop_ttft / direct_ttft,
                      "decode_direct_tps": direct_tps, "decode_hop_tps": hop_tps, "decode_ratio": hop_tps / direct_tps,
                      "entry_cpu": cpu}

    fifth = {mode: [conv[4] for conv in convs] for mode, convs in r["routing"].items()}
    same_node = {mode: sum(len({t["served_by"] for t in conv}) == 1 for conv in convs)
                 for mode, convs in r["routing"].items()}
    print("\nprefix affinity vs random routing: TTFT of the 5th turn (two replicas, through a client node)")
    print(f"  {'':10} {'median ms':>10} {'min':>8} {'max':>8} {'cached tokens (median)':>23} {'one node all 5 turns':>21}")
    for mode, turns in fifth.items():
        ms = [t["ttft_s"] * 1e3 for t in turns]
        print(f"  {mode:10} {med(ms):10.1f} {min(ms):8.1f} {max(ms):8.1f} "
              f"{med([t['cached_tokens'] for t in turns]):23.0f} {same_node[mode]:>12}/{len(turns)}")
    ratio = med([t["ttft_s"] for t in fifth["affinity"]]) / med([t["ttft_s"] for t in fifth["random"]])
    print(f"  affinity / random: {ratio:.3f}; 5th-turn prompt {fifth['affinity'][0]['prompt_tokens']} tokens")
    print("\nforgetting a node: seconds until its model leaves the entry node's /v1/models")
    for how, times in r["forgetting"].items():
        print(f"  {how:8} median {med(times):5.2f} s, max {max(times):5.2f} s over {len(times)} runs")
    return {"hops": hops, "fifth_turn_ttft_ms": {m: med([t["ttft_s"] for t in ts]) * 1e3 for m, ts in fifth.items()},
            "fifth_turn_affinity_over_random": ratio,
            "forget_s": {how: med(times) for how, times in r["forgetting"].items()}}


if __name__ == "__main__":
    main()
