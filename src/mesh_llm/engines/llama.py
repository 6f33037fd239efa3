"""llama.cpp engine: GGUF models through llama-cpp-python's low-level bindings.

``llama_cpp.Llama`` is not used: it keeps logits for every position only with ``logits_all``
(n_ctx x n_vocab floats), silences logs by redirecting the process's stdout/stderr (other threads lose
their output), and carries a chat layer we never want. The C API it binds gives a sampler chain per
request (its own seed) and the last position's logits directly.

Prompt cache: the context's own KV is the first candidate (the next turn of a chat copies nothing);
what a request would cut from it is stored first (``llama_cache.ContextState`` in a ``PromptCache``),
and a stored state is restored when it shares more of the prompt. ``llama_cache`` says why only
prefill-computed KV is reused, and why flash attention is off on CPU.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import struct
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp.llama_cpp as ll
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mesh_llm.engines import llama_cache
from mesh_llm.engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineOptions,
    SamplingParams,
    Step,
)
from mesh_llm.engines.llama_cache import RECOMPUTE, ContextState
from mesh_llm.engines.prompt_cache import PromptCache, available_memory, default_cache_bytes

log = logging.getLogger(__name__)


class _NativeLog:
    """Routes llama.cpp's log lines to Python logging at debug and keeps the last errors, so a failed
    load can say why (llama.cpp itself only returns NULL)."""

    _ERROR, _CONTINUE = 4, 5  # ggml.h's ggml_log_level (llama-cpp-python's _logger.py has the old values)

    def __init__(self) -> None:
        self.errors: deque[str] = deque(maxlen=8)
        self._parts: list[str] = []
        self._level = 0
        self._callback = ll.llama_log_callback(self._on_log)  # referenced here so it is never freed
        ll.llama_log_set(self._callback, None)

    def _on_log(self, level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
        if level != self._CONTINUE:
            self._level = level
        self._parts.append((text or b"").decode("utf-8", errors="replace"))
        if self._parts[-1].endswith("\n"):
            line = "".join(self._parts).strip()
            self._parts.clear()
            if self._level == self._ERROR:
                self.errors.append(line)
            log.debug("llama.cpp: %s", line)


ll.llama_backend_init()
_NATIVE_LOG = _NativeLog()

# GGUF metadata value types -> struct format (8: string, 9: array are variable-length)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _GGUFHeader:
    """A bounds-checked reader of a GGUF header (gguf.GGUFReader takes seconds: it parses every
    vocab entry into arrays)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.read("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past the end of the file")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int):
        """A scalar or string value; arrays are skipped and return None."""
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.read("I"), self.read("Q")
            if etype in _GGUF_SCALARS:
                self.pos += n * struct.calcsize(_GGUF_SCALARS[etype])
            else:
                for _ in range(n):
                    self.value(etype)
            return None
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.read(_GGUF_SCALARS[vtype])


def _check_gguf(path: Path) -> dict[str, object]:
    """Validate magic, header and tensor extents, returning the scalar metadata: llama.cpp only
    answers NULL for a bad file, and a truncated one may load and then read past the mapping."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise EngineError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            h = _GGUFHeader(buf)
            h.pos = 4
            try:
                version = h.read("I")
                if version not in (2, 3):
                    raise EngineError(f"{path}: unsupported GGUF version {version}")
                n_tensors, n_kv = h.read("Q"), h.read("Q")
                meta = {}
                for _ in range(n_kv):
                    key = h.string()
                    meta[key] = h.value(h.read("I"))
                tensors = []
                for _ in range(n_tensors):
                    name, n_dims = h.string(), h.read("I")
                    dims = [h.read("Q") for _ in range(n_dims)]
                    tensors.append((name, dims, h.read("I"), h.read("Q")))
            except (struct.error, ValueError) as e:
                raise EngineError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    align = int(meta.get("general.alignment") or 32)
    data_start = -(-h.pos // align) * align
    end = data_start
    for name, dims, ttype, offset in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise EngineError(f"{path}: tensor {name} has unknown type {ttype}") from None
        end = max(end, data_start + offset + int(np.prod(dims, dtype=np.uint64)) // block * type_size)
    if end > size:
        raise EngineError(f"{path}: truncated GGUF file ({size:,} bytes, its tensors need {end:,})")
    return meta


def _resolve(path: Path) -> Path:
    """The .gguf file to load: ``path`` itself, or the one GGUF (or first shard) in a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        shards = [f for f in files if re.search(r"-00001-of-\d{5}\.gguf$", f.name)]
        if len(shards) == 1 or len(files) == 1:
            return (shards or files)[0]
        raise EngineError(f"{path}: expected one .gguf file in the folder, found {len(files)}")
    if not path.is_file():
        raise EngineError(f"{path}: model file not found")
    return path


