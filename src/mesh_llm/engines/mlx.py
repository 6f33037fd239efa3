"""The native MLX engine: Hugging Face safetensors folders and llama GGUF files through mlx-lm's models.

Models are built by mlx-lm's own classes (``mlx_lm.utils.load_model`` for folders, its
``_get_classes`` + ``sanitize`` + ``load_weights`` steps for GGUF weights), so every architecture
mlx-lm supports loads. What this file adds is what a server needs around them: fast BLAS and
dequantized float32 weights on CPU, per-request sampling with its own PRNG key, logprobs computed
on the device, chunked prefill, a pipelined decode loop (as in ``mlx_lm.generate.generate_step``) and
prompt-cache reuse across requests (``prompt_cache.PromptCache`` holding ``mlx_cache.Frozen`` states).

Everything MLX runs on the thread that calls :meth:`MLXEngine.load`; this module starts no threads.
"""

from __future__ import annotations

import copy
import json
import logging
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mesh_llm.engines.mlx_blas import ensure_fast_blas, physical_cores, set_blas_threads

_BLAS = ensure_fast_blas()  # must run before mlx.core is first imported in the process

import mlx.core as mx
import mlx_lm
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.utils import _get_classes, dequantize_model, infer_quant_config, load_model

from mesh_llm.engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineOptions,
    SamplingParams,
    Step,
    Tokenizer,
)
from mesh_llm.engines.hf_tokenizer import HFTokenizer, first_line
from mesh_llm.engines.mlx_cache import Frozen, free_memory, needs_checkpoints
from mesh_llm.engines.prompt_cache import PromptCache, default_cache_bytes

log = logging.getLogger(__name__)

# MLX on CPU multiplies float32 through OpenBLAS' sgemm and has no fast path for 16-bit floats or
# quantized weights. Measured on the 2-core EPYC (mlx 0.32.4, cmeel OpenBLAS): 2048³ matmul
# float32 136 GFLOP/s, bfloat16 5.1, float16 2.9; 4096² matrix-vector float32 8 ms, bfloat16 12 ms.
# So on CPU every floating weight is served as float32, quantized ones dequantized first.
CPU_DTYPE = mx.float32
QUANT_GROUP_SIZE = 64
_DEFAULT_CONTEXT = 4096  # for configs that state no max_position_embeddings


