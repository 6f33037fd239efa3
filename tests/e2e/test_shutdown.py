"""Stopping the server keeps the README's promise: on SIGTERM or Ctrl-C, requests still running after
the grace period, and those waiting for a slot, each end properly (a stream with a
``server_shutting_down`` error event and ``[DONE]``, a non-streamed request with an OpenAI-format
503), and the process exits 0 (130 after Ctrl-C) instead of dying by the signal."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from support import start_server

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def stream_lines(url: str, out: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if len(out) > 3:
                    started.set()


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_every_request_in_flight_ends_properly_and_the_exit_status_is_clean(tmp_path, sig, status):
    server = start_server(["--engine", "llama", "--max-batch", "2"], tmp_path / "server.log")
    try:
        streams = [([], threading.Event()) for _ in range(2)]
        threads = [threading.Thread(target=stream_lines, args=(server.url, out, started), daemon=True)
                   for out, started in streams]
        for t in threads:
            t.start()
        for _, started in streams:
            assert started.wait(60), "the streams did not start"
        waiting: dict = {}  # no slot is free: it waits in the queue

        def post() -> None:
            response = httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=120)
            waiting.update(status=response.status_code, body=response.json())

        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        time.sleep(1)  # it is read and queued
        server.proc.send_signal(sig)
        assert server.proc.wait(30) == status, server.output()
        for t in [*threads, poster]:
            t.join(30)
        for out, _ in streams:
            assert out[-1] == "[DONE]", out[-3:]
            error = json.loads(out[-2])["error"]
            assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert waiting["status"] == 503, waiting
        assert waiting["body"]["error"]["code"] == "server_shutting_down"
        assert "Traceback" not in server.output()
    finally:
        server.stop()
