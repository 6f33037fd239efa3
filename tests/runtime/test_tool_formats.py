"""Tool-call formats on real templates and real vocabularies: what the template renders for tools and
for earlier calls, recorded generations fed token by token through the streaming parsers, and the
constraints that force a call.

The templates and vocabularies come from ``conftest.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mesh_llm.runtime.detokenize import IncrementalDetokenizer
from mesh_llm.runtime.tool_formats import Function, format_for
from mesh_llm.runtime.tools import ToolChoice, ToolRequestError, plan_chat

WEATHER = Function("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]},
    "The current weather in a city")
TIME = Function("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]})
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "Sunny, 24 C"},
]


def stream(tokenizer, parser, text: str):
    """Feed ``text``'s tokens one at a time through the detokenizer and the parser, as the server does."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    events = []
    for token in ids:
        events += parser.feed(detok.add(token))
    events += parser.feed(detok.flush()) + parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    calls: dict[int, list] = {}
    fragments = 0
    for e in events:
        if e.kind == "call":
            calls[e.index] = [e.name, "", e.id]
        elif e.kind == "arguments":
            calls[e.index][1] += e.text
            fragments += 1
    return content, [(name, json.loads(args), call_id) for name, args, call_id in calls.values()], fragments


# --- which format a template gets -------------------------------------------------------------------


@pytest.mark.parametrize("file,name", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"),
])
def test_format_from_template(file, name, template):
    assert format_for(template(file)).name == name