def _physical_cores() -> int:
    """Physical cores this process may run on: llama.cpp's matmuls gain nothing from SMT siblings,
    and a container's CPU set can be smaller than the machine."""
    if hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)
        cores = set()
        for cpu in cpus:
            try:
                topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
                cores.add((topology / "physical_package_id").read_text().strip()
                          + ":" + (topology / "core_id").read_text().strip())
            except OSError:
                return len(cpus)
        return max(1, len(cores))
    if sys.platform == "darwin":  # performance cores: efficiency cores slow every step to their pace
        import subprocess

        for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, check=False).stdout
            if out.strip().isdigit():
                return int(out)
    return os.cpu_count() or 1


def _amx_in_use() -> bool:
    """Whether ggml would run matmuls on AMX tiles: built with AMX (``-march=native`` on a Xeon turns it
    on) and the CPU has them. Its AMX kernel (llama-cpp-python 0.3.36) dies with SIGSEGV on ``ldtilecfg``
    on our Sapphire Rapids machines; AMX is one of llama.cpp's "extra" CPU buffer types, so there the
    engine loads without them (also losing weight repacking). Builds without AMX keep them."""
    if "AMX_INT8 = 1" not in ll.llama_print_system_info().decode(errors="replace"):
        return False
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _backend() -> str:
    """'cpu' unless this build offloads; then the GPU backend's name from llama.cpp's system info."""
    if not ll.llama_supports_gpu_offload():
        return "cpu"
    names = re.findall(r"(\w+) : ", ll.llama_print_system_info().decode(errors="replace"))
    gpus = [n.lower() for n in names if n.upper() not in ("CPU", "BLAS", "RPC")]
    if gpus:
        return {"mtl": "metal", "hip": "rocm"}.get(gpus[0], gpus[0])
    return "metal" if sys.platform == "darwin" else "gpu"


