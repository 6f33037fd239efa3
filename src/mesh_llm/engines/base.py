"""The one narrow interface every engine implements, in token ids and arrays, never HTTP types.

An engine is a *model runner*: it owns a loaded model and its tokenizer, holds the state of many
sequences, and executes the steps that ``mesh_llm.runtime.scheduler`` plans for them (which sequences
decode, which prompt chunks are read, who waits, who is preempted). :class:`Engine` puts the two
together behind the calls the worker makes: :meth:`Engine.add` admits a sequence, :meth:`Engine.step`
plans and runs one forward pass over every sequence held and returns the tokens sampled, and
:meth:`Engine.remove` ends a sequence, offering its state to the prompt cache. Everything
request-shaped (chat templates, stop strings, max_tokens, EOS, detokenizing, queueing) lives above it
in ``mesh_llm.runtime``, so a new engine (a third library, a pipeline stage) is one new package that
subclasses :class:`Engine`, implements its runner methods, and registers itself in
``mesh_llm.engines``.

Engines are not thread-safe: the runtime creates, uses and closes each one on a single worker thread
(MLX arrays and streams must stay on the thread that made them). Tokenizers are the exception.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from mesh_llm.runtime.scheduler import NoCapacity, Plan, Scheduler

__all__ = ["NoCapacity", "Plan"]  # the scheduler's, which engines raise and run


class EngineError(Exception):
    """A model cannot be loaded or served by an engine; the message names the file and the problem."""


class EngineUnavailable(EngineError):
    """The engine's optional dependency is not installed; the message names the pip extra to install."""


# On a GPU, prompt chunks (``EngineInfo.prefill_step`` tokens each) one step reads while other
# sequences decode (2,048 tokens on the llama engine, as llama-server's n_batch): a pass over several
# newcomers' chunks costs little more than over one
GPU_PREFILL_CHUNKS = 4
PREFILL_STEP = 512  # prompt tokens of one sequence a forward pass reads, unless an engine knows better


@dataclass(frozen=True)
class EngineOptions:
    """How to load a model; every field has a default that suits the machine it runs on."""

    ctx_size: int | None = None  # None: the model's own trained context length
    quantize: int | None = None  # 4 or 8: quantize on load (MLX on a GPU only)
    threads: int | None = None  # None: the number of physical cores
    prefill_step: int | None = None  # prompt tokens of one sequence per forward pass; None: the engine's
    cache_bytes: int | None = None  # prompt cache budget; None: from free memory at load; 0: off
    kv_bytes: int | None = None  # memory the live sequences' KV may take; None: the engine's share of free
    cache_entries: int = 64  # most states the prompt cache keeps
    max_batch: int | None = None  # sequences decoded together; None: chosen from device and memory
    warm_up: bool | None = None  # run serving's shapes once before ready; None: where it pays (a GPU)
    deterministic: bool = False  # llama engine on a CPU: bit for bit alone, batched or resumed (slower)


CONTEXT_STEP = 256  # a context fitted to memory is a multiple of this many tokens
TYPICAL_SEQUENCE = 2048  # tokens a default batch size plans per sequence (prompt and answer)


