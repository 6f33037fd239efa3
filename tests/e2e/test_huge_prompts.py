"""Prompts far over the context are a quick context_length_exceeded 400 on both engines, however they
are made: a chat of 200,000 empty messages (6.4 MB, under the 8 MiB body limit) kept a core busy for
more than ten minutes in llama.cpp's special-token splitting before the fix; 300,000 special-token
strings as a text prompt, and megabytes of plain text. A normal request right after still works.

No wall-clock threshold is asserted (machines are noisy), but the client gives up after 60 s, which
the old behaviour could not meet: the requests fail rather than pass if the server pins a core."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 60  # the old llama engine took more than ten minutes on the chat below
LONG_TIMEOUT = 600  # a prompt that fits is read, however slow the machine


@pytest.fixture(scope="module")
def client(engine_server) -> OpenAI:
    return OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def refused_as_too_long(create, param: str) -> dict:
    """Runs ``create``, which must fail with a context_length_exceeded 400 on ``param``; returns the error."""
    with pytest.raises(openai.BadRequestError) as caught:
        create()
    return assert_too_long(caught.value.response, param)


def assert_too_long(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith("this model's context is 8192 tokens, but the prompt has at least ")
    return error


def assert_still_serving(client: OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 0


def test_two_hundred_thousand_empty_messages(client, engine_server):
    # Posted as it is: the openai client spends over a minute of its own preparing 200,000 messages.
    messages = [{"role": "user", "content": ""}] * 200_000
    response = httpx.post(engine_server.url + "/v1/chat/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert_too_long(response, "messages")
    assert_still_serving(client)


def test_special_tokens_as_a_text_prompt(client):
    refused_as_too_long(lambda: client.completions.create(model=MODEL, prompt="<|im_end|>" * 300_000,
                                                          max_tokens=1), "prompt")
    assert_still_serving(client)


def test_special_tokens_in_one_message_without_max_tokens(client):
    messages = [{"role": "user", "content": "<|im_start|>user\n<|im_end|>\n" * 100_000}]
    error = refused_as_too_long(lambda: client.chat.completions.create(model=MODEL, messages=messages),
                                "messages")
    assert "more were asked for" not in error["message"]


def test_special_tokens_through_the_responses_api(client):
    refused_as_too_long(lambda: client.responses.create(model=MODEL, input="<|endoftext|>" * 200_000,
                                                        max_output_tokens=16), "input")
    assert_still_serving(client)


def test_megabytes_of_plain_text(client):
    # 6 MB of digits: one token each, the slowest plain text for Hugging Face's tokenizer (about
    # 2 s a megabyte here); over 8192 x the longest token's 162 bytes, so refused uncounted.
    refused_as_too_long(lambda: client.completions.create(model=MODEL, prompt="7" * 6_000_000, max_tokens=1),
                        "prompt")
    assert_still_serving(client)


def test_a_long_prompt_that_fits_is_still_served(client):
    # 600 special tokens (the llama engine encodes them in pieces) among 1,650 tokens
    # (reading them is real work: on a slow shared CPU it may outlast the refusals' 60 s)
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}] * 150
    reply = client.with_options(timeout=LONG_TIMEOUT).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens > 1500 and reply.choices[0].finish_reason in ("length", "stop")
