"""schemathesis over the served ``/openapi.json``: requests generated from each route's schema, valid
and not, with the served model's id, against a real server on loopback (the scripted engine, so
thousands of requests take seconds). No answer may be a 5xx or a status the document does not
declare for its route; what the real engines add to the API is fuzzed in tests/e2e/test_bad_input.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, status_code_conformance

from fake_engine import FakeEngine
from in_process import MODEL, InProcessServer, serve_fake
from mesh_llm.api.app import ServedModel, create_app
from mesh_llm.runtime.worker import ModelWorker

pytestmark = pytest.mark.slow  # a minute and a half of generated requests: `make check` leaves it out


@pytest.fixture(scope="module")
def served() -> Iterator[InProcessServer]:
    with serve_fake() as server:
        yield server


def _document() -> dict:
    """The document a served app answers at /openapi.json (it needs no running worker)."""
    worker = ModelWorker(MODEL, FakeEngine)
    return create_app([ServedModel(MODEL, worker, "fake", 0)]).openapi()


schema = schemathesis.openapi.from_dict(_document())


@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_no_undocumented_status(case, served):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # past the lookup, into validation and generation
    if case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = MODEL
    case.call_and_validate(base_url=served.url, checks=[not_a_server_error, status_code_conformance])


def test_the_fuzzed_document_is_the_served_one(served):
    assert httpx.get(served.url + "/openapi.json").json() == schema.raw_schema
