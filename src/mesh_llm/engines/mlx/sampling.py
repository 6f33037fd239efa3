"""Sampling for a batch of sequences in one graph, each row with its own settings and its own PRNG key.

Every row keeps the filters of ``mlx_lm.sample_utils.make_sampler`` (and llama.cpp's default chain):
top-p, min-p and top-k on the untempered distribution, then temperature; a temperature of 0 is
greedy. Here they are vectorised over rows (thresholds from one sort of the batch's log-probabilities,
per-row parameters as arrays), so a step samples 32 rows in a handful of operations rather than 32
graphs. A row's random draw depends on its key alone (``mx.vmap`` over the rows' keys: a row gets
exactly the Gumbel noise it would get in a batch of one), so a seeded sequence samples the same tokens
alone and in any batch.

A row with a :class:`~mesh_llm.engines.base.Constraint` is masked (-inf where its mask is False)
before its filters; its mask is known only once its previous token is on the host, so the engine
samples constrained rows in a second, small graph (:func:`sample`) after that token is read.
Reported log-probabilities are the model's own, before any mask or filter (as vLLM reports them).
"""

from __future__ import annotations

import math
import secrets

import numpy as np

from mesh_llm.system.blas import prepare_mlx

prepare_mlx()  # before mlx and mlx-lm are first imported in the process

import mlx.core as mx

from mesh_llm.engines.base import Constraint, SamplingParams


class SequenceSampler:
    """One sequence's sampling settings, checked when it is added, and its PRNG key (never the
    global seed)."""

    def __init__(self, params: SamplingParams, vocab: int):
        self.check(params)
        self.params = params
        self.constraint: Constraint | None = params.constraint
        self.top_n = min(params.logprobs or 0, vocab)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.key = mx.random.key(seed % 2**64)  # any int, negative or huge, maps to a uint64

    @staticmethod
    def check(params: SamplingParams) -> None:
        """Raise ``ValueError`` for settings no sequence can sample by."""
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 <= params.top_p <= 1:
            raise ValueError("top_p must lie in [0, 1]")
        if params.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= params.min_p <= 1:
            raise ValueError("min_p must lie in [0, 1]")
        if params.logprobs is not None and params.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if params.constraint is not None and not isinstance(params.constraint, Constraint):
            raise ValueError("constraint must have mask() and advance(token)")

    @property
    def greedy(self) -> bool:
        return self.params.greedy


