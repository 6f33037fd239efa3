"""One timed request: a streamed chat completion, read as server-sent events as it arrives.

TTFT is the time to the first non-empty content delta (a role-only first chunk is not a token), the
decode rate counts the tokens after the first over the time from that delta to the end of the stream
(not to the last delta: a server that sends its tokens in bursts would look faster than it is).
Token counts come from the stream's ``usage``; a server that sends none in a stream is asked the
same request again without streaming, and that answer's ``usage`` is used (``count_later``: by the
caller, once the concurrent streams it is timing have ended).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

import httpx


class RequestError(RuntimeError):
    pass


@dataclass
class Measured:
    ttft_ms: float | None
    total_ms: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    decode_tps: float | None
    tokens_from: str  # "usage" (in the stream), "paired" (a second, non-streamed request) or "none" (yet)
    finish_reason: str | None


def measure(client: httpx.Client, url: str, body: dict, timeout: float, count_later: bool = False) -> Measured:
    """Send ``body`` streamed to ``url``/v1/chat/completions and time it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    first = None
    usage, timings, finish = None, None, None
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RequestError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and ": keepalive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RequestError(f"error in stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if first is None and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter()
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # llama-server: cache_n = prompt tokens reused
    end = time.perf_counter()
    timed = Measured(ttft_ms=None if first is None else (first - t0) * 1000, total_ms=(end - t0) * 1000,
                     prompt_tokens=None, completion_tokens=None, cached_tokens=None, decode_tps=None,
                     tokens_from="none", finish_reason=finish)
    if usage is not None:
        return _counted(timed, usage, timings, "usage")
    return timed if count_later else paired_usage(client, url, body, timeout, timed)


def paired_usage(client: httpx.Client, url: str, body: dict, timeout: float, timed: Measured) -> Measured:
    """``timed`` with the token counts of the same request sent again without streaming (not timed)."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = client.post(url + "/v1/chat/completions", json=plain, timeout=timeout)
    if r.status_code != 200:
        raise RequestError(f"paired request for the token count: HTTP {r.status_code}: {r.text[:300]}")
    usage = r.json().get("usage")
    if not usage:
        raise RequestError("the server reports no usage, streamed or not")
    return _counted(timed, usage, None, "paired")


def _counted(timed: Measured, usage: dict, timings: dict | None, tokens_from: str) -> Measured:
    completion = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings is not None:
        cached = timings.get("cache_n")
    decode = None
    if completion and completion > 1 and timed.ttft_ms is not None and timed.total_ms > timed.ttft_ms:
        decode = (completion - 1) / ((timed.total_ms - timed.ttft_ms) / 1000)
    return replace(timed, prompt_tokens=usage.get("prompt_tokens"), completion_tokens=completion,
                   cached_tokens=cached, decode_tps=decode, tokens_from=tokens_from)
