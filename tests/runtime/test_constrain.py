"""Constraints on the embedded model's two tokenizers (the MLX engine's tokenizer.json, llama.cpp's
vocab): the same grammar allows the same tokens through both, a finished value allows only the end
of the turn, and schemas are closed as documented."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mesh_llm.runtime.constrain import (
    GrammarError,
    Grammars,
    closed_objects,
    json_schema_grammar,
    lark_grammar,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "enum": ["a", "b"]}}, "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["name"]}
VALUE = {"name": "Zoë \"Z\"", "tags": ["a", "b"], "score": 0.5}


@pytest.fixture(scope="module")
def tokenizers(default_gguf):
    from mesh_llm.engines.base import EngineOptions
    from mesh_llm.engines.hf_tokenizer import HFTokenizer
    from mesh_llm.engines.llama.engine import LlamaEngine
    from mesh_llm.models.default import default_mlx_folder

    engine = LlamaEngine.load(default_gguf, EngineOptions(ctx_size=256, cache_bytes=0))
    yield {"llama": engine.tokenizer, "mlx": HFTokenizer.from_folder(default_mlx_folder())}
    engine.close()


def allowed(constraint) -> set[int]:
    return set(np.flatnonzero(constraint.mask()).tolist())


def test_both_tokenizers_allow_the_same_tokens(tokenizers):
    """Write VALUE token by token, each time the allowed token that spells the most of what is left
    (the matcher may only offer some splits of text the grammar forces), comparing the masks."""
    llama, mlx = tokenizers["llama"], tokenizers["mlx"]
    grammar = json_schema_grammar(SCHEMA)
    a, b = Grammars(llama).constraint(grammar), Grammars(mlx).constraint(grammar)
    left = json.dumps(VALUE, ensure_ascii=False)
    while left:
        assert allowed(a) == allowed(b)
        spelled = {t: llama.decode([t]) for t in allowed(a) - llama.eos_token_ids}
        token = max((t for t, text in spelled.items() if text and left.startswith(text)),
                    key=lambda t: len(spelled[t]))
        a.advance(token)
        b.advance(token)
        left = left[len(spelled[token]):]
    # the end of the turn and nothing else, each by its own tokenizer's end tokens (llama.cpp counts
    # <reponame> among SmolLM2's; the tokenizer.json does not)
    assert a.done and b.done and allowed(a) == llama.eos_token_ids and allowed(b) == mlx.eos_token_ids


def test_the_mask_covers_the_vocabulary_and_eos_only_when_complete(tokenizers):
    tok = tokenizers["mlx"]
    constraint = Grammars(tok).constraint(json_schema_grammar({"type": "integer"}))
    mask = constraint.mask()
    assert mask.dtype == bool and mask.shape == (tok.vocab_size,)
    assert not set(np.flatnonzero(mask)) & tok.eos_token_ids  # nothing written yet: no end
    constraint.advance(tok.encode("4", add_special_tokens=False)[0])
    assert tok.eos_token_ids <= allowed(constraint)  # "4" is a whole integer: the end may follow


def test_a_token_outside_the_grammar_leaves_only_eos(tokenizers):
    tok = tokenizers["llama"]
    constraint = Grammars(tok).constraint(json_schema_grammar({"type": "boolean"}))
    constraint.advance(tok.encode("hello", add_special_tokens=False)[0])
    assert allowed(constraint) == set(tok.eos_token_ids)


def test_special_tokens_in_lark(tokenizers):
    tok = tokenizers["llama"]
    grammars = Grammars(tok)
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert grammars.literal("<|im_end|>") == f"<[{end[0]}]>" and grammars.literal("<b>") == '"<b>"'
    constraint = grammars.constraint(lark_grammar(f'start: "x" {grammars.literal("<|im_start|>")} "y"'))
    constraint.advance(tok.encode("x", add_special_tokens=False)[0])
    assert allowed(constraint) == set(tok.encode("<|im_start|>", add_special_tokens=False))


def test_a_grammar_that_does_not_compile(tokenizers):
    with pytest.raises(GrammarError, match="objekt"):
        Grammars(tokenizers["llama"]).constraint(json_schema_grammar({"type": "objekt"}))


LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
           "$ref": "#/$defs/n"}


def test_a_grammar_with_no_first_token_is_refused_and_one_past_its_limits_says_so(tokenizers):
    """A $ref loop compiles but has no first token: refused when the constraint is made (a 400).
    Objects that must nest forever pass that, then fail on llguidance's limits two tokens in: the
    mask allows only the end, and ``failed`` says why (the runtime answers an error, not "stop")."""
    tok = tokenizers["llama"]
    grammars = Grammars(tok)
    with pytest.raises(GrammarError, match="does not compile"):
        grammars.constraint(json_schema_grammar(LOOP))
    constraint = grammars.constraint(json_schema_grammar(ENDLESS))
    for _ in range(8):
        mask = constraint.mask()
        if constraint.failed:
            break
        constraint.advance(int(np.flatnonzero(mask)[0]))
    assert constraint.failed and "Too many items" in constraint.failed
    assert allowed(constraint) == set(tok.eos_token_ids)
    assert Grammars(tok).constraint(json_schema_grammar(SCHEMA)).failed is None


def test_closed_objects():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}}},
        "$defs": {"d": {"type": "object", "properties": {"z": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]  # a property named so
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is untouched