def fit_context(trained: int, needs: Callable[[int], int], budget: int) -> int:
    """The context a model gets where ``--ctx-size`` is not given: its own trained length, or the
    longest multiple of :data:`CONTEXT_STEP` below it whose memory (``needs(tokens)`` bytes, which
    grows with tokens) fits ``budget``. Many models are trained on 32k-128k tokens, where one
    sequence's KV alone can outgrow the machine (an 8B Llama's 131,072 tokens take 16 GiB); as
    llama-server's ``--fit`` and Ollama's default context, the default then shrinks to fit."""
    if needs(trained) <= budget:
        return trained
    low, high = 1, max(1, trained // CONTEXT_STEP)  # in steps: low fits or is the floor
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if needs(mid * CONTEXT_STEP) <= budget else (low, mid - 1)
    return min(trained, low * CONTEXT_STEP)


@runtime_checkable
class Constraint(Protocol):
    """Limits which tokens one sequence may sample (a JSON schema, a tool call's grammar). The engine
    asks for the mask before sampling each of the sequence's tokens and reports the token it chose.
    ``failed`` says why it gave up and allowed only an end of sequence (a grammar past its resource
    limits; None while it holds): the runtime then answers an error, not a finished reply."""

    failed: str | None

    def mask(self) -> np.ndarray | None:
        """Allowed next tokens: a bool array over the tokenizer's vocabulary, or None for any token."""
        ...

    def advance(self, token: int) -> None:
        """The sequence sampled ``token``."""
        ...


# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: a draw there is the argmax anyway
# (barring exact ties), and logits divided by ~1e-38 overflow float32 (llama.cpp's sampler chain then
# returned one fixed token whatever the logits).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. A ``temperature`` of 0 (or under :data:`GREEDY_BELOW`) is greedy;
    ``logprobs`` is the number of alternatives to report per token (0: only the chosen token's),
    None for no logprobs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0  # 0: disabled
    seed: int | None = None
    logprobs: int | None = None
    constraint: Constraint | None = field(default=None, compare=False)  # per sequence, stateful

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class Step:
    """One sampled token. ``cached_tokens`` is set on the first step of a generation: how many
    prompt tokens were reused from the engine's prompt cache instead of being recomputed."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineInfo:
    engine: str  # "mlx", "llama"
    device: str  # "cpu" or "gpu"
    backend: str  # e.g. "cpu+openblas", "cuda", "metal"
    model_format: str  # "safetensors" or "gguf"
    context_length: int
    memory_bytes: int  # weights plus what the engine has allocated so far
    prefill_step: int = PREFILL_STEP  # prompt tokens of one sequence a forward pass reads
    details: dict[str, str] = field(default_factory=dict)  # dtype, quantization, threads, ...


@runtime_checkable
class Tokenizer(Protocol):
    """What the runtime needs of a tokenizer. Implementations must be safe to call from any thread
    (the API layer tokenizes while the worker generates)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) become their ids.
        ``add_special_tokens`` adds what the model puts around raw text (a BOS), never a template."""
        ...

    @property
    def control_texts(self) -> frozenset[str]:
        """The texts ``encode`` reads as one control token wherever they stand (``<|im_start|>``):
        the runtime encodes message text that holds one with :meth:`encode_plain` instead."""
        ...

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with its control-token texts read as plain text, nothing added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        ...

    def min_tokens(self, text: str) -> int:
        """At most ``len(encode(text, False))``, found in time linear in ``text`` without tokenizing
        it (:class:`~mesh_llm.engines.token_floor.TokenFloor`): a prompt that cannot fit the context
        is refused before a tokenizer spends long on it."""
        ...


def warm_up_before_ready(engine, options: EngineOptions, gpu: bool) -> float | None:
    """Run ``engine.warm_up()`` where asked (``--warm-up``), by default on a GPU, whose first use of
    each shape costs most. Returns its seconds, or None where it did not run or was cut short: a
    warm-up that finds no room (``NoCapacity``) or fails says so in the engine's log, and serving
    goes on."""
    if not (gpu if options.warm_up is None else options.warm_up):
        return None
    log = logging.getLogger(type(engine).__module__)
    try:
        seconds = engine.warm_up()
    except (EngineError, NoCapacity) as e:
        log.warning("warm-up cut short: %s", e)
        return None
    log.info("warm-up: %.2f s (the shapes serving uses, run once before ready)", seconds)
    return seconds


class Engine(abc.ABC):
    """A loaded model serving up to ``max_batch`` sequences at once. Subclasses set ``name`` and
    ``formats``, implement the model's methods (``load``, ``tokenizer``, ``info``, ``score``) and the
    runner's (``check`` to ``readmit``), and state their facts for the scheduler."""

    name: ClassVar[str]
    formats: ClassVar[frozenset[str]]  # model formats it loads: "safetensors", "gguf"

    # Facts the scheduler plans by (``runtime.scheduler.Runner``): the most tokens one forward pass
    # holds (None: any), whether a sequence can start from a prefix a live one holds, the shortest
    # shared prefix worth waiting for, whether sequences must never be preempted (their whole
    # answers are claimed at admission), and the answer tokens a sequence is given room for ahead.
    pass_tokens: int | None = None
    shares_prefixes: bool = False
    least_shared_wait: int = 1
    reserves_answers: bool = False
    answer_headroom: int = 0

    @classmethod
    @abc.abstractmethod
    def load(cls, path: Path, options: EngineOptions, progress=None) -> Engine:
        """Load the model at ``path`` (a folder or a .gguf file). ``progress(done, total)`` may be
        called while loading. Raises :class:`EngineError` with a one-line message on bad input."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @property
    @abc.abstractmethod
    def max_batch(self) -> int:
        """The most sequences held at once (``EngineOptions.max_batch``, or what the device and
        memory allow)."""

    # -- the calls the worker makes ----------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = Scheduler(self)
        return self._scheduler

    _scheduler: Scheduler | None = None

    def add(self, seq: int, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        """Take sequence ``seq`` (an id unique among those held): check it now, compute nothing yet.

        Raises ``ValueError`` or :class:`EngineError` for a request the engine cannot serve (an
        empty or over-long prompt, ids outside the vocabulary, a bad sampling parameter), and
        :class:`NoCapacity` when it could serve it later. ``max_tokens`` is the most tokens the
        runtime will ask of it (``len(prompt) + max_tokens`` never exceeds the context).
        """
        if seq in self.scheduler:
            raise ValueError(f"sequence {seq} is already running")
        self.check(prompt, params, max_tokens)
        self.scheduler.admit(seq, prompt, max_tokens)
        self.accept(seq, prompt, params, max_tokens)
        self.scheduler.add(seq, prompt, max_tokens)

    def step(self, prefill_budget: int) -> list[tuple[int, Step]]:
        """One forward pass over every sequence held: the next chunk of prompt for sequences still
        reading theirs (at most ``prefill_budget`` prompt tokens in all, some progress whenever one
        is waiting), one token for each decoding sequence. Returns ``(seq, step)`` for each token
        sampled, in order, a sequence's first once its prompt is read; a pipelined engine may return
        two of one sequence (the pass it had in flight, and the one it read at once for a newcomer).

        A sequence goes on decoding until :meth:`remove`; the runtime stops it at its
        ``max_tokens`` at the latest. An engine that fails mid-step raises :class:`EngineError`
        after dropping every sequence it held.
        """
        try:
            return self.scheduler.step(prefill_budget)
        except Exception:
            self.scheduler.clear()  # the runner dropped them all (``run``'s contract)
            raise

    def remove(self, seq: int) -> None:
        """End sequence ``seq`` (finished or cancelled, at any point, prompt half read included) and
        free its slot; its state goes to the prompt cache. Unknown ids are ignored."""
        if seq in self.scheduler:
            self.release(seq)
            self.scheduler.remove(seq)

    # -- the runner: what the scheduler asks of an engine (runtime.scheduler.Runner) ---------------

    @abc.abstractmethod
    def check(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        """Raise ``ValueError`` or :class:`EngineError` for a sequence this engine could never serve."""

    @abc.abstractmethod
    def accept(self, seq: int, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        """Hold ``seq`` (checked and admitted): its sampler and bookkeeping; no state, no compute."""

    @abc.abstractmethod
    def release(self, seq: int) -> None:
        """Let ``seq`` go, whatever it holds; its state is offered to the prompt cache."""

    @abc.abstractmethod
    def fits(self, claims: Mapping[int, int], new: tuple[Sequence[int], int, int] | None = None) -> bool:
        """Whether the held sequences at their claims (tokens) fit the KV memory, and ``new`` (one to
        admit or resume: prompt, claim, max_tokens) beside them; what no running sequence needs may
        be freed to make them fit."""

    def start_step(self) -> None:  # noqa: B027 - optional hook
        """A step begins: rearrange what the engine holds before any sequence begins (or nothing)."""

    def claimed(self, claims: Mapping[int, int]) -> None:  # noqa: B027 - optional hook
        """The running sequences' claims as they stand, for sizing what the engine keeps beside them."""

    def reusable(self, seq: int) -> int:
        """Prompt tokens :meth:`begin` would reuse now (the prompt cache, a live sequence)."""
        return 0

    @abc.abstractmethod
    def begin(self, seq: int) -> int:
        """Give ``seq`` its state, resumed from the longest prefix it can reuse; returns its length."""

    @abc.abstractmethod
    def chunk_end(self, start: int, stop: int, budget: int | None) -> int | None:
        """Where the prompt chunk from ``start`` toward ``stop`` ends, within ``budget`` tokens (None:
        a whole chunk); None where none fits."""

    @abc.abstractmethod
    def run(self, plan: Plan) -> list[tuple[int, Step]]:
        """Execute one planned step in one forward pass; returns the tokens sampled. Raises
        :class:`EngineError` after dropping every sequence where the pass fails."""

    @abc.abstractmethod
    def preempt(self, seq: int) -> list[tuple[int, Step]]:
        """Take back ``seq``'s state (offered to the prompt cache); returns a token it had sampled
        but not yet returned (a pipelined step in flight)."""

    @abc.abstractmethod
    def readmit(self, seq: int, prompt: Sequence[int], max_tokens: int) -> None:
        """After :meth:`preempt`: ``seq`` reads ``prompt`` again, then samples up to ``max_tokens``
        more, its sampler's state (PRNG key, constraint) where it stood."""

    # -- the rest --------------------------------------------------------------------------------

    @abc.abstractmethod
    def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Float32 logits, shape (len(tokens), vocab): what the model predicts after each prefix of
        ``tokens``, in one pass (teacher forcing: parity checks, prompt logprobs). Only while no
        sequence is held."""

    def generate(self, prompt: Sequence[int], params: SamplingParams,
                 max_tokens: int | None = None) -> Iterator[Step]:
        """One sequence alone, for tests, parity checks and raw benchmarks: check it now (errors
        raise here), then yield its tokens until ``max_tokens`` (default: until the context is
        full). Closing the iterator removes it; only one such generation runs at a time."""
        self._end_solo()
        context = self.info().context_length
        room = context - len(prompt)
        limit = room if max_tokens is None else min(max_tokens, room)
        self.add(_SOLO, prompt, params, max(1, limit))
        self._solo = self._run_solo(limit, context)
        return self._solo

    _solo: Iterator[Step] | None = None

    def _end_solo(self) -> None:
        """End the running :meth:`generate` sequence, if any: before the next one, or a score()."""
        if self._solo is not None:
            self._solo.close()
            self.remove(_SOLO)  # a generation closed before its first step never ran its finally
            self._solo = None

    def _run_solo(self, limit: int, budget: int) -> Iterator[Step]:
        try:
            produced = 0
            while produced < limit:
                for seq, step in self.step(budget):
                    if seq == _SOLO:
                        produced += 1
                        yield step
        finally:
            self.remove(_SOLO)
            self._solo = None

    def cache_stats(self) -> dict:
        """The prompt cache's counters (``PromptCache.stats``) and ``kv_preemptions``. Any thread
        may call."""
        return {"kv_preemptions": self._scheduler.preemptions if self._scheduler is not None else 0}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model's memory."""


_SOLO = -1  # the sequence id :meth:`Engine.generate` uses
