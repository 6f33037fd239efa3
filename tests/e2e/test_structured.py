"""response_format on both engines: json_schema replies that parse and validate, whole and streamed,
json_object, and the openai client's ``chat.completions.parse`` with a pydantic model."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel
from structured_cases import SCHEMAS

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
_whole: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def client(engine_server) -> OpenAI:
    return OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def engine(client: OpenAI) -> str:
    return client.models.list().data[0].model_dump()["engine"]


def ask(client: OpenAI, prompt: str, name: str, schema: dict, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name,prompt,schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_json_schema_reply_validates(client, name, prompt, schema):
    reply = ask(client, prompt, name, schema)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert reply.choices[0].finish_reason == "stop"  # the grammar ended the reply, not max_tokens
    _whole[engine(client), name] = text


@pytest.mark.slow
@pytest.mark.parametrize("name,prompt,schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_json_schema_streamed_reply_validates(client, name, prompt, schema):
    chunks = list(ask(client, prompt, name, schema, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    if (engine(client), name) in _whole:  # greedy: the same reply as the whole one
        assert text == _whole[engine(client), name]


def test_json_object(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the name and the age of a cat."}],
        temperature=0, max_tokens=400, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


class Planet(BaseModel):
    name: str
    moons: int
    has_rings: bool


def test_parse_into_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe the planet Saturn."}],
        response_format=Planet, temperature=0, max_tokens=100)
    planet = completion.choices[0].message.parsed
    assert isinstance(planet, Planet) and planet.name
