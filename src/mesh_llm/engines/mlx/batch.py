"""Sequences decoded together: one forward pass a step over a batch of rows, each sampled by its own
settings, and the batch's layer caches kept in step as rows join and leave.

A row joins once its prompt, all but the last token, is in its layer caches (``mlx.py`` reads it).
The first row's caches are used as they are, so a lone sequence decodes exactly as it would
unbatched; more turn them into mlx-lm's batched caches (``merge``: KVCache -> BatchKVCache,
RotatingKVCache -> BatchRotatingKVCache; ArraysCache and CacheList batch themselves), and later ones
are appended (``extend``). Rows whose prompts were read in one forward pass join from that pass's
batch as it is (:func:`batch_rows`). Rows of different lengths are right-aligned: a short row is
left-padded to the longest and the padding masked, so the batch's KV takes rows x the longest row.
A row that leaves is cut out (:func:`_cut`: mlx-lm's ``extract`` and ``filter``), its own caches
given back for the prompt cache. A join or a leave copies the batch's KV once. With ``keep_slots``
(on a GPU) a row that leaves a batch of plain KV caches leaves its slot instead, stepped with the
others and read by nobody, until a newcomer fills it in place, half the slots are empty or it has
waited ``VACANT_STEPS`` steps: the batch keeps its size, so MLX's CUDA graphs built for it serve on
(a size not stepped before cost 15-50 ms of graph builds on the H200), and no leave copies it.

A step is :meth:`DecodeGroup.launch` (the forward pass and the sampling of unconstrained rows, queued),
:meth:`DecodeGroup.finish` (constrained rows, once their previous token is known) and
:meth:`DecodeGroup.read` (tokens to the host). On a GPU the engine reads step n after queuing step
n+1, so the device never waits for Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mesh_llm.system.blas import prepare_mlx

prepare_mlx()  # before mlx and mlx-lm are first imported in the process

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mesh_llm.engines.base import SamplingParams, Step
from mesh_llm.engines.mlx.sampling import (
    RowSettings,
    SequenceSampler,
    mask_array,
    reported,
    sample,
    scores,
    split_keys,
)


class Row:
    """What a group needs of a sequence (the engine's sequences subclass it)."""

    sampler: SequenceSampler
    tokens: list[int]  # prompt, then each sampled token once read
    fed: int  # tokens whose state the group's caches hold (a queued step included)
    reused: int  # prompt tokens resumed from a stored state, reported on the first step
    first: bool  # no step reported yet
    alive: bool  # still held by the engine


# Steps a vacant slot waits for a newcomer before every vacant slot is cut out: each is stepped with
# the others, which costs a GPU little a step but adds up, where a cut costs once.
VACANT_STEPS = 64


class _Vacant(Row):
    """A slot a row left, kept in the batch: decoded greedily with the others, read by nobody."""

    def __init__(self, vocab: int, since: int):
        self.sampler = SequenceSampler(SamplingParams(temperature=0.0, seed=0), vocab)
        self.tokens, self.fed, self.reused, self.first, self.alive = [], 0, 0, False, False
        self.since = since  # the group's step count when the row left


@dataclass
class Launch:
    """One queued forward pass of a group: its rows then, and what it sampled."""

    rows: list[Row]
    settings: RowSettings
    scores: mx.array  # log-probabilities, or logits where no row needs them (sampling.scores)
    tokens: mx.array  # unconstrained rows' tokens until finish() adds the constrained ones
    subkeys: mx.array | None
    outputs: list[mx.array] = field(default_factory=list)  # set by finish()


class DecodeGroup:
    """Rows decoded in one forward pass: their layer caches, next inputs and PRNG keys."""

    def __init__(self, model, vocab: int, eos: np.ndarray, pipelined: bool, keep_slots: bool = False):
        self._model, self._vocab, self._eos, self._pipelined = model, vocab, eos, pipelined
        self._keep_slots = keep_slots
        self._steps = 0
        self.rows: list[Row] = []  # a slot each, vacant ones included
        self.unread: Launch | None = None  # queued on a GPU, read at the next step
        self._caches: list[Any] | None = None
        self._batched = False  # the caches are mlx-lm's batch caches (else one row's own)
        self._inputs: mx.array | None = None  # int32, each row's next token
        self._keys: mx.array | None = None  # uint32 (rows, 2)
        self._settings: RowSettings | None = None

    def __len__(self) -> int:
        """The rows held (vacant slots not counted)."""
        return len(self.rows) - self.vacancies

    @property
    def vacancies(self) -> int:
        return len(self._vacant())

    def _vacant(self) -> list[int]:
        return [j for j, r in enumerate(self.rows) if isinstance(r, _Vacant)]

    def join(self, rows: list[Row], caches: list[list[Any]], firsts: list[int]) -> None:
        """Add rows whose own layer caches (``caches``, one list a row) hold their tokens but the
        last, which each feeds next (``firsts``): into vacant slots where they fit, the others in
        one merge a layer (a join copies the batch's KV and runs a few small ops a layer, so rows
        that arrive together join in one go)."""
        if self.vacancies:
            rows, caches, firsts = self._fill(rows, caches, firsts)
            if not rows:
                return
        if not self.rows and len(rows) == 1:
            self._caches, self._batched = caches[0], False
        elif not self._batched:
            self._caches, self._batched = merged([self._caches, *caches] if self.rows else caches), True
        else:
            for a, new in zip(self._caches, merged(caches)):
                a.extend(new)
        self._add(rows, firsts)

    def join_batch(self, rows: list[Row], caches: list[Any], firsts: list[int]) -> None:
        """Add rows whose layer caches are one batch already, in their order (:func:`batch_rows`)."""
        if not self.rows:
            self._caches = caches
        else:
            if not self._batched:
                self._caches = merged([self._caches])
            for a, new in zip(self._caches, caches):
                a.extend(new)
        self._batched = True
        self._add(rows, firsts)

    def _add(self, rows: list[Row], firsts: list[int]) -> None:
        tokens = mx.array(firsts, dtype=mx.int32)
        keys = mx.stack([row.sampler.key for row in rows])
        self._inputs = tokens if self._inputs is None else mx.concatenate([self._inputs, tokens])
        self._keys = keys if self._keys is None else mx.concatenate([self._keys, keys])
        self.rows += rows
        self._settings = None

    def leave(self, row: Row, vacate: bool = True) -> list[Any]:
        """Remove a row; returns its own layer caches (holding its first ``row.fed`` tokens), and
        its sampler keeps its PRNG key as it stands (a preempted row joins again where it left off).
        With ``keep_slots`` and ``vacate`` its slot stays while more than half the slots hold rows
        and no vacant row is longer than every row held (the batch never grows for a row nobody
        reads); else the row and every vacant slot are cut out."""
        i = self.rows.index(row)
        keep = [j for j, r in enumerate(self.rows) if j != i and not isinstance(r, _Vacant)]
        self._settings = None
        row.sampler.key = self._keys[i]
        if vacate and self._slots_kept():
            pads = _left_padding(self._caches)
            vacant = [i, *self._vacant()]
            if 2 * len(keep) > len(self.rows) and min(pads[j] for j in vacant) >= min(pads[j] for j in keep):
                self.rows[i] = _Vacant(self._vocab, self._steps)
                return kv_copies([_row_kv(c, i, pads[i]) for c in self._caches], wait=not self._pipelined)
        index = mx.array(keep) if keep else None
        if not self._batched:
            own, self._caches = self._caches, None
        else:
            own = _cut(self._caches, i, keep, index)
        if keep:
            self._retain(keep, index)
        else:
            self.rows, self._caches, self._batched, self._inputs, self._keys = [], None, False, None, None
        return own

    def compact(self) -> None:
        """Cut out every vacant slot (no newcomer took the oldest for ``VACANT_STEPS`` steps, or the
        memory is short)."""
        if not self.vacancies:
            return
        keep = [j for j, r in enumerate(self.rows) if not isinstance(r, _Vacant)]
        index, pads = mx.array(keep), _left_padding(self._caches)
        for c in self._caches:
            _keep_rows(c, pads, keep, index)
        self._retain(keep, index)

    def _retain(self, keep: list[int], index: mx.array) -> None:
        """The rows ``keep`` (``index``), with their inputs and keys, once the caches hold only them."""
        self.rows = [self.rows[j] for j in keep]
        self._inputs, self._keys, self._settings = self._inputs[index], self._keys[index], None

    def _slots_kept(self) -> bool:
        return (self._keep_slots and self._batched and
                all(type(c) is BatchKVCache and c.keys is not None for c in self._caches))

    def _fill(self, rows: list[Row], caches: list[list[Any]], firsts: list[int]):
        """Put rows into vacant slots, in place, where their own plain KV caches fit the batch's
        length: each row right-aligned as a merge would put it. Returns the rows left over, with
        their caches and first tokens."""
        if not self._slots_kept():
            return rows, caches, firsts
        size, pads = self._caches[0].size(), _left_padding(self._caches)
        slots = self._vacant()
        placed, left = [], ([], [], [])
        for row, own, first in zip(rows, caches, firsts):
            n = own[0].offset
            if slots and all(type(c) is KVCache for c in own) and 0 < n <= size:
                j = slots.pop(0)
                for c, mine in zip(self._caches, own):
                    c.keys[j:j + 1, :, size - n:size] = mine.keys[..., :n, :]
                    c.values[j:j + 1, :, size - n:size] = mine.values[..., :n, :]
                self.rows[j], pads[j] = row, size - n
                placed.append((j, first, row.sampler.key))
            else:
                for part, value in zip(left, (row, own, first)):
                    part.append(value)
        if placed:
            for c in self._caches:  # every plain layer holds the same padding (see _left_padding)
                c.left_padding, c.offset = mx.array(pads), mx.array([size - p for p in pads])
            where = [j for j, _, _ in placed]
            self._inputs = _put(self._inputs, where, mx.array([f for _, f, _ in placed], dtype=mx.int32))
            self._keys = _put(self._keys, where, mx.stack([k for _, _, k in placed]))
            self._settings = None
        return left

    def prefix(self, row: Row, n: int) -> list[KVCache]:
        """A copy of the KV of a row's first ``n`` tokens (models whose layers are all plain KV)."""
        i = self.rows.index(row)
        start = _left_padding(self._caches)[i] if self._batched else 0  # the same in every layer
        rows = slice(i, i + 1) if self._batched else slice(None)
        return kv_copies([(c.keys[rows, :, start:start + n], c.values[rows, :, start:start + n])
                          for c in self._caches])

    def launch(self) -> Launch:
        """Queue one forward pass over every row, and the sampling of unconstrained rows."""
        self._steps += 1
        if any(isinstance(r, _Vacant) and self._steps - r.since > VACANT_STEPS for r in self.rows):
            self.compact()
        if self._settings is None:
            self._settings = RowSettings([r.sampler for r in self.rows], self._vocab)
        settings = self._settings
        logits = self._model(self._inputs[:, None], cache=self._caches)[:, -1, :]
        values = scores(logits, settings)
        subkeys = None
        if settings.sampled:
            self._keys, subkeys = split_keys(self._keys)
        tokens = sample(values, settings, subkeys)
        for r in self.rows:
            r.fed += 1
        launch = Launch(list(self.rows), settings, values, tokens, subkeys)
        if not settings.constrained:
            self.finish(launch)
        elif self._pipelined:
            mx.async_eval(values, tokens)
        return launch

    def finish(self, launch: Launch) -> None:
        """Sample the constrained rows (their constraints must have seen every earlier token) and
        queue what the step reads back."""
        s, tokens = launch.settings, launch.tokens
        if s.constrained:
            chosen = mx.array(s.constrained)
            masks = mx.array(np.stack([mask_array(launch.rows[i].sampler.constraint, self._vocab,
                                                  self._eos) for i in s.constrained]))
            subkeys = launch.subkeys[chosen] if launch.subkeys is not None else None
            picked = sample(launch.scores[chosen], s.take(s.constrained), subkeys, masks)
            where = np.zeros(len(launch.rows), dtype=np.int32)
            where[s.constrained] = np.arange(len(s.constrained))
            constrained = np.zeros(len(launch.rows), dtype=bool)
            constrained[s.constrained] = True
            tokens = mx.where(mx.array(constrained), picked[mx.array(where)], tokens)
        launch.tokens = tokens
        launch.outputs = [tokens, *reported(launch.scores, tokens, s)]
        self._inputs = tokens
        if self._pipelined:
            mx.async_eval(launch.outputs)
        else:
            mx.eval(launch.outputs)

    def read(self, launch: Launch) -> list[tuple[Row, Step]]:
        """The step's tokens on the host, for the rows still held. Only whole arrays are read
        (``tolist``): indexing one would queue an op behind the next step and wait for it."""
        values = [a.tolist() for a in launch.outputs]
        out = []
        for i, row in enumerate(launch.rows):
            if not row.alive:
                continue
            token = values[0][i]
            row.tokens.append(token)
            if row.sampler.constraint is not None:
                row.sampler.constraint.advance(token)
            cached, row.first = (row.reused if row.first else 0), False
            params = row.sampler.params
            if params.logprobs is None:
                out.append((row, Step(token=token, cached_tokens=cached)))
                continue
            top = ()
            if row.sampler.top_n:
                pairs = sorted(zip(values[2][i], values[3][i]), key=lambda p: -p[1])
                top = tuple(pairs[: row.sampler.top_n])
            out.append((row, Step(token=token, logprob=values[1][i], top_logprobs=top,
                                  cached_tokens=cached)))
        return out


def merged(caches: list[list[Any]]) -> list[Any]:
    """Rows' own layer caches as one batch cache a layer, rows right-aligned (mlx-lm's ``merge``:
    every row copied into a new buffer)."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def batch_rows(caches: list[KVCache], rows: list[int], ends: list[int]) -> list[BatchKVCache]:
    """Rows ``rows`` of a batch's plain KV caches (one forward pass read them together), the first
    ``ends[i]`` positions of each, as batch caches right-aligned as :func:`merged` makes them: the
    batch's own buffers where the rows are all of it, in order, and end together, else one gather
    and one roll a layer, where merging the rows' copies back costs two ops a row."""
    n, longest = len(rows), max(ends)
    index = row_index(rows, caches[0].keys.shape[0])
    out = []
    for c in caches:
        keys, values = first_positions(c, index, longest)
        b = BatchKVCache([0] * n)
        b.state = keys, values, mx.array([longest] * n), mx.array([0] * n), longest
        b.prepare(right_padding=[longest - end for end in ends])  # rolled right by finalize
        b.finalize()
        out.append(b)
    return out


def row_index(rows: list[int], size: int) -> mx.array | None:
    """What takes rows ``rows`` out of a batch of ``size``: None where they are all of it, in order."""
    return None if rows == list(range(size)) else mx.array(rows)


def first_positions(c: KVCache, index: mx.array | None, n: int) -> tuple[mx.array, mx.array]:
    """The keys and values of a batch's plain KV cache at its first ``n`` positions, in the rows
    ``index`` takes (:func:`row_index`; None: all)."""
    keys, values = c.keys[..., :n, :], c.values[..., :n, :]
    return (keys, values) if index is None else (keys[index], values[index])


def kv_copies(parts: list[tuple[mx.array, mx.array]], wait: bool = True) -> list[KVCache]:
    """Plain KV caches owning copies of each layer's ``(keys, values)``, evaluated now (in one go;
    ``wait=False``: queued) so that they keep no reference to the buffers they were cut from, which
    their owner then updates in place."""
    caches = []
    for keys, values in parts:
        cache = KVCache()
        cache.keys, cache.values, cache.offset = mx.contiguous(keys), mx.contiguous(values), keys.shape[2]
        caches.append(cache)
    (mx.eval if wait else mx.async_eval)([a for c in caches for a in (c.keys, c.values)])
    return caches


def _left_padding(caches: list[Any]) -> list[int]:
    """The rows' left padding, read from the device once: every plain KV layer of a batch holds the
    same (mlx-lm's ``extract`` and ``filter`` read it in each layer, a wait for the device each)."""
    return next(c.left_padding.tolist() for c in caches if type(c) is BatchKVCache)


def _row_kv(c: BatchKVCache, row: int, pad: int) -> tuple[mx.array, mx.array]:
    """One row's keys and values in a batch cache, its left padding ``pad`` left out."""
    size = c.size()
    return c.keys[row:row + 1, :, pad:size], c.values[row:row + 1, :, pad:size]


def _put(a: mx.array, rows: list[int], values: mx.array) -> mx.array:
    """``a`` with its rows ``rows`` replaced by ``values``, as a new array: ``a`` may be a queued
    step's output, which setting its items would change under the step's reader."""
    taken, index = np.zeros(a.shape[0], dtype=bool), np.zeros(a.shape[0], dtype=np.int32)
    taken[rows], index[rows] = True, np.arange(len(rows))
    mask = mx.array(taken).reshape(-1, *[1] * (a.ndim - 1))
    return mx.where(mask, values[mx.array(index)], a)


def _cut(caches: list[Any], row: int, keep: list[int], index: mx.array | None) -> list[Any]:
    """Row ``row``'s own layer caches out of a batch's, the batch's left holding the rows ``keep``
    (``index``: the same as an array):
    mlx-lm's ``extract`` and ``filter``, with the padding read once for the plain KV layers (on the
    H200 a leave took 12-17 ms of 24 layers' waits, every other stream standing still)."""
    plain = [type(c) is BatchKVCache and c.keys is not None for c in caches]
    pads = _left_padding(caches) if any(plain) else []
    own = []
    for c, fast in zip(caches, plain):
        if not fast:
            own.append(c.extract(row))
            if keep:
                c.filter(keep)
            continue
        keys, values = _row_kv(c, row, pads[row])
        out = KVCache()
        out.keys, out.values, out.offset = mx.contiguous(keys), mx.contiguous(values), keys.shape[2]
        own.append(out)
        if keep:
            _keep_rows(c, pads, keep, index)
    return own


def _keep_rows(c: BatchKVCache, pads: list[int], keep: list[int], index: mx.array) -> None:
    """Keep rows ``keep`` (``index``) of a plain batch cache whose rows' left padding is ``pads``,
    less the padding they all have."""
    shift, size = min(pads[k] for k in keep), c.size()
    c.state = (c.keys[index][..., shift:, :], c.values[index][..., shift:, :], c.offset[index],
               c.left_padding[index] - shift, size - shift)
