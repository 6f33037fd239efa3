"""Chat templates rendered by us, identically for every engine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mesh_llm.runtime.chat import TemplateError, encode_chat, render_chat


@dataclass
class Tok:
    """Only what render_chat reads; encode is checked with the real tokenizers below."""

    chat_template: str | None
    bos_token: str | None = "<s>"
    eos_token: str | None = "</s>"


def test_the_embedded_models_template_adds_its_default_system_prompt(default_gguf):
    from mesh_llm.engines.base import EngineOptions
    from mesh_llm.engines.llama import LlamaEngine

    engine = LlamaEngine.load(default_gguf, EngineOptions(ctx_size=256))
    try:
        text = render_chat(engine.tokenizer, [{"role": "user", "content": "Hi"}])
        assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": "Hi"}])
        assert ids[0] == engine.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
        assert ids.count(ids[0]) == 3  # each <|im_start|> is one special token, not its spelling
    finally:
        engine.close()


def test_chatml_when_the_model_has_no_template():
    text = render_chat(Tok(None), [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_hugging_face_environment():
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
                "{% if add_generation_prompt %}[gen]{% endif %}{{ strftime_now('%Y') | length }}")
    assert render_chat(Tok(template), [{"role": "user", "content": "é\"x"}]) == '<s>"é\\"x"[gen]4'


def test_a_template_that_raises_becomes_a_template_error():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(TemplateError, match="first must be user"):
        render_chat(Tok(template), [{"role": "assistant", "content": "x"}])


def test_a_broken_template_is_a_template_error():
    with pytest.raises(TemplateError, match="does not parse"):
        render_chat(Tok("{% for %}"), [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        render_chat(Tok("{{ messages[5]['content'].upper() }}"), [{"role": "user", "content": "x"}])


def test_the_sandbox_blocks_attribute_escapes():
    with pytest.raises(TemplateError):
        render_chat(Tok("{{ ''.__class__.__mro__[1].__subclasses__() }}"), [])


def test_a_participants_name_reaches_templates_that_render_it():
    """OpenAI's ``name`` on any message (several users or agents in one chat), as llama.cpp's server
    and vLLM hand it to the template; templates without it render as before."""
    from mesh_llm.api.schemas import Message

    messages = [Message(role="user", content="Hi", name="ada").chat_dict(),
                Message(role="assistant", content="Hello").chat_dict()]
    assert "name" not in messages[1]
    template = "{% for m in messages %}{{ m.get('name', '-') }}:{{ m['content'] }};{% endfor %}"
    assert render_chat(Tok(template), messages, add_generation_prompt=False) == "ada:Hi;-:Hello;"
