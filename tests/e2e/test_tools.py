"""Tool calls through the official openai client, on both engines serving the embedded SmolLM2 (a
template without tools: the generic format, constrained): a named function's call validates against
its parameters, streamed and not; the agent round trip (call, tool result, answer) through chat
completions, through the Responses API and through Anthropic's Messages API (its own SDK), streamed
and not; bad requests are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone",
                                      "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                     "required": ["zone"]}}},
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
QUESTION = "What will the weather be in Paris?"
RESULT = "Sunny, 24 degrees"


@pytest.fixture(scope="module")
def client(engine_server) -> OpenAI:
    return OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_named_function_call_validates(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           tools=CHAT_TOOLS, tool_choice=named("get_weather"), temperature=0,
                                           max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_named_function_call_streams_id_and_name_then_arguments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
        tool_choice=named("get_weather"), temperature=0, max_tokens=80, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.content for d in deltas)  # no markup leaks into content
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert len(rest) > 2 and all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in rest)
    arguments = "".join(tc.function.arguments for tc in calls)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        ["tool_calls"]


def test_required_calls_one_of_the_tools(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           tools=CHAT_TOOLS, tool_choice="required", temperature=0,
                                           max_tokens=80, parallel_tool_calls=False)
    [call] = reply.choices[0].message.tool_calls
    tool = next(t for t in CHAT_TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_auto_is_a_reply_or_valid_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           tools=CHAT_TOOLS, temperature=0, max_tokens=120)
    message = reply.choices[0].message
    if message.tool_calls:
        assert reply.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert message.content and reply.choices[0].finish_reason == "stop"


def test_chat_round_trip(client):
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                           tool_choice=named("get_weather"), temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=60)
    content = answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
    # the tiny model answers from the tool's result (measured: "The weather in Paris is sunny, with a
    # temperature of 24 degrees Celsius.")
    assert "24" in content, content


def _responses_call(client: OpenAI, stream: bool):
    kw = dict(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS,
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=80)
    if not stream:
        return client.responses.create(**kw), None
    events = list(client.responses.create(stream=True, **kw))
    return events[-1].response, events


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_round_trip(client, stream):
    response, events = _responses_call(client, stream)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    if events is not None:
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 2 and "".join(deltas) == call.arguments
        assert [e.sequence_number for e in events] == list(range(len(events)))
    follow = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    kw = dict(model=MODEL, input=follow, tools=RESPONSES_TOOLS, tool_choice="none", temperature=0,
              max_output_tokens=60)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        answer = events[-1].response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == answer.output_text
        assert "response.content_part.added" in [e.type for e in events]
    else:
        answer = client.responses.create(**kw)
    assert [item.type for item in answer.output] == ["message"] and answer.status == "completed"
    assert "24" in answer.output_text, answer.output_text  # read from the tool's result
    assert answer.usage.input_tokens_details.cached_tokens >= 0


def test_responses_stream_helper_and_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}
    with client.responses.stream(model=MODEL, input="Is it sunny in Rome?", temperature=0, max_output_tokens=60,
                                 text={"format": {"type": "json_schema", "name": "w", "schema": schema,
                                                  "strict": True}}) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), schema)
    assert final.text.format.type == "json_schema"


def test_model_by_id(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_dump()["context_length"] == 8192


# --- bad requests: 400 with OpenAI's error body, never a 500 -------------------------------------------

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
USER = [{"role": "user", "content": "Hi"}]
CALLED = [{"role": "user", "content": "Hi"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
              "name": "get_time", "arguments": "{}"}}]}]
BAD = [
    ("malformed schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
    ("json_schema without schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("a schema with type text", CHAT, {"messages": USER, "response_format": {"type": "text", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format"),
    ("unknown response_format type", CHAT, {"messages": USER, "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("unknown tool in tool_choice", CHAT, {"messages": USER, "tools": CHAT_TOOLS,
                                           "tool_choice": named("get_stock")}, "tool_choice"),
    ("required without tools", CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("bad tool_choice", CHAT, {"messages": USER, "tools": CHAT_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("tool message without its call", CHAT, {"messages": USER + [
        {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages.1.tool_call_id"),
    ("tool message without id", CHAT, {"messages": CALLED + [{"role": "tool", "content": "x"}]}, "messages.2"),
    ("malformed parameters", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": "a"}}}]}, "tools.0"),
    ("bad function name", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "no spaces allowed"}}]}, "tools.0.function.name"),
    ("legacy functions", CHAT, {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ("ignore_eos with a schema", CHAT, {"messages": USER, "ignore_eos": True,
                                        "response_format": {"type": "json_object"}}, "ignore_eos"),
    ("responses: stored", RESPONSES, {"input": "Hi", "store": True}, "store"),
    ("responses: previous id", RESPONSES, {"input": "Hi", "previous_response_id": "resp_1"},
     "previous_response_id"),
    ("responses: unsupported item", RESPONSES, {"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ("responses: image part", RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input.0.content.0"),
    ("responses: web search tool", RESPONSES, {"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("responses: output without its call", RESPONSES, {"input": [
        {"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input.0.tool_call_id"),
    ("responses: malformed schema", RESPONSES, {"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format"),
    ("responses: reasoning", RESPONSES, {"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ("a $ref loop", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                "$ref": "#/$defs/a"}}}}, "response_format"),
    ("responses: a schema with type json_object", RESPONSES, {"input": "Hi", "text": {"format": {
        "type": "json_object", "schema": {"type": "integer"}}}}, "text.format.schema"),
    ("responses: verbosity", RESPONSES, {"input": "Hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    # sampling fields other servers take and this one does not apply
    ("presence penalty", CHAT, {"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ("vLLM's guided_json", CHAT, {"messages": USER, "guided_json": {"type": "object"}}, "guided_json"),
    ("completions: logit_bias", "/v1/completions", {"prompt": "Hi", "logit_bias": {"0": -100}}, "logit_bias"),
    ("completions: tools", "/v1/completions", {"prompt": "Hi", "tools": CHAT_TOOLS}, "tools"),
    ("responses: stop", RESPONSES, {"input": "Hi", "stop": ["cat"]}, "stop"),
    ("responses: frequency penalty", RESPONSES, {"input": "Hi", "frequency_penalty": 1}, "frequency_penalty"),
]


@pytest.fixture(scope="module")
def llama_server(server_factory):
    return server_factory("--engine", "llama")


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request(llama_server, name, path, body, param):
    response = httpx.post(llama_server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert "Traceback" not in response.text


def test_healthy_after_bad_requests(llama_server):
    for _, path, body, _ in BAD:
        httpx.post(llama_server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert httpx.get(llama_server.url + "/health").json() == {"status": "ok"}
    assert "Traceback" not in llama_server.output()


RAW = [  # bodies as sent: JSON lets a string hold a lone surrogate, which no tokenizer can encode
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL, 400),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "\\udfff"}' % MODEL, 400),
    (RESPONSES, '{"model": "%s", "max_output_tokens": 2, "input": "x", "instructions": "\\ud800"}' % MODEL, 400),
    (CHAT, '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', 400),
    # fields only echoed back: the whole generation ran, then the answer could not be encoded (streamed,
    # the stream died after its 200)
    (RESPONSES, '{"model": "%s", "input": "x", "metadata": {"a": "\\ud800"}, "stream": true}' % MODEL, 400),
    (RESPONSES, '{"model": "%s", "input": "x", "text": {"format": {"type": "json_object", "name": "\\udc00"}}}'
     % MODEL, 400),
    (CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "user": "\\ud83d"}' % MODEL, 400),
]


@pytest.mark.parametrize("path,body,status", RAW)
def test_lone_surrogates_are_refused(llama_server, path, body, status):
    response = httpx.post(llama_server.url + path, content=body.encode(), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "not valid Unicode" in error["message"], error


def test_a_format_the_grammar_cannot_follow_is_an_error_not_a_reply(llama_server):
    """Objects that must nest forever compile, then pass llguidance's limits two tokens in ('{"'):
    a 400 saying so where nothing was sent, an error event in a stream, never "stop" with JSON that
    does not parse."""
    endless = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
               "$ref": "#/$defs/n"}
    body = {"model": MODEL, "messages": USER, "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": endless}}}
    response = httpx.post(llama_server.url + CHAT, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "could not be followed" in response.json()["error"]["message"]
    with httpx.stream("POST", llama_server.url + CHAT, json={**body, "stream": True}, timeout=60) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert "could not be followed" in json.loads(events[-2] if events[-1] == "[DONE]" else events[-1])["error"]["message"]
    assert httpx.get(llama_server.url + "/health").json() == {"status": "ok"}


def test_odd_but_harmless_requests(llama_server):
    """Neutral values of refused fields pass; a tool call's arguments nested past the JSON parser's
    depth stay text; a completion's max_tokens of null means OpenAI's default (16), not the context."""
    url = llama_server.url
    neutral = {"model": MODEL, "messages": USER, "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0,
               "best_of": 1, "logit_bias": {}}
    assert httpx.post(url + CHAT, json=neutral, timeout=60).status_code == 200
    deep = "[" * 2000 + "]" * 2000  # Python's parser stops at a depth of about 1,000
    calls = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                 "name": "get_time", "arguments": deep}}]},
             {"role": "tool", "tool_call_id": "c", "content": "noon"}]
    response = httpx.post(url + CHAT, json={"model": MODEL, "messages": calls, "tools": CHAT_TOOLS, "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200 or response.json()["error"]["code"] == "context_length_exceeded", \
        response.text
    text = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                     "max_tokens": None, "ignore_eos": True}, timeout=60)
    assert text.json()["usage"]["completion_tokens"] == 16
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert "Traceback" not in llama_server.output()


def test_the_agent_round_trip_through_anthropics_messages_api(engine_server):
    import anthropic

    client = anthropic.Anthropic(base_url=engine_server.url, api_key="unused", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
    asked = [{"role": "user", "content": QUESTION}]
    call = client.messages.create(model=MODEL, max_tokens=80, messages=asked, tools=tools,
                                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert call.stop_reason == "tool_use"
    [use] = [b for b in call.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model=MODEL, max_tokens=80, messages=asked, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    # a call assembled from input_json_delta events (a cached prompt may round another way on MLX)
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed_use.name == "get_weather"
    jsonschema.validate(streamed_use.input, WEATHER)
    answer = client.messages.create(model=MODEL, max_tokens=30, tools=tools, extra_body={"temperature": 0}, messages=[
        *asked, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}],
        tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()
    cut = client.messages.create(model=MODEL, max_tokens=4, messages=asked, tools=tools,  # a call cut short
                                 tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert cut.stop_reason == "max_tokens" and all(b.input == {} for b in cut.content if b.type == "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=asked, tools=tools)
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL, messages=asked).input_tokens
