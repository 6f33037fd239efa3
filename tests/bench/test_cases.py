"""Case sets, custom cases from JSON, and prompts of exact token lengths with the model's tokenizer."""

from __future__ import annotations

import json

import pytest

from mesh_llm.bench.cases import CACHE_SEQUENCE, MAIN, PromptBuilder, context_text, load_cases
from mesh_llm.bench.tokenizer import load_tokenizer


@pytest.fixture(scope="module", params=["mlx", "gguf"])
def tokenizer(request, tiny_pair):
    """The same tokenizer read from the MLX folder's files and from the GGUF's metadata."""
    if request.param == "mlx":
        return load_tokenizer(tiny_pair.mlx, None)
    return load_tokenizer(None, tiny_pair.gguf)


def test_default_sets_hit_their_exact_lengths(tokenizer):
    builder = PromptBuilder(tokenizer)
    prompts = {}
    for case in load_cases(["default", "cache-sequence", "lengths"]):
        for session in ("000000", "123456", "987654"):
            prompt = builder.build(case, session, prompts.get(case.extends))
            if case.prompt_tokens:
                assert prompt.tokens == case.prompt_tokens, (case.name, session)
            assert prompt.tokens == tokenizer.count(prompt.messages)
            assert f"Session {session}." in prompt.messages[0]["content"] or case.extends
        prompts[case.name] = prompt
    assert [c.name for c in load_cases(["default"])] == ["short-chat", "long-briefing", "context-extraction",
                                                         "code-context"]
    assert {c.phase for c in load_cases(["cache-sequence"])} == {CACHE_SEQUENCE}
    assert [(c.prompt_tokens, c.max_tokens) for c in load_cases(["lengths"])] == [(128, 256), (512, 256),
                                                                                  (2048, 256)]


def test_extending_case_keeps_the_base_prompt_as_its_prefix(tiny_pair):
    tokenizer = load_tokenizer(tiny_pair.mlx, None)
    builder = PromptBuilder(tokenizer)
    base_case, extend_case = load_cases(["cache-sequence"])
    base = builder.build(base_case, "424242")
    extended = builder.build(extend_case, "ignored", base)
    base_text, extended_text = tokenizer.render(base.messages), tokenizer.render(extended.messages)
    user_end = base_text.rindex(base.messages[-1]["content"]) + len(base.messages[-1]["content"])
    assert extended_text.startswith(base_text[:user_end])  # all but the closing template tokens
    assert extended.tokens > base.tokens


def test_session_tags_make_prompts_differ_at_their_start(tiny_pair):
    builder = PromptBuilder(load_tokenizer(tiny_pair.mlx, None))
    case = load_cases(["default"])[1]
    a, b = builder.build(case, "111111"), builder.build(case, "222222")
    assert a.tokens == b.tokens == case.prompt_tokens
    assert a.messages[0]["content"][:20] != b.messages[0]["content"][:20]


def test_counts_match_transformers_apply_chat_template(tiny_pair):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tiny_pair.mlx))
    builder = PromptBuilder(load_tokenizer(tiny_pair.mlx, None))
    for case in load_cases(["default"]):
        prompt = builder.build(case, "555555")
        ids = reference.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert len(ids) == prompt.tokens, case.name


def test_custom_cases_from_json(tmp_path, tiny_pair):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps({"cases": [
        {"name": "q", "user": "Hi?"},
        {"name": "doc", "user": "{context}\nSum it up.", "context": "code", "prompt_tokens": 200, "max_tokens": 5},
        {"name": "more", "user": " Shorter.", "extends": "doc", "phase": "cache-sequence"},
    ]}))
    cases = load_cases([str(path)])
    assert [(c.name, c.phase, c.max_tokens) for c in cases] == [("q", MAIN, None), ("doc", MAIN, 5),
                                                               ("more", CACHE_SEQUENCE, None)]
    builder = PromptBuilder(load_tokenizer(tiny_pair.mlx, None))
    assert builder.build(cases[1], "000001").tokens == 200


@pytest.mark.parametrize("cases, message", [
    ([{"name": "a"}], "needs 'name' and 'user'"),
    ([{"name": "a", "user": "x", "colour": "red"}], "unknown fields: ['colour']"),
    ([{"name": "a", "user": "x"}, {"name": "a", "user": "y"}], "appears twice"),
    ([{"name": "b", "user": "x", "extends": "a"}], "must come before it"),
    ([{"name": "a", "user": "x", "phase": "later"}], "phase must be"),
])
def test_bad_case_files_are_refused(tmp_path, cases, message):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_cases([str(path)])


def test_unknown_set_name_is_refused():
    with pytest.raises(ValueError, match="neither default nor cache-sequence"):
        load_cases(["nope"])


def test_unreachable_length_is_refused(tiny_pair):
    builder = PromptBuilder(load_tokenizer(tiny_pair.mlx, None))
    (case,) = [c for c in load_cases(["default"]) if c.name == "code-context"]
    with pytest.raises(ValueError, match="out of reach"):
        builder.build(type(case)(**{**vars(case), "prompt_tokens": 5}), "000000")


def test_context_text_is_deterministic_and_long_enough():
    for kind in ("briefing", "records", "code", "literal words"):
        text = context_text(kind, 5000)
        assert len(text) >= 5000
        assert text == context_text(kind, 5000)
