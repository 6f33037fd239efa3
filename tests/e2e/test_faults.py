"""The server under faults. Stopping it keeps the README's promise: on SIGTERM or Ctrl-C, requests
still running after the grace period, and those waiting for a slot, each end properly (a stream with
a ``server_shutting_down`` error event and ``[DONE]``, a non-streamed request with an OpenAI-format
503), and the process exits 0 (130 after Ctrl-C) instead of dying by the signal. A client that sends
its request a byte at a time (slowloris) is answered 408 and cut off at the read timeout; one that
leaves midway through its body is one log line."""

from __future__ import annotations

import json
import signal
import socket
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


def test_a_request_that_trickles_in_is_answered_408_and_closed_at_the_read_timeout(tmp_path):
    server = start_server(["--engine", "llama", "--read-timeout", "2"], tmp_path / "server.log")
    try:
        conns = []
        for partial in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
                        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"):
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            conn.sendall(partial)
            conns.append(conn)
        for conn in conns[1:]:
            conn.sendall(b"X")  # a byte now and then does not keep a connection
        for conn in conns:
            with conn:  # read until the server closes it (the old server held them for minutes)
                answer = b""
                while chunk := conn.recv(65536):
                    answer += chunk
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 408"), answer
                assert json.loads(body)["error"]["code"] == "request_timeout"
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):  # leaves mid-body
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
                conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             "Content-Length: 5000\r\n\r\n{\"model\": \"x\", ".encode())
                time.sleep(0.3)
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert reply.status_code == 200  # a request that arrives whole is served as ever
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            assert f"a client left before its request's body arrived (POST {path})" in server.output()
        assert "Traceback" not in server.output()  # one line each, as a peer's connection dropped
    finally:
        server.stop()
