"""The Anthropic Messages API in-process (the scripted engine) through the official ``anthropic``
SDK: a reply whole and streamed (the event sequence the SDK assembles), stop sequences, token
counting, the API key as ``x-api-key``, and every error in Anthropic's shape, whoever raised it."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from fake_engine import FakeEngine
from in_process import MODEL, serve_fake

USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server():
    with serve_fake(api_key="sesame", max_body_bytes=64 * 1024) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sesame", max_retries=0, timeout=30)


def test_a_message_whole_and_streamed_says_the_same(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=USER)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    [block] = whole.content
    assert block.type == "text" and len(block.text) > 0
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=12, messages=USER) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 12)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds and "message_delta" in kinds


def test_system_prompt_and_turns_reach_the_template(client):
    plain = client.messages.count_tokens(model=MODEL, messages=USER)
    with_system = client.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    # "<|im_start|>system\nBe brief.<|im_end|>\n" in the fake byte tokenizer: 2 specials + 18 bytes
    assert with_system.input_tokens - plain.input_tokens == 2 + len("system\nBe brief.\n")
    blocks = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]}])
    assert blocks.input_tokens == plain.input_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    probe = client.messages.create(model=MODEL, max_tokens=30, messages=USER).content[0].text
    word = next(w for w in probe.split() if len(w) >= 2)  # the fake model's greedy reply is fixed
    reply = client.messages.create(model=MODEL, max_tokens=30, messages=USER, stop_sequences=[word])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word
    assert reply.content[0].text == probe[:probe.index(word)]


def test_errors_come_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:  # validation
        client.messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:  # the route's own
        client.messages.create(model="nope", max_tokens=5, messages=USER)
    assert "does not exist" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as refused:  # the key, before the body
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=USER)
    assert refused.value.body["error"]["type"] == "authentication_error"
    too_big = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sesame"}, timeout=10,
                         json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 70_000}]})
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "request_too_large"
    for field, value in (("thinking", {"type": "enabled", "budget_tokens": 1024}), ("mcp_servers", [{}])):
        with pytest.raises(anthropic.BadRequestError) as unserved:  # never silently ignored
            client.messages.create(model=MODEL, max_tokens=5, messages=USER, extra_body={field: value})
        assert field in unserved.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "'image' are not supported" in image.value.body["error"]["message"]
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": "sesame"}, timeout=10,
                      json={"model": "nope", "messages": USER})
    assert chat.status_code == 404 and "type" not in chat.json()  # OpenAI's routes keep OpenAI's shape


def test_hints_that_change_nothing_are_accepted(client):
    reply = client.messages.create(
        model=MODEL, max_tokens=4, metadata={"user_id": "u-1"},
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        cache_control={"type": "ephemeral"}, thinking={"type": "disabled"}, extra_body={"temperature": 0.5})
    assert reply.stop_reason == "max_tokens"


def test_a_client_that_leaves_a_stream_frees_its_slot():
    with serve_fake(lambda: FakeEngine(max_batch=1, step_s=0.01)) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=10)
        with client.messages.stream(model=MODEL, max_tokens=3000, messages=USER) as stream:
            next(iter(stream))
        reply = client.messages.create(model=MODEL, max_tokens=3, messages=USER)  # the one slot is free
        assert reply.usage.output_tokens == 3
