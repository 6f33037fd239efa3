"""A scripted engine: the runner interface (engines/base.Engine) over plain Python lists, so that the
scheduler, the worker and the API are tested in milliseconds, without a model.

Its "model" is a function of the whole token history: the next token is a hash of every token the
sequence's state holds, so a sequence that is preempted and reads again what it held answers exactly
as it would have, and one that starts from a shared prefix answers as one that read it itself. Its
KV memory is a number of tokens; it counts every prompt token it computes (``computed``), so tests
see what prefix sharing saved.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mesh_llm.engines.base import Engine, EngineError, EngineInfo, EngineOptions, Plan, SamplingParams, Step
from mesh_llm.runtime.scheduler import common_prefix

# A byte-level vocabulary: ids 0-255 are bytes, then the specials.
BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
VOCAB = 260
SPECIALS = {"<s>": BOS, "</s>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LETTERS = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz "]


class FakeTokenizer:
    """Bytes as tokens; thread-safe (it holds no state)."""

    eos_token_ids = frozenset({EOS, IM_END})
    bos_token = "<s>"
    eos_token = "</s>"
    chat_template = TEMPLATE
    vocab_size = VOCAB
    control_texts = frozenset(SPECIALS)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids, rest = [], text
        while rest:
            special = next((s for s in SPECIALS if rest.startswith(s)), None)
            if special is not None:
                ids.append(SPECIALS[special])
                rest = rest[len(special):]
            else:
                ids.extend(rest[0].encode())
                rest = rest[1:]
        return ([BOS] if add_special_tokens else []) + ids

    def encode_plain(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        names = {v: k for k, v in SPECIALS.items()}
        out, raw = [], bytearray()
        for i in ids:
            if i < 256:
                raw.append(i)
                continue
            out.append(raw.decode(errors="replace"))
            raw = bytearray()
            out.append(names[i])
        out.append(raw.decode(errors="replace"))
        return "".join(out)

    def min_tokens(self, text: str) -> int:
        return len(text) // 4


def next_token(history: Sequence[int], seed: int | None = None) -> int:
    """The fake model: a letter or space picked by a hash of the whole history (and a seed)."""
    digest = hashlib.blake2b(np.asarray(history, dtype=np.int32).tobytes() + str(seed).encode(),
                             digest_size=4).digest()
    return LETTERS[int.from_bytes(digest, "little") % len(LETTERS)]


class _Seq:
    def __init__(self, prompt: list[int], params: SamplingParams):
        self.prompt, self.params = prompt, params
        self.state: list[int] | None = None  # the tokens its "KV" holds; None before begin
        self.next: int | None = None  # sampled, not yet fed
        self.resume: list[int] | None = None  # preempted: the prompt it must be readmitted with


class FakeEngine(Engine):
    """A runner over lists. ``kv_tokens``: its KV memory in tokens; ``prefill_step``: chunk size;
    ``step_s``: seconds each step sleeps (a slow model); ``share``: sequences may start from a live
    sequence's or a stored state's prefix; ``headroom``: ``answer_headroom``; ``pipelined``: decode
    tokens come back one step late, as from MLX on a GPU (a newcomer's first token at once)."""

    name = "fake"
    formats = frozenset({"fake"})

    def __init__(self, max_batch: int = 4, kv_tokens: int = 1 << 20, context: int = 4096,
                 prefill_step: int = 16, step_s: float = 0.0, share: bool = True, headroom: int = 0,
                 pipelined: bool = False):
        self._max_batch, self.kv_tokens, self.context = max_batch, kv_tokens, context
        self.prefill_step, self.step_s, self.share = prefill_step, step_s, share
        self.answer_headroom = headroom
        self.pipelined = pipelined
        self.unread: list[tuple[int, Step]] = []  # pipelined: the last step's decode tokens
        self.shares_prefixes = share
        self.seqs: dict[int, _Seq] = {}
        self.stored: list[list[int]] = []  # states left by ended or preempted sequences
        self.computed = 0  # prompt tokens computed (not reused)
        self.steps = 0
        self.plans: list[Plan] = []
        self.fail_next = False  # the next run() fails as a broken model would
        self.closed = threading.Event()
        self._tokenizer = FakeTokenizer()

    @classmethod
    def load(cls, path: Path, options: EngineOptions, progress=None) -> FakeEngine:
        return cls(max_batch=options.max_batch or 4)

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def info(self) -> EngineInfo:
        return EngineInfo(engine=self.name, device="cpu", backend="python", model_format="fake",
                          context_length=self.context, memory_bytes=0, prefill_step=self.prefill_step,
                          details={"max_batch": str(self._max_batch)})

    def held(self, seq: int) -> int:
        state = self.seqs[seq].state
        return 0 if state is None else len(state)

    # -- the runner ------------------------------------------------------------------------------

    def check(self, prompt, params, max_tokens) -> None:
        if not len(prompt):
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= VOCAB:
            raise ValueError(f"prompt token ids must lie in [0, {VOCAB})")
        if len(prompt) + max_tokens > self.context:
            raise EngineError(f"{len(prompt)} + {max_tokens} tokens do not fit a {self.context}-token context")

    def accept(self, seq, prompt, params, max_tokens) -> None:
        self.seqs[seq] = _Seq([int(t) for t in prompt], params)

    def release(self, seq) -> None:
        self.unread = [(q, step) for q, step in self.unread if q != seq]
        s = self.seqs.pop(seq)
        if s.state and self.share:
            self.stored.append(list(s.state))

    def fits(self, claims, new=None) -> bool:
        return sum(claims.values()) + (new[1] if new is not None else 0) <= self.kv_tokens

    def reusable(self, seq) -> int:
        prompt = self.seqs[seq].prompt
        held = [s.state for s in self.seqs.values() if s.state] + self.stored
        return max((min(common_prefix(h, prompt), len(prompt) - 1) for h in held), default=0)

    def begin(self, seq) -> int:
        s = self.seqs[seq]
        reused = self.reusable(seq) if self.share else 0
        s.state = s.prompt[:reused]
        return reused

    def chunk_end(self, start, stop, budget):
        end = min((start // self.prefill_step + 1) * self.prefill_step, stop)
        if budget is not None and end - start > budget:
            end = start + budget
        return end

    def run(self, plan: Plan) -> list[tuple[int, Step]]:
        if self.fail_next:
            self.fail_next = False
            self.seqs.clear()
            raise EngineError("the fake model failed")
        if self.step_s:
            time.sleep(self.step_s)
        self.plans.append(plan)
        self.steps += 1
        decoded, first = [], []
        for seq in plan.decode:
            s = self.seqs[seq]
            s.state.append(s.next)
            decoded.append((seq, self._sample(s)))
        for chunk in plan.chunks:
            s = self.seqs[chunk.seq]
            assert len(s.state) == chunk.start, (len(s.state), chunk)
            s.state.extend(s.prompt[chunk.start:chunk.end])
            self.computed += chunk.end - chunk.start
            if chunk.end == len(s.prompt):
                first.append((chunk.seq, self._sample(s)))
        assert sum(len(s.state or ()) for s in self.seqs.values()) <= self.kv_tokens, "KV overflow"
        if not self.pipelined:
            return decoded + first
        out, self.unread = self.unread + first, decoded
        return out

    def preempt(self, seq) -> list[tuple[int, Step]]:
        s = self.seqs[seq]
        in_flight = [(q, step) for q, step in self.unread if q == seq]
        self.unread = [(q, step) for q, step in self.unread if q != seq]
        if s.state and self.share:
            self.stored.append(list(s.state))
        # what it must read again: all it held and the token it sampled last (or its prompt, unread)
        s.resume = s.state + [s.next] if s.next is not None else list(s.prompt)
        s.state, s.next = None, None
        return in_flight

    def readmit(self, seq, prompt, max_tokens) -> None:
        s = self.seqs[seq]
        assert list(prompt) == s.resume, "the scheduler readmits another prompt than the sequence held"
        s.prompt = list(prompt)

    def score(self, tokens):
        raise EngineError("the fake engine scores nothing")

    def close(self) -> None:
        self.closed.set()

    def _sample(self, s: _Seq) -> Step:
        params = s.params
        token = next_token(s.state, None if params.greedy else params.seed)
        if params.constraint is not None:
            allowed = params.constraint.mask()
            if allowed is not None and not allowed[token]:
                token = int(np.flatnonzero(allowed)[0]) if allowed.any() else EOS
            params.constraint.advance(token)
        s.next = token
        return Step(token, logprob=-0.5 if params.logprobs is not None else None)
