"""Fixtures for the in-process API tests (tests/in_process.py serves them)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fake_engine import FakeEngine
from in_process import InProcessServer, serve_fake


@pytest.fixture(scope="module")
def fake_server() -> Iterator[InProcessServer]:
    """One in-process server for a module's tests that only read (a slightly slow engine, so that
    streams are real streams)."""
    with serve_fake(lambda: FakeEngine(step_s=0.002)) as server:
        yield server


@pytest.fixture
def client(fake_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server.url, timeout=30) as c:
        yield c