class RowSettings:
    """The sampling settings of a batch's rows as arrays (rebuilt when rows join or leave)."""

    def __init__(self, samplers: list[SequenceSampler], vocab: int):
        self.samplers = samplers
        self.vocab = vocab
        params = [s.params for s in samplers]
        self.greedy = [s.greedy for s in samplers]
        self.sampled = not all(self.greedy)
        self.logprobs = any(p.logprobs is not None for p in params)
        self.top_n = max((s.top_n for s in samplers), default=0)
        self.constrained = [i for i, s in enumerate(samplers) if s.constraint is not None]
        if not self.sampled:
            return
        self.is_greedy = mx.array(self.greedy)
        self.inv_temperature = mx.array([1.0 if p.greedy else 1 / p.temperature for p in params])[:, None]
        top_p = [p.top_p if 0 < p.top_p < 1 else 1.0 for p in params]
        self.top_p = mx.array(top_p)[:, None] if min(top_p) < 1 else None
        self.uses_top_p = mx.array([p < 1 for p in top_p])[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        self.top_k = mx.array(top_k)[:, None] if any(top_k) else None
        self.uses_top_k = mx.array([k > 0 for k in top_k])[:, None]
        min_p = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
        self.log_min_p = mx.array(min_p)[:, None] if max(min_p) > -math.inf else None

    def take(self, rows: list[int]) -> RowSettings:
        return RowSettings([self.samplers[i] for i in rows], self.vocab)


def scores(logits: mx.array, settings: RowSettings) -> mx.array:
    """What the rows sample from: log-probabilities (float32) when any row reports them or filters by
    top-p (a sum of probabilities), else the logits as they are, since a greedy pick, top-k, min-p and a
    Gumbel draw do not move when every value of a row moves by the same amount. That spares a step a
    cast and a normalisation over the whole vocabulary (kernels a GPU would launch for every token)."""
    if settings.logprobs or (settings.sampled and settings.top_p is not None):
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logits.astype(mx.float32) if settings.sampled else logits


def split_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's key split in two, as ``mx.random.split`` does for one key: (next keys, subkeys)."""
    halves = mx.vmap(mx.random.split)(keys)
    return halves[:, 0], halves[:, 1]


def sample(logprobs: mx.array, settings: RowSettings, subkeys: mx.array | None,
           masks: mx.array | None = None) -> mx.array:
    """Tokens (int32, one per row) from (rows, vocab) log-probabilities; ``masks`` (bool, same shape)
    marks the tokens each row may take."""
    if masks is not None:
        logprobs = mx.where(masks, logprobs, -mx.inf)
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if not settings.sampled:
        return greedy
    filtered = _filter(logprobs, settings)
    vocab = logprobs.shape[-1]
    noise = mx.vmap(lambda k: mx.random.gumbel(shape=(vocab,), key=k))(subkeys)
    drawn = mx.argmax(filtered * settings.inv_temperature + noise, axis=-1).astype(mx.int32)
    return mx.where(settings.is_greedy, greedy, drawn) if any(settings.greedy) else drawn


def _filter(logprobs: mx.array, s: RowSettings) -> mx.array:
    """-inf outside each row's top-p, min-p and top-k sets (thresholds on the untempered values)."""
    keep = None
    if s.top_p is not None or s.top_k is not None:
        ascending = mx.sort(logprobs, axis=-1)
        if s.top_p is not None:  # as mlx_lm.sample_utils.apply_top_p, per row
            probs = mx.exp(ascending)
            above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
            total = above[..., :1] + probs[..., :1]
            dropped = (above >= s.top_p * total).sum(axis=-1, keepdims=True)
            threshold = mx.take_along_axis(ascending, dropped, axis=-1)
            keep = (logprobs >= threshold) | ~s.uses_top_p
        if s.top_k is not None:  # the k-th largest value; ties with it are kept
            vocab = logprobs.shape[-1]
            kth = mx.take_along_axis(ascending, mx.clip(vocab - s.top_k, 0, vocab - 1), axis=-1)
            k_keep = (logprobs >= kth) | ~s.uses_top_k
            keep = k_keep if keep is None else keep & k_keep
    if s.log_min_p is not None:
        floor = mx.max(logprobs, axis=-1, keepdims=True) + s.log_min_p
        keep = logprobs >= floor if keep is None else keep & (logprobs >= floor)
    return logprobs if keep is None else mx.where(keep, logprobs, -mx.inf)


def reported(logprobs: mx.array, tokens: mx.array, settings: RowSettings) -> list[mx.array]:
    """The arrays a step reads back besides the tokens: each row's chosen log-probability and the
    batch's top ``top_n`` alternatives (ids and values), when any row asked for logprobs."""
    if not settings.logprobs:
        return []
    out = [mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]]
    if settings.top_n:
        top = mx.argpartition(-logprobs, kth=settings.top_n - 1, axis=-1)[:, : settings.top_n]
        out += [top, mx.take_along_axis(logprobs, top, axis=-1)]
    return out


def mask_array(constraint: Constraint, vocab: int, fallback: np.ndarray) -> np.ndarray:
    """A constraint's mask over the model's ``vocab`` logits (ids past the tokenizer's are never
    allowed); ``fallback`` (the end-of-sequence ids) when it allows nothing, so that the sequence
    ends rather than samples a token it forbids."""
    mask = constraint.mask()
    if mask is None:
        return np.ones(vocab, dtype=bool)
    mask = np.asarray(mask, dtype=bool)[:vocab]
    if len(mask) < vocab:
        mask = np.concatenate([mask, np.zeros(vocab - len(mask), dtype=bool)])
    return mask if mask.any() else fallback