def test_a_template_without_tools_gets_the_generic_format():
    assert format_for("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"
    assert format_for(None).name == "generic"


# --- rendering: the template's own tools section and history ----------------------------------------


def test_qwen_renders_tools_calls_and_results(vocab):
    tok = vocab("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    plan = plan_chat(tok, HISTORY, [WEATHER])
    text = tok.decode(plan.prompt)
    assert "<tools>\n" + json.dumps(WEATHER.openai_json()) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in text
    assert plan.format == "hermes" and plan.constraint is None  # auto: the model is free


def test_llama3_renders_tools_and_a_call_as_parameters(vocab):
    tok = vocab("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct.jinja")
    text = tok.decode(plan_chat(tok, HISTORY, [WEATHER]).prompt)
    assert '"name": "get_weather"' in text and "Given the following functions" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"Sunny, 24 C"' in text  # the template's tojson


def test_mistral_renders_available_tools_and_nine_character_ids(vocab, template):
    tok = vocab("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    text = tok.decode(plan_chat(tok, HISTORY, [WEATHER]).prompt)
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in text
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]' in text
    assert '[TOOL_RESULTS]{"content": Sunny, 24 C, "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    assert len(format_for(template("mistralai-Mistral-Nemo-Instruct-2407.jinja")).new_id()) == 9


def test_generic_puts_tools_in_the_system_message_and_results_in_words(default_gguf):
    from mesh_llm.engines.base import EngineOptions
    from mesh_llm.engines.llama.engine import LlamaEngine

    engine = LlamaEngine.load(default_gguf, EngineOptions(ctx_size=512, cache_bytes=0))
    try:
        tok = engine.tokenizer
        text = tok.decode(plan_chat(tok, HISTORY, [WEATHER]).prompt)
        assert text.startswith("<|im_start|>system\nYou can call these tools:\n" + json.dumps(
            WEATHER.openai_json()["function"]))
        assert '<|im_start|>assistant\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' \
            in text
        assert "<|im_start|>user\nThe tool get_weather answered: Sunny, 24 C<|im_end|>" in text
        # no tool may be called: no tool list, and the earlier call in words
        text = tok.decode(plan_chat(tok, HISTORY, [WEATHER], ToolChoice("none")).prompt)
        assert "You can call" not in text and 'I called get_weather with {"city": "Paris"}.' in text
    finally:
        engine.close()


# --- recorded generations, token by token ------------------------------------------------------------


def test_hermes_stream(vocab):
    tok = vocab("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    parser = format_for(tok.chat_template).parser()
    recorded = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                '{"zone": "Europe/Paris"}}\n</tool_call>')
    content, calls, fragments = stream(tok, parser, recorded)
    assert content == "I will check both.\n"
    assert [(n, a) for n, a, _ in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                              ("get_time", {"zone": "Europe/Paris"})]
    assert calls[0][2].startswith("call_") and calls[0][2] != calls[1][2]
    assert fragments > 4  # arguments stream as they are written, not at the end


def test_hermes_stream_with_arguments_first(vocab):
    tok = vocab("llama-bpe", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    recorded = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    content, calls, _ = stream(tok, format_for(tok.chat_template).parser(), recorded)
    assert content == "" and [(n, a) for n, a, _ in calls] == [("get_weather", {"city": "Oslo"})]


def test_hermes_plain_answer_passes_through(vocab):
    tok = vocab("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    answer = "Use a <table> or a <tool> tag; x < y."
    content, calls, _ = stream(tok, format_for(tok.chat_template).parser(), answer)
    assert content == answer and calls == []


def test_llama3_stream(vocab):
    tok = vocab("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct.jinja")
    parser = format_for(tok.chat_template).parser()
    content, calls, fragments = stream(tok, parser, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content == "" and [(n, a) for n, a, _ in calls] == [("get_weather", {"city": "Rome"})]
    assert fragments > 2
    content, calls, _ = stream(tok, format_for(tok.chat_template).parser(), '{"answer": "a JSON reply"}')
    assert content == '{"answer": "a JSON reply"}' and calls == []


def test_mistral_list_stream(vocab):
    tok = vocab("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    recorded = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}, "id": "a1b2c3d4e"}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    content, calls, _ = stream(tok, format_for(tok.chat_template).parser(), recorded)
    assert content == ""
    assert [(n, a) for n, a, _ in calls] == [("get_weather", {"city": "Lima"}), ("get_time", {"zone": "UTC"})]
    assert all(len(i) == 9 and i.isalnum() for _, _, i in calls)


def test_mistral_named_stream(vocab):
    tok = vocab("llama-spm", "Mistral-Small-3.2-24B-Instruct-2506.jinja")
    recorded = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Kyiv"}[TOOL_CALLS]get_time[ARGS]{"zone": "EET"}'
    content, calls, _ = stream(tok, format_for(tok.chat_template).parser(), recorded)
    assert content == "Sure."
    assert [(n, a) for n, a, _ in calls] == [("get_weather", {"city": "Kyiv"}), ("get_time", {"zone": "EET"})]


def test_generic_stream(default_gguf):
    from mesh_llm.engines.base import EngineOptions
    from mesh_llm.engines.llama.engine import LlamaEngine

    engine = LlamaEngine.load(default_gguf, EngineOptions(ctx_size=256, cache_bytes=0))
    try:
        tok = engine.tokenizer
        fmt = format_for(tok.chat_template)
        content, calls, _ = stream(tok, fmt.parser(), '{"tool_calls": [{"name": "get_weather", "arguments": '
                                   '{"city": "Nice"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]}')
        assert content == "" and [n for n, _, _ in calls] == ["get_weather", "get_time"]
        content, calls, _ = stream(tok, fmt.parser(), '{"response": "It is \\"sunny\\" \\u00e0 Nice.\\n"}')
        assert content == 'It is "sunny" à Nice.\n' and calls == []
        # cut by max_tokens: the envelope never reaches content, a reply's words do
        for cut in ('{"tool_call', '{"', ' {"respo', '{"tool_call": {"name": "get_wea'):
            assert stream(tok, fmt.parser(), cut)[:2] == ("", []), cut
        assert stream(tok, fmt.parser(), '{"response": "It is sun')[0] == "It is sun"
    finally:
        engine.close()


# --- constraints: a call the model must make --------------------------------------------------------


def walk(constraint, tokenizer, text: str) -> np.ndarray:
    """Advance through ``text``'s tokens, each of which the mask must allow; the final mask."""
    for token in tokenizer.encode(text, add_special_tokens=False):
        mask = constraint.mask()
        assert mask[token], f"token {token} ({tokenizer.decode([token])!r}) masked out"
        constraint.advance(token)
    return constraint.mask()


def test_named_function_is_forced_on_qwen(vocab):
    tok = vocab("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    plan = plan_chat(tok, HISTORY[:1], [WEATHER, TIME], ToolChoice("required", "get_weather"))
    first = plan.constraint.mask()
    tool_call = tok.encode("<tool_call>", add_special_tokens=False)
    assert first.sum() == 1 and first[tool_call[0]]  # nothing but the call's opening
    end = walk(plan.constraint, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                     '</tool_call>')
    assert set(np.flatnonzero(end)) <= tok.eos_token_ids  # done: only an end of turn may follow
    other = plan_chat(tok, HISTORY[:1], [WEATHER, TIME], ToolChoice("required", "get_weather")).constraint
    walk(other, tok, '<tool_call>\n{"name": "')
    allowed = [tok.decode([t]) for t in np.flatnonzero(other.mask())]
    assert allowed and all("get_weather".startswith(a) for a in allowed)  # get_time is never offered


def test_required_call_arguments_follow_the_schema_on_llama3(vocab):
    tok = vocab("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct.jinja")
    constraint = plan_chat(tok, HISTORY[:1], [WEATHER], ToolChoice("required")).constraint
    walk(constraint, tok, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "')
    allowed = {tok.decode([t]) for t in np.flatnonzero(constraint.mask())}
    assert allowed and all("celsius".startswith(a) or "fahrenheit".startswith(a) for a in allowed)


def test_mistral_call_starts_with_its_marker(vocab):
    tok = vocab("llama-bpe", "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    constraint = plan_chat(tok, HISTORY[:1], [WEATHER], ToolChoice("required")).constraint
    end = walk(constraint, tok, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert set(np.flatnonzero(end)) <= tok.eos_token_ids


def test_forced_text_on_a_sentencepiece_vocab_has_no_space_prefix(vocab):
    """SentencePiece puts a space before any text it tokenizes; text a grammar forces continues the
    reply, so its tokens must be those without it (else the matcher fails on its own first token)."""
    tok = vocab("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    constraint = plan_chat(tok, HISTORY[:1], [WEATHER], ToolChoice("required")).constraint
    pieces = tok.token_table()
    first = np.flatnonzero(constraint.mask())
    assert len(first) == 1 and pieces[first[0]][0] == b"["
    constraint.advance(int(first[0]))
    assert not set(np.flatnonzero(constraint.mask())) <= tok.eos_token_ids  # still inside the call


def test_response_schema_or_a_call_on_qwen(vocab):
    tok = vocab("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    plan = plan_chat(tok, HISTORY[:1], [WEATHER], response_schema=schema)
    walk(plan.constraint, tok, '{"answer": 4')
    plan = plan_chat(tok, HISTORY[:1], [WEATHER], response_schema=schema)
    walk(plan.constraint, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>')


@pytest.mark.parametrize("messages,functions,choice,param", [
    (HISTORY[:1], [WEATHER], ToolChoice("required", "get_stock"), "tool_choice"),
    (HISTORY[:1], [], ToolChoice("required"), "tool_choice"),
    ([HISTORY[0], {"role": "tool", "tool_call_id": "nope", "content": "x"}], [WEATHER], ToolChoice(), "messages.1.tool_call_id"),
    (HISTORY[:1], [Function("f", {"type": "objec"})], ToolChoice(), "tools.0"),
    (HISTORY[:1], [WEATHER, WEATHER], ToolChoice(), "tools"),
])
def test_bad_requests_name_their_field(vocab, messages, functions, choice, param):
    tok = vocab("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja")
    with pytest.raises(ToolRequestError) as info:
        plan_chat(tok, messages, functions, choice)
    assert info.value.param == param