class MLXEngine(Engine):
    """A model loaded into MLX; one generation at a time, on the loading thread."""

    name = "mlx"
    formats = frozenset({"safetensors", "gguf"})

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, config: dict[str, Any],
                 context_length: int, options: EngineOptions, details: dict[str, str],
                 model_format: str):
        self._model = model
        self._tokenizer = tokenizer
        self._vocab = int(_text_config(config).get("vocab_size") or tokenizer.vocab_size)
        self._context = context_length
        self._options = options
        self._details = details
        self._format = model_format
        self._active: Iterator[Step] | None = None
        cache_bytes = options.cache_bytes
        if cache_bytes is None:
            cache_bytes = default_cache_bytes(free_memory())
        self._prompts = PromptCache(cache_bytes, options.cache_entries)
        self._checkpoints = needs_checkpoints(make_prompt_cache(model))
        if self._prompts.enabled:
            self._details["prompt_cache"] = (f"{cache_bytes / 1e6:.0f} MB, {options.cache_entries} "
                                             f"entries" + (", checkpoints" if self._checkpoints else ""))

    @classmethod
    def load(cls, path: Path, options: EngineOptions, progress=None) -> MLXEngine:
        path = Path(path)
        threads = options.threads or physical_cores()
        set_blas_threads(threads)
        if path.is_dir():
            model, config, tokenizer, fmt = _load_folder(path)
        elif path.is_file() and path.suffix.lower() == ".gguf":
            model, config, tokenizer, fmt = _load_gguf(path)
        elif path.exists():
            raise EngineError(f"{path}: not a model folder or a .gguf file")
        else:
            raise EngineError(f"{path}: no such file or folder")
        details = _prepare(model, config, options, path)
        _materialize(model, path, progress)
        details["blas"] = _BLAS
        if not _on_gpu():
            details["threads"] = str(threads)
        text = _text_config(config)
        ctx = options.ctx_size or text.get("max_position_embeddings") or _DEFAULT_CONTEXT
        return cls(model, tokenizer, config, int(ctx), options, details, fmt)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def info(self) -> EngineInfo:
        gpu = mx.default_device().type == mx.DeviceType.gpu
        if gpu:
            backend = "metal" if mx.metal.is_available() else "cuda"
        else:
            backend = "cpu+" + _BLAS.split(" ")[0]
        params = sum(v.nbytes for _, v in tree_flatten(self._model.parameters()))
        return EngineInfo(
            engine=self.name,
            device="gpu" if gpu else "cpu",
            backend=backend,
            model_format=self._format,
            context_length=self._context,
            memory_bytes=max(params, mx.get_active_memory()),
            details=dict(self._details),
        )

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[Step]:
        """Validate now (``ValueError`` for a bad request), then return the step generator."""
        if self._active is not None:
            self._active.close()
            self._active = None
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self._context:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the context holds {self._context}"
            )
        if min(prompt) < 0 or max(prompt) >= self._vocab:
            raise ValueError(f"prompt token ids must lie in [0, {self._vocab})")
        sampler = _Sampler(params, self._vocab)
        self._active = self._steps(prompt, sampler)
        return self._active

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        ids = [int(t) for t in tokens]
        if not ids or min(ids) < 0 or max(ids) >= self._vocab or len(ids) > self._context:
            raise ValueError(f"score needs 1 to {self._context} token ids in [0, {self._vocab})")
        cache, step = make_prompt_cache(self._model), max(1, self._options.prefill_step)
        rows = []
        for start in range(0, len(ids), step):
            logits = self._model(mx.array(ids[start:start + step])[None], cache=cache)[0]
            rows.append(np.array(logits.astype(mx.float32)))
        return np.concatenate(rows)

    def cache_stats(self) -> dict:
        return self._prompts.stats()

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
        self._active = None
        self._prompts.clear()
        self._model = None
        mx.clear_cache()

    def _prompt_cache(self, prompt: list[int]) -> tuple[list[Any], int]:
        """The KV cache to generate with and how many prompt tokens it already holds."""
        if self._prompts.enabled:
            cache, reused = self._prompts.lookup(prompt)
            if cache is not None:
                log.debug("prompt cache: %d of %d prompt tokens reused", reused, len(prompt))
                return cache, reused
        return make_prompt_cache(self._model), 0

    def _keep(self, tokens: list[int], cache: list[Any]) -> None:
        """Store ``cache``, which holds exactly ``tokens``, for later prompts (it is not used again)."""
        if self._prompts.enabled:
            self._prompts.insert(tokens, Frozen(cache, len(tokens)))

    def _steps(self, prompt: list[int], sampler: _Sampler) -> Iterator[Step]:
        cache, reused = self._prompt_cache(prompt)
        step = max(1, self._options.prefill_step)
        # Prefill all but the last prompt token in chunks, keeping only the KV states (as
        # generate_step does); the last token's forward pass yields the first logits. Chunks end at
        # multiples of the step, so a resumed prefill splits the rest of the prompt as a cold one
        # does, and there a model that needs checkpoints leaves one (plus one at the prompt's end).
        start = reused
        while start < len(prompt) - 1:
            end = min((start // step + 1) * step, len(prompt) - 1)
            self._model(mx.array(prompt[start:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            if self._checkpoints:
                self._keep(prompt[:end], copy.deepcopy(cache))
            mx.clear_cache()
            start = end
        # On a GPU, token n+1's graph is built and queued (mx.async_eval, as generate_step does)
        # before token n is read, so Python builds the next graph while the device computes this
        # one: +7-19% tok/s on an H200. On CPU the same queueing cost ~20% on a tiny model and
        # nothing on SmolLM2-135M (measured, 2-core EPYC), so there the next step is built only when
        # asked for: a generation closed after token n stores its state without computing one more
        # step (a decode step's time: 65 ms on SmolLM2).
        pipelined = _on_gpu()
        pending = self._forward(mx.array(prompt[-1:]), cache, sampler)
        if pipelined:
            mx.async_eval(pending)
        held = list(prompt)  # the tokens whose state ``cache`` holds (the last ones maybe lazily)
        cached = reused  # reported on the first step only
        try:
            while True:
                current = pending
                feed = len(held) + 1 < self._context  # room for this step's token and the next
                ahead = feed and pipelined
                if ahead:
                    pending = self._forward(current[0], cache, sampler)
                    mx.async_eval(pending)
                out = sampler.step(current, cached=cached)
                if ahead:
                    held.append(out.token)
                yield out
                if not feed:
                    break
                if not ahead:
                    pending = self._forward(mx.array([out.token]), cache, sampler)
                    held.append(out.token)
                cached = 0
                if len(held) % 256 == 0:
                    mx.clear_cache()
        except GeneratorExit:  # the caller closed it: the usual end of a generation
            self._keep(held, cache)
            raise
        self._keep(held, cache)

    def _forward(self, tokens: mx.array, cache: list[Any], sampler: _Sampler) -> list[mx.array]:
        logits = self._model(tokens.reshape(1, -1), cache=cache)[:, -1, :]
        return sampler.sample(logits.astype(mx.float32))


class _Sampler:
    """One request's sampling state: its filters and its own PRNG key (never the global seed)."""

    def __init__(self, params: SamplingParams, vocab: int):
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 <= params.min_p <= 1:
            raise ValueError("min_p must lie in [0, 1]")
        if params.logprobs is not None and params.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        self.params = params
        self.top_n = min(params.logprobs or 0, vocab)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.key = mx.random.key(seed % 2**64)  # any int, negative or huge, maps to a uint64
        # The same filters and order as mlx_lm.sample_utils.make_sampler (and llama.cpp's default
        # chain): top-p, min-p, top-k on the untempered distribution, then temperature.
        self.filters = []
        if 0 < params.top_p < 1:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        if 0 < params.top_k < vocab:
            self.filters.append(lambda x: apply_top_k(x, params.top_k))

    def sample(self, logits: mx.array) -> list[mx.array]:
        """Lazy arrays [token, chosen logprob, top ids, top logprobs] for (1, vocab) logits."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.params.temperature == 0:
            token = mx.argmax(logprobs, axis=-1)
        else:
            self.key, sub = mx.random.split(self.key)
            filtered = logprobs
            for f in self.filters:
                filtered = f(filtered)
            token = mx.random.categorical(filtered * (1 / self.params.temperature), key=sub)
        out = [token]
        if self.params.logprobs is not None:
            out.append(mx.take_along_axis(logprobs, token[:, None], axis=-1))
            if self.top_n:
                top = mx.argpartition(-logprobs, kth=self.top_n - 1, axis=-1)[:, : self.top_n]
                out += [top, mx.take_along_axis(logprobs, top, axis=-1)]
        return out

    def step(self, arrays: list[mx.array], cached: int) -> Step:
        """Read one evaluated step. Only whole arrays are read (``tolist``): indexing one would
        queue a new op behind the next step's forward pass and wait for it, undoing the overlap."""
        values = [a.tolist() for a in arrays]
        token = values[0][0]
        if len(values) == 1:
            return Step(token=token, cached_tokens=cached)
        alternatives = ()
        if len(values) == 4:
            alternatives = tuple(sorted(zip(values[2][0], values[3][0]), key=lambda p: -p[1]))
        return Step(token=token, logprob=values[1][0][0], top_logprobs=alternatives,
                    cached_tokens=cached)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return {**config.get("text_config", {}), **config}


def _load_folder(path: Path):
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EngineError(f"{config_file}: missing (not a Hugging Face model folder)")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise EngineError(f"{config_file}: unreadable JSON ({first_line(e)})") from e
    if not model_type:
        raise EngineError(f"{config_file}: no model_type")
    tokenizer = HFTokenizer.from_folder(path)
    try:
        model, config = load_model(path, lazy=True)
    except FileNotFoundError as e:
        raise EngineError(f"{path}: no model*.safetensors weight files") from e
    except ValueError as e:
        if "not supported" in str(e):
            raise EngineError(
                f"{config_file}: model_type {model_type!r} is not supported by mlx-lm "
                f"{mlx_lm.__version__}"
            ) from e
        raise EngineError(f"{path}: {first_line(e)}") from e
    except (RuntimeError, OSError, KeyError, TypeError) as e:
        raise EngineError(f"{_bad_weight_file(path) or path}: {first_line(e)}") from e
    return model, config, tokenizer, "safetensors"


def _bad_weight_file(path: Path) -> Path | None:
    """The first safetensors file MLX cannot open (its load errors do not always name it)."""
    for file in sorted(path.glob("model*.safetensors")):
        try:
            mx.load(str(file))
        except (RuntimeError, ValueError, OSError):
            return file
    return None


def _load_gguf(path: Path):
    try:
        from mesh_llm.models.gguf_convert import read_gguf
    except ImportError as e:
        raise EngineError(f"{path}: GGUF support (mesh_llm.models.gguf_convert) is missing") from e
    try:  # quantized tensors stay quantized here; _prepare dequantizes them on CPU
        gguf = read_gguf(path, dtype=None)
    except Exception as e:  # GGUFConvertError names the file; anything else gets it added
        message = first_line(e)
        raise EngineError(message if str(path) in message else f"{path}: {message}") from e
    config = dict(gguf.config)
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        weights = model.sanitize(gguf.weights) if hasattr(model, "sanitize") else gguf.weights
        if quant := config.get("quantization"):
            # As load_model does: per-layer settings from the config, else inferred from shapes.
            def predicate(p, m):
                if p in quant:
                    return quant[p]
                if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                    return False
                return infer_quant_config(p, m, weights)

            nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                        mode=quant.get("mode", "affine"), class_predicate=predicate)
        model.eval()
        model.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError, TypeError) as e:
        raise EngineError(f"{path}: cannot build the {config.get('model_type')} model "
                          f"({first_line(e)})") from e
    eos = config.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    tokenizer = HFTokenizer.from_json(gguf.tokenizer_json, gguf.tokenizer_config, eos)
    return model, config, tokenizer, "gguf"


def _on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def _prepare(model: nn.Module, config: dict[str, Any], options: EngineOptions,
             path: Path) -> dict[str, str]:
    """Set the serving precision (lazily, before the weights are read) and describe it."""
    quant = config.get("quantization")
    source = _quant_name(quant) if quant else _float_dtype(model)
    if not _on_gpu():
        if options.quantize:
            log.warning("%s: quantize=%s ignored: MLX has no fast quantized CPU kernel",
                        path, options.quantize)
        model.set_dtype(CPU_DTYPE)  # first, so that scales and biases dequantize in float32
        if quant:
            dequantize_model(model)
        return {"dtype": "float32", "quantization": f"dequantized from {source}" if quant else "none",
                "source_dtype": source}
    if options.quantize and not quant:
        if options.quantize not in (4, 8):
            raise EngineError(f"{path}: quantize must be 4 or 8, not {options.quantize}")
        custom = getattr(model, "quant_predicate", None)

        def predicate(p, m):
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % QUANT_GROUP_SIZE:
                return False
            return custom(p, m) if custom else True

        nn.quantize(model, QUANT_GROUP_SIZE, options.quantize, class_predicate=predicate)
        quant = {"bits": options.quantize, "group_size": QUANT_GROUP_SIZE, "mode": "affine"}
    return {"dtype": _float_dtype(model), "quantization": _quant_name(quant) if quant else "none",
            "source_dtype": source}


def _materialize(model: nn.Module, path: Path, progress) -> None:
    """Read (and convert) the weights now, reporting progress in bytes as each tensor lands."""
    params = [v for _, v in tree_flatten(model.parameters())]
    total, done = sum(v.nbytes for v in params), 0
    try:
        for v in params:
            mx.eval(v)
            done += v.nbytes
            if progress is not None:
                progress(done, total)
    except (RuntimeError, ValueError) as e:
        raise EngineError(f"{path}: cannot read the weights ({first_line(e)})") from e


def _float_dtype(model: nn.Module) -> str:
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "unknown"


def _quant_name(quant: dict[str, Any]) -> str:
    return f"{quant.get('bits')}-bit {quant.get('mode', 'affine')} g{quant.get('group_size')}"