class LlamaTokenizer:
    """llama.cpp's own tokenizer on the loaded vocab. llama_tokenize/llama_detokenize only read the
    vocab (const methods, a tokenizer session per call) and ctypes drops the GIL, so API threads
    tokenize while the worker decodes; the lock only keeps close() from freeing the vocab mid-call."""

    def __init__(self, model: ll.llama_model_p) -> None:
        self._lock = threading.Lock()
        self._vocab = vocab = ll.llama_model_get_vocab(model)
        self._n_vocab = ll.llama_vocab_n_tokens(vocab)
        self._eos_ids = frozenset(t for t in range(self._n_vocab) if ll.llama_vocab_is_eog(vocab, t))
        self._bos = self._text(ll.llama_vocab_bos(vocab))
        self._eos = self._text(ll.llama_vocab_eos(vocab))
        template = ll.llama_model_chat_template(model, None)
        self._template = template.decode("utf-8") if template else None

    def _text(self, token: int) -> str | None:
        if token == ll.LLAMA_TOKEN_NULL:
            return None
        return ll.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-generation token llama.cpp knows (EOS, EOT, <|im_end|>, ...)."""
        return self._eos_ids

    @property
    def bos_token(self) -> str | None:
        return self._bos

    @property
    def eos_token(self) -> str | None:
        return self._eos

    @property
    def chat_template(self) -> str | None:
        return self._template

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        data = text.encode("utf-8")
        n = len(data) + 8  # byte-level vocabularies give at most a token a byte, plus BOS/EOS
        with self._lock:
            self._check_open()
            while True:
                out = (ll.llama_token * n)()
                got = ll.llama_tokenize(self._vocab, data, len(data), out, n, add_special_tokens, True)
                if got >= 0:
                    return out[:got]
                n = -got

    def decode(self, ids: Sequence[int]) -> str:
        tokens = (ll.llama_token * len(ids))(*ids)
        n = 16 * len(ids) + 16
        with self._lock:
            self._check_open()
            while True:
                buf = ctypes.create_string_buffer(n)
                got = ll.llama_detokenize(self._vocab, tokens, len(ids), buf, n, False, True)
                if got >= 0:
                    return buf.raw[:got].decode("utf-8", errors="replace")
                n = -got

    def token_table(self) -> list[tuple[bytes, bool]]:
        """Every token's bytes as generation emits them, and whether it is special (grammar libraries
        build their token tables from it)."""
        buf = ctypes.create_string_buffer(4096)
        table = []
        with self._lock:
            self._check_open()
            for token in range(self._n_vocab):
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                piece, attr = buf.raw[:max(n, 0)], ll.llama_vocab_get_attr(self._vocab, token)
                # as llguidance's own llama.cpp adapter: user-defined tokens spelled <...> are special too
                special = bool(attr & ll.LLAMA_TOKEN_ATTR_CONTROL) or bool(
                    attr & ll.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">"))
                table.append((piece, special))
        return table

    def _check_open(self) -> None:
        if self._vocab is None:
            raise EngineError("the llama engine is closed")


def _free_native(tokenizer: LlamaTokenizer, batch: ll.llama_batch, ctx, model) -> None:
    with tokenizer._lock:
        tokenizer._vocab = None
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(model)


def _make_sampler(params: SamplingParams) -> ll.llama_sampler_p:
    """A fresh sampler chain per request, so its seed alone decides its draws. Filters act on the
    untempered distribution and temperature comes last, as in llama.cpp's and mlx-lm's samplers."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    samplers = []
    if params.temperature <= 0:
        samplers.append(ll.llama_sampler_init_greedy())
    else:
        if params.top_k > 0:
            samplers.append(ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            samplers.append(ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            samplers.append(ll.llama_sampler_init_min_p(params.min_p, 1))
        samplers.append(ll.llama_sampler_init_temp(params.temperature))
        # LLAMA_DEFAULT_SEED (2**32 - 1) means "random": keep explicit seeds below it
        seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed % ll.LLAMA_DEFAULT_SEED
        samplers.append(ll.llama_sampler_init_dist(seed))
    for sampler in samplers:
        ll.llama_sampler_chain_add(chain, sampler)  # the chain owns and frees them
    return chain


class LlamaEngine(Engine):
    """A GGUF model in llama.cpp with one context (one sequence) and a prompt cache of its states."""

    name = "llama"
    formats = frozenset({"gguf"})

    def __init__(self, path: Path, meta: dict, model, ctx, threads: int, gpu_layers: int, n_batch: int,
                 options: EngineOptions):
        self._path, self._meta, self._model, self._ctx = path, meta, model, ctx
        self._threads, self._gpu_layers, self._n_batch = threads, gpu_layers, n_batch
        self._n_ctx = ll.llama_n_ctx(ctx)
        self._memory = ll.llama_get_memory(ctx)
        self._tokenizer = LlamaTokenizer(model)
        self._n_vocab = self._tokenizer.vocab_size
        self._tokens: list[int] = []  # what the context's KV holds, position by position
        self._exact = 0  # how many of them prefill computed (reusable: decode steps round otherwise)
        self._checkpoints = llama_cache.needs_checkpoints(model)
        size = default_cache_bytes(available_memory()) if options.cache_bytes is None else options.cache_bytes
        self._prompts = PromptCache(size, options.cache_entries, recompute=RECOMPUTE)
        self._active: weakref.ref | None = None  # the running generation, closed by the next one
        self._batch = ll.llama_batch_init(n_batch, 0, 1)
        for i in range(n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        self._batch_token = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._batch_pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._batch_logits = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._close = weakref.finalize(self, _free_native, self._tokenizer, self._batch, ctx, model)

    @classmethod
    def load(cls, path: Path, options: EngineOptions, progress=None) -> LlamaEngine:
        path = _resolve(path)
        meta = _check_gguf(path)
        params = ll.llama_model_default_params()
        params.n_gpu_layers = -1 if ll.llama_supports_gpu_offload() else 0  # -1: every layer
        params.use_extra_bufts = not _amx_in_use()
        if progress is not None:
            total = path.stat().st_size

            def on_progress(fraction: float, _user) -> bool:
                try:
                    progress(int(fraction * total), total)
                except Exception:  # an exception cannot cross back into C
                    log.exception("load progress callback failed")
                return True

            params.progress_callback = ll.llama_progress_callback(on_progress)  # params keeps it alive
        _NATIVE_LOG.errors.clear()
        model = ll.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            reason = _NATIVE_LOG.errors[0] if _NATIVE_LOG.errors else "no reason given"
            if "unknown model architecture" in reason:
                arch = meta.get("general.architecture")
                raise EngineError(f"{path}: unsupported architecture {arch!r} for this llama.cpp build")
            raise EngineError(f"{path}: llama.cpp cannot load it: {reason}")
        threads = options.threads or _physical_cores()
        n_ctx = options.ctx_size or ll.llama_model_n_ctx_train(model)
        n_batch = max(3, min(options.prefill_step, n_ctx))  # batch_ends needs room for two and one
        cparams = ll.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, n_batch, 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        llama_cache.set_cache_params(cparams, model)
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            ll.llama_model_free(model)
            reason = _NATIVE_LOG.errors[0] if _NATIVE_LOG.errors else "no reason given"
            raise EngineError(f"{path}: llama.cpp cannot create a {n_ctx}-token context: {reason}")
        gpu_layers = ll.llama_model_n_layer(model) if params.n_gpu_layers else 0
        return cls(path, meta, model, ctx, threads, gpu_layers, n_batch, options)

    @property
    def tokenizer(self) -> LlamaTokenizer:
        return self._tokenizer

    def info(self) -> EngineInfo:
        self._check_open()
        quant = ll.llama_ftype_name(ll.llama_model_ftype(self._model)) or b"unknown"
        cache = self._prompts
        details = {"prompt_cache": f"{cache.max_bytes / 1e6:.0f} MB, {cache.max_entries} entries"
                   + (", checkpoints" if self._checkpoints else "")} if cache.enabled else {}
        return EngineInfo(
            engine=self.name,
            device="gpu" if self._gpu_layers else "cpu",
            backend=_backend(),
            model_format="gguf",
            context_length=self._n_ctx,
            memory_bytes=ll.llama_model_size(self._model) + ll.llama_state_get_size(self._ctx),
            details={
                "architecture": str(self._meta.get("general.architecture")),
                "quantization": quant.decode(),
                "threads": str(self._threads),
                "n_gpu_layers": str(self._gpu_layers),
                "n_batch": str(self._n_batch),
                "file": str(self._path),
                **details,
            },
        )

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[Step]:
        """Checks the prompt now (so errors raise at the call) and closes any running generation."""
        self._stop_active()
        self._check_open()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise EngineError("empty prompt: give at least one token")
        if len(prompt) >= self._n_ctx:
            n, room = len(prompt), self._n_ctx
            raise EngineError(f"prompt of {n} tokens leaves no room in a {room}-token context")
        if min(prompt) < 0 or max(prompt) >= self._n_vocab:
            raise EngineError(f"prompt has a token id outside the vocabulary of {self._n_vocab}")
        steps = self._generate(prompt, params)
        self._active = weakref.ref(steps)
        return steps

    def _generate(self, prompt: list[int], params: SamplingParams) -> Iterator[Step]:
        sampler = _make_sampler(params)
        try:
            cached = self._prefill(prompt)
            while True:
                token = ll.llama_sampler_sample(sampler, self._ctx, -1)
                logprob, top = self._logprobs(token, params.logprobs)
                yield Step(token, logprob, top, cached)
                cached = 0
                if len(self._tokens) + 1 >= self._n_ctx:  # the token just yielded fills the context
                    return
                self._decode([token])
        finally:
            ll.llama_sampler_free(sampler)

    def _prefill(self, prompt: list[int]) -> int:
        """Evaluate ``prompt`` from the state that holds most of it (the context's own, or a stored
        one) and return how many tokens were reused; with the cache off, from an empty context."""
        reused, pinned = 0, False
        if self._prompts.enabled:
            live = llama_cache.live_prefix(self._tokens, self._exact, prompt, self._checkpoints)
            self._store_live(live)
            blob, reused = self._prompts.lookup(prompt, live)
            if blob is not None:
                self._tokens, self._exact = [], 0  # until the restore succeeds
                pinned = llama_cache.restore(self._ctx, blob, reused)
                self._tokens = prompt[:reused]
        if not ll.llama_memory_seq_rm(self._memory, 0, reused, -1):
            raise EngineError(f"{self._path}: llama.cpp cannot cut the context back to {reused} tokens")
        del self._tokens[reused:]
        self._exact = reused
        pos, store = reused, self._checkpoints and self._prompts.enabled
        for end in llama_cache.batch_ends(reused, len(prompt), self._n_batch, self._checkpoints):
            self._decode(prompt[pos:end])
            if pinned:
                llama_cache.unpin(self._memory)
                pinned = False
            if end - pos >= 2:
                self._exact = end
                if store and (end % self._n_batch == 0 or end == len(prompt) - RECOMPUTE):
                    self._prompts.insert(prompt[:end], ContextState(self._ctx, trimmable=False))
            pos = end
        return reused

    def _store_live(self, keep: int) -> None:
        """Before the context is cut back to ``keep`` tokens or replaced, store the prefill-computed
        tokens it would lose (the tokens decode steps added are dropped: see llama_cache)."""
        if (not self._prompts.enabled or keep >= self._exact
                or (self._checkpoints and self._exact < len(self._tokens))):
            return
        ll.llama_memory_seq_rm(self._memory, 0, self._exact, -1)
        del self._tokens[self._exact:]
        self._prompts.insert(self._tokens, ContextState(self._ctx, trimmable=not self._checkpoints))

    def _decode(self, tokens: list[int], all_logits: bool = False) -> list[np.ndarray]:
        """Append ``tokens`` to the context in batches, with logits for the last of each batch (or, with
        ``all_logits``, for every token: those rows are returned)."""
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), self._n_batch):
            chunk = tokens[start : start + self._n_batch]
            n, past = len(chunk), len(self._tokens)
            self._batch_token[:n] = chunk
            self._batch_pos[:n] = np.arange(past, past + n)
            self._batch_logits[:n] = 1 if all_logits else 0
            self._batch_logits[n - 1] = 1
            self._batch.n_tokens = n
            rc = ll.llama_decode(self._ctx, self._batch)
            if rc != 0:  # the KV may hold part of the batch: start the next request from scratch
                ll.llama_memory_clear(self._memory, True)
                self._tokens.clear()
                self._exact = 0
                raise EngineError(f"{self._path}: llama_decode failed (code {rc}) at position {past}")
            self._tokens.extend(chunk)
            if all_logits:
                rows.extend(np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i),
                                                  shape=(self._n_vocab,)).copy() for i in range(n))
        return rows

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits of every position, from an emptied context (closes any running generation)."""
        self._stop_active()
        self._check_open()
        ids = [int(t) for t in tokens]
        if not ids or len(ids) > self._n_ctx or min(ids) < 0 or max(ids) >= self._n_vocab:
            raise EngineError(f"score needs 1 to {self._n_ctx} token ids in [0, {self._n_vocab})")
        self._store_live(0)
        ll.llama_memory_clear(self._memory, True)
        self._tokens.clear()
        self._exact = 0
        return np.stack(self._decode(ids, all_logits=True)).astype(np.float32)

    def _logprobs(self, token: int, n: int | None) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        """log_softmax of the raw logits over the whole vocabulary (before any temperature or filter),
        the chosen token's value and the ``n`` most likely tokens, best first."""
        if n is None:
            return None, ()
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,))
        shifted = logits.astype(np.float64) - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        top: tuple[tuple[int, float], ...] = ()
        if n > 0:
            best = np.argpartition(-logprobs, min(n, self._n_vocab) - 1)[:n]
            best = best[np.lexsort((best, -logprobs[best]))]
            top = tuple((int(i), float(logprobs[i])) for i in best)
        return float(logprobs[token]), top

    def _stop_active(self) -> None:
        steps = self._active() if self._active else None
        if steps is not None:
            steps.close()
        self._active = None

    def _check_open(self) -> None:
        if not self._close.alive:
            raise EngineError(f"{self._path}: the llama engine is closed")

    def cache_stats(self) -> dict:
        return self._prompts.stats()

    def close(self) -> None:
        self._stop_active()
        self._prompts.clear()
        self._close()
