"""A worker's micro-batches from its streams of tokenised tables (one per source of the stage), without Ray.

Smart batching in a bounded window: a worker gathers ``window_batches`` batches' worth of rows, sorts them by
length (ties in a seeded random order), cuts them into batches and shuffles the batches with a generator seeded
alike on every rank, so that step k's batches on all workers hold rows of similar length rank (no worker idles
at the all-reduce behind a long batch). Only a window's rows are in memory, whatever the data's size.

Every worker yields exactly the same number of micro-batches per pass over a source, whatever its shard holds:
``units_per_pass`` is fixed beforehand from the source's row count; a shard that gives more leaves the surplus
unseen (counted), one that gives fewer repeats its pass's first batches (counted). So no DDP worker ever waits
for a step another worker does not take.

With ``no_duplicates`` (in-batch-negative objectives) a row any of whose texts is already in the batch being
cut waits for a later batch (counted), so no text is its own negative inside a worker's batch.

Several sources: each micro-batch is drawn from one source (in-batch negatives stay within one dataset), in an
order seeded per epoch and equal on every rank: ``proportional`` draws each source ``weight`` x its batches per
epoch, ``round_robin`` takes one batch of each in turn until the smallest is used up. Each source streams pass
after pass on its own, each pass opened with its key (stage seed, source index, pass number), which seeds the order
its files and row groups are read in (``sources.pass_reads``) and its windows' shuffles; where the stage stands in
each is a function of (epoch, position), so a resumed worker goes on with the very batches the interrupted run
would have taken: a raw source's stream regenerated up to there, in the same order; a prepared source's read from
the window the position lies in (``share_batches``: each rank reads its own share of a pass from the shards, its
rows a function of the pass key, the world sizes and its rank alone, and every whole window gives exactly
``window_batches`` batches, carrying nothing over, so a position names its window without reading any before it).

Elastic runs: the order above is planned in global micro-batches (``batch_size / grad_accum_steps`` examples of
all workers together; each worker's batch is its share of one, ``training.batches.BatchSplit``) at the configured,
largest world size, so the schedule, the batches per pass and the steps per epoch are the same at any live world
size, and a position saved at one size is a position at another: each source goes on in the same pass, every
worker as far into its new share as the run had come into its old one. What the resize cannot carry over is where
each worker stood inside its window (its batches are shuffled): rows of the windows it cut (``window_batches``
global micro-batches' worth, at each size) may be trained twice or not in that pass. Where the global micro-batch
does not divide by the live world size the first ranks take one example more of each than the others: a prepared
source deals each window by those shares (``BatchPlan.share_windows``), so every row of a pass is still taken once
but the fewer-than-``planned_workers`` rows its planned equal shares leave (counted unseen); a raw source's shards
hold equal rows (Ray Data's ``streaming_split``), so per pass the first ranks repeat about as many rows as the
others leave unseen (``repeated`` / ``unseen`` below), at most one row per global micro-batch and rank.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from sbert_ray.config import StageConfig, TrainConfig
from sbert_ray.losses.registry import OBJECTIVES
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.batches import TokenizedRows, split_batch, tokenize_table, tokenize_texts
from sbert_ray.training.loop import MicroBatch
from sbert_ray.training.prepared_reads import PreparedPasses, RowGroup
from sbert_ray.training.sources import (
    Source,
    TextColumns,
    check_prepared,
    pass_reads,
    read_registered,
    read_tables,
    stage_sources,
)

if TYPE_CHECKING:
    import pyarrow as pa

Batch = tuple[TokenizedRows, np.ndarray]  # the rows of its window, and which of them


@dataclasses.dataclass(frozen=True)
class SourceStream:
    """One source as a worker streams it."""

    name: str
    rows: int  # examples in one pass over the source, all workers together (counted before training)
    weight: float
    # This worker's tokenised tables of a new pass, given the pass's key (stage seed, source index, pass number),
    # which seeds the order its files are read in (``sources.pass_reads``): Arrow tables as Ray Data's stream
    # carries them (``batches.tokenize_table``), or rows read and tokenised in this process. None: prepared.
    open_pass: Callable[[tuple[int, int, int]], Iterable[pa.Table | TokenizedRows]] | None
    # A prepared source: this worker reads its share of each pass straight from the shards (``share_batches``).
    prepared: PreparedPasses | None = None


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How a worker cuts its streams into batches (the same on every rank but ``rank`` and its share).

    The data order is planned in global micro-batches (``training.batches.BatchSplit``) at the configured world
    size ``planned_workers``, so it is the same at any live ``world_size``: each global micro-batch is one batch of
    this worker's share, ``batch_size``, which it trains as ``chunks`` micro-batches (``np.array_split``'s)."""

    batch_size: int  # this worker's examples of a global micro-batch: the batches cut from its stream
    world_size: int
    rank: int
    seed: int
    window_batches: int = 200  # batches of this worker sorted by length together
    no_duplicates: bool = False
    sampling: str = "proportional"
    chunks: int = 1  # micro-batches per global micro-batch on each worker (the same on every rank)
    unit: int = 0  # examples of a global micro-batch, all workers together; 0: batch_size * world_size
    planned_workers: int = 0  # the world size the batch size is configured at (the most workers); 0: world_size
    largest_micro_batch: int = 0  # the most rows of any worker's micro-batch (``BatchSplit``'s); 0: not planned
    share_start: int = 0  # the examples of a global micro-batch the ranks before this one take

    def pass_rows(self, rows: int) -> int:
        """The rows of a pass over a source of ``rows`` examples that the planned workers' equal shares hold
        (Ray Data's streaming_split, and ``share_windows``, hand each of them ``rows // workers``)."""
        planned = self.planned_workers or self.world_size
        return rows // planned * planned

    def units_per_pass(self, rows: int) -> int:
        """Global micro-batches per pass over a source of ``rows`` examples, as planned: ``pass_rows`` cut into
        global micro-batches, the last possibly short. The same at every live world size."""
        return math.ceil(self.pass_rows(rows) / self._unit())

    def share_windows(self, rows: int) -> list[tuple[int, int]]:
        """This rank's share of a pass over a prepared source of ``rows`` examples, window by window: the
        stretches (start, stop) of the pass's sequence of rows (``training.prepared_reads``) it cuts its batches
        from. The pass is cut into windows of ``window_batches`` global micro-batches' rows; each rank takes its
        share's part of each, side by side (``window_batches`` times its batch), and of the last, short one as
        much as its share of the rows left. So window w is the same rows at any world size, and position p (in
        global micro-batches) lies in window p // window_batches on every rank."""
        used, unit, start = self.pass_rows(rows), self._unit(), self.share_start
        span = self.window_batches * unit
        parts = [(w * span, min(span, used - w * span)) for w in range(math.ceil(used / span))]
        return [(at + n * start // unit, at + n * (start + self.batch_size) // unit) for at, n in parts]

    def _unit(self) -> int:
        return self.unit or self.batch_size * self.world_size


def epoch_schedule(per_pass: list[int], weights: list[float], plan: BatchPlan, epoch: int) -> np.ndarray:
    """The source each global micro-batch of ``epoch`` comes from (equal on every rank and at every world size),
    for sources of ``per_pass`` global micro-batches per pass."""
    if len(per_pass) == 1:
        return np.zeros(per_pass[0], dtype=np.int64)
    if plan.sampling == "round_robin":
        return np.tile(np.arange(len(per_pass)), min(per_pass))
    draws = [max(1, round(weight * n)) for weight, n in zip(weights, per_pass, strict=True)]
    return np.random.default_rng([plan.seed, epoch]).permutation(np.repeat(np.arange(len(per_pass)), draws))


def stage_steps(rows: list[int], weights: list[float], stage: StageConfig, plan: BatchPlan) -> tuple[int, int]:
    """(optimizer steps per epoch, optimizer steps the stage runs) for sources of ``rows`` examples: what the
    workers train, and what a run checks and reports beforehand; the same at every world size."""
    per_pass = [plan.units_per_pass(n) for n in rows]
    per_epoch = len(epoch_schedule(per_pass, weights, plan, 0)) // stage.grad_accum_steps
    total = stage.epochs * per_epoch
    return per_epoch, min(total, stage.max_steps) if stage.max_steps else total


def batch_plan(
    stage: StageConfig, stage_index: int, seed: int, world_size: int, rank: int, max_workers: int | None = None
) -> BatchPlan:
    """The stage's plan on rank ``rank`` of ``world_size`` live workers, for a batch size configured at
    ``max_workers`` (None: ``world_size``): duplicates kept out of batches by default for in-batch negatives."""
    in_batch_negatives = OBJECTIVES[stage.objective].in_batch_negatives
    no_duplicates = in_batch_negatives if stage.no_duplicates is None else stage.no_duplicates
    split = split_batch(stage, max_workers or world_size, world_size, in_batch_negatives)
    return BatchPlan(
        batch_size=split.shares[rank],
        world_size=world_size,
        rank=rank,
        seed=seed + stage_index,
        window_batches=stage.window_batches,  # global micro-batches: the same rows per window at every world size
        no_duplicates=no_duplicates,
        sampling=stage.sampling,
        chunks=split.chunks,
        unit=stage.batch_size // stage.grad_accum_steps,
        planned_workers=max_workers or world_size,
        largest_micro_batch=split.largest_micro_batch,
        share_start=sum(split.shares[:rank]),
    )


@dataclasses.dataclass
class SourceCounts:
    """What one source's stream did on this worker: logged as ``data/<source>/<name>``."""

    samples: int = 0  # examples trained on
    deferred_duplicates: int = 0  # rows moved to a later batch because a text of theirs was in the batch
    unseen: int = 0  # rows of a pass beyond its units_per_pass batches (a shard larger than its share)
    read: int = 0  # rows read from a prepared source's shards (whole row groups: ``prepared_reads``)
    repeated: int = 0  # examples of batches repeated to fill a short pass
    truncated_texts: int = 0  # texts cut to max_seq_length


class StageBatches:
    """This worker's micro-batches of one stage from (``epoch``, ``position``) on, epoch after epoch, collated
    on ``device`` as they are taken; ``metrics()`` tells what the streams did so far. ``position`` counts global
    micro-batches (``BatchPlan``), so a checkpoint taken at one world size resumes at another: each source
    continues in the same pass, as far into this worker's share of it as the run had come into its own."""

    def __init__(
        self,
        sources: list[SourceStream],
        plan: BatchPlan,
        units_per_epoch: int,
        epoch: int,
        position: int,
        collate: Callable[[Batch], tuple[list[dict], torch.Tensor | None, list[torch.Tensor], list[np.ndarray]]],
    ):
        self.sources, self.plan, self.collate = sources, plan, collate
        self.per_epoch, self.epoch, self.position = units_per_epoch, epoch, position
        self.counts = [SourceCounts() for _ in sources]
        self.per_pass = [plan.units_per_pass(s.rows) for s in sources]
        self.weights = [s.weight for s in sources]
        taken = np.zeros(len(sources), dtype=np.int64)  # each source's global micro-batches before the position
        for past in range(epoch + 1):
            drawn = self._schedule(past)[: position if past == epoch else None]
            taken += np.bincount(drawn, minlength=len(sources))
        self.streams = [self._source_batches(j, int(n)) for j, n in enumerate(taken)]

    def __iter__(self) -> Iterator[MicroBatch]:
        epoch, start = self.epoch, self.position
        while True:
            schedule = self._schedule(epoch)
            for position in range(start, len(schedule)):
                rows, index = next(self.streams[schedule[position]])
                self.counts[schedule[position]].samples += len(index)
                # A short batch (a pass's last) with fewer rows than micro-batches leaves some empty: each trains
                # on the batch's first row at weight 0 (size 0, ``training.loop``), so that every rank takes the
                # same micro-batches per step, as DDP's synchronised steps need.
                for part in np.array_split(index, self.plan.chunks):
                    features, labels, hashes, used_widths = self.collate((rows, part if len(part) else index[:1]))
                    yield MicroBatch(features, labels, len(part), epoch, position + 1, hashes, used_widths)
            epoch, start = epoch + 1, 0

    def _schedule(self, epoch: int) -> np.ndarray:
        """The epoch's sources, cut to whole optimizer steps (``units_per_epoch``)."""
        return epoch_schedule(self.per_pass, self.weights, self.plan, epoch)[: self.per_epoch]

    def metrics(self) -> dict[str, float]:
        return {
            f"data/{source.name}/{name}": value
            for source, counts in zip(self.sources, self.counts, strict=True)
            for name, value in dataclasses.asdict(counts).items()
        }

    def _source_batches(self, index: int, taken: int) -> Iterator[Batch]:
        """Source ``index``'s micro-batches pass after pass, from its ``taken``-th on: a resume continues where the
        interrupted run was (at another world size, where its shares of the pass stood, to within a window of rows
        per worker). A prepared source's are read from the window that batch lies in; a raw source's pass is
        regenerated from its start and the batches before passed over."""
        source, counts = self.sources[index], self.counts[index]
        per_pass = self.per_pass[index]
        number, skip = divmod(taken, per_pass)
        while True:
            key = (self.plan.seed, index, number)
            if source.prepared is not None:
                yield from share_batches(source.prepared, per_pass, self.plan, key, skip, counts)
            else:
                batches = pass_batches(source.open_pass(key), per_pass, self.plan, key, counts)
                yield from itertools.islice(batches, skip, None)
            number, skip = number + 1, 0


def pass_batches(
    tables: Iterable[pa.Table | TokenizedRows],
    per_pass: int,
    plan: BatchPlan,
    key: tuple[int, ...],
    counts: SourceCounts,
) -> Iterator[Batch]:
    """Exactly ``per_pass`` batches of one pass over this worker's ``tables``: surplus batches are still read to
    the end of the stream (every worker finishes the pass together) and counted unseen; a short pass repeats its
    first batches."""
    first: list[Batch] = []  # the pass's first batches (at most a window's), to repeat if it comes up short
    made = 0
    for batch in _cut_pass(tables, plan, key, counts):
        if made == per_pass:
            counts.unseen += len(batch[1])
            continue
        if len(first) < plan.window_batches:
            first.append(batch)
        made += 1
        yield batch
    if made < per_pass and not first:
        raise ValueError(f"this worker's share of a pass held no example (source {key[1]}, pass {key[2]})")
    for repeat in range(per_pass - made):
        batch = first[repeat % len(first)]
        counts.repeated += len(batch[1])
        yield batch


def share_batches(
    prepared: PreparedPasses, per_pass: int, plan: BatchPlan, key: tuple[int, int, int], skip: int, counts: SourceCounts
) -> Iterator[Batch]:
    """This rank's batches of one pass over a prepared source from its ``skip``-th on (``per_pass - skip`` of
    them), read window by window (``BatchPlan.share_windows``) straight from the shards, each window's rows read
    while the one before is trained (``_read_ahead``): only the window batch ``skip`` lies in and those after it
    are read. Every whole window gives exactly ``window_batches`` batches (``cut_whole_window``), so that window is
    known without reading any before it; the last one is cut as a raw pass's end. As ``pass_batches``: batches
    beyond ``per_pass`` are counted unseen, a short share repeats its first window's batches, and the rows no
    planned worker's equal share holds are counted unseen (on the last rank, as the pass opens)."""
    groups, windows = prepared.row_groups(key), plan.share_windows(prepared.rows)
    if plan.rank == plan.world_size - 1:
        counts.unseen += prepared.rows - plan.pass_rows(prepared.rows)
    first = min(skip // plan.window_batches, max(len(windows) - 1, 0))
    made = first * plan.window_batches
    for number, (table, read) in enumerate(_read_ahead(prepared, groups, windows[first:]), start=first):
        counts.read += read
        for batch in _window_batches(table, number, plan, key, counts):
            if made >= per_pass:
                counts.unseen += len(batch[1])
            elif made >= skip:
                yield batch
            made += 1
    if made < per_pass:  # the pass's first batches again, to fill it (read again: a resume may not have cut them)
        (table, read), scratch = _read(prepared, groups, windows[0]), SourceCounts()
        again = list(itertools.islice(_window_batches(table, 0, plan, key, scratch), plan.window_batches))
        counts.read += read
        if not again:
            raise ValueError(f"this worker's share of a pass held no example (source {key[1]}, pass {key[2]})")
        for position in range(made, per_pass):
            batch = again[(position - made) % len(again)]
            if position >= skip:
                counts.repeated += len(batch[1])
                yield batch


def _read_ahead(
    prepared: PreparedPasses, groups: list[RowGroup], windows: list[tuple[int, int]]
) -> Iterator[tuple[pa.Table | None, int]]:
    """``_read`` of each window in order, the next one read in a thread while the caller trains on this one: pyarrow
    reads, and waits on object storage, with the GIL released, so training waits for the first window only."""
    if not windows:
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
        ahead = pool.submit(_read, prepared, groups, windows[0])
        for following in [*windows[1:], None]:
            current = ahead.result()
            ahead = pool.submit(_read, prepared, groups, following) if following else None
            yield current


def _read(prepared: PreparedPasses, groups: list[RowGroup], window: tuple[int, int]) -> tuple[pa.Table | None, int]:
    """A window's rows (None for an empty one: a share of the last window too small to hold a row of this rank) and
    the rows read for them."""
    start, stop = window
    return prepared.read(groups, start, stop) if start < stop else (None, 0)


def _window_batches(
    table: pa.Table | None, number: int, plan: BatchPlan, key: tuple[int, int, int], counts: SourceCounts
) -> Iterator[Batch]:
    """The batches of this rank's window ``number`` of the pass (its rows ``table``): a whole window's
    ``window_batches``, or the last, shorter window's as a raw pass ends (whole batches, then the rest, short ones
    too)."""
    if table is None:
        return
    if table.num_rows < plan.window_batches * plan.batch_size:
        yield from _cut_pass([table], plan, key, counts, first=number)
        return
    rows = TokenizedRows.from_arrow(table)
    counts.truncated_texts += int(rows.truncated.sum())
    yield from ((rows, batch) for batch in cut_whole_window(rows, plan, (*key, number), counts))


def cut_whole_window(rows: TokenizedRows, plan: BatchPlan, key: tuple[int, ...], counts: SourceCounts):
    """Exactly ``window_batches`` batches of a window of as many batches' rows, with nothing carried over to the
    next window (so a window's batches depend on its rows alone). With ``no_duplicates`` the rows that waited are
    tried again in further batches; rows that still make no whole duplicate-free batch (rare: the last rows left
    share texts among themselves) fill the batches that are missing as far as they go without a duplicate, and any row
    that fits none is counted unseen."""
    batches, waiting = _fill(_by_length(rows, plan, key), rows, plan, counts, keep_short=False)
    while len(waiting):
        more, left = _fill(waiting, rows, plan, counts, keep_short=False)
        if not more:
            break
        batches, waiting = batches + more, left
    return _shuffled(batches + _spread(waiting, rows, plan.window_batches - len(batches), plan, counts), key)


def _spread(waiting: np.ndarray, rows: TokenizedRows, missing: int, plan: BatchPlan, counts: SourceCounts):
    """``missing`` batches of the ``waiting`` rows, each row in the first with room and none of its texts, short
    where they run out; a row that fits none is counted unseen."""
    batches: list[list[int]] = [[] for _ in range(missing)]
    texts_in: list[set[int]] = [set() for _ in range(missing)]
    for i in waiting:
        texts = {int(h[i]) for h in rows.hashes}
        fits = (b for b in range(missing) if len(batches[b]) < plan.batch_size and texts.isdisjoint(texts_in[b]))
        target = next(fits, None)
        if target is None:
            counts.unseen += 1
            continue
        batches[target].append(int(i))
        texts_in[target] |= texts
    return [np.array(batch, dtype=np.int64) for batch in batches]


def _cut_pass(
    tables: Iterable[pa.Table | TokenizedRows], plan: BatchPlan, key: tuple[int, ...], counts: SourceCounts, first=0
):
    """Every row of the pass in a batch: window by window (rows that do not fill a whole batch carry over to the
    next window), then the last rows, short batches included. ``first``: the number of the first window."""
    carry, number = None, first
    for number, window in enumerate(_windows(tables, plan.window_batches * plan.batch_size, counts), start=first):
        rows = window if carry is None else TokenizedRows.concat([carry, window])
        batches, leftover = cut_window(rows, plan, (*key, number), whole_only=True, counts=counts)
        carry = rows.take(leftover) if len(leftover) else None
        yield from ((rows, batch) for batch in batches)
    if carry is not None:
        batches, _ = cut_window(carry, plan, (*key, number + 1), whole_only=False, counts=counts)
        yield from ((carry, batch) for batch in batches)


def _windows(
    tables: Iterable[pa.Table | TokenizedRows], window_rows: int, counts: SourceCounts
) -> Iterator[TokenizedRows]:
    pending, rows = [], 0
    for table in tables:
        if not table.num_rows:  # (a shard's empty block)
            continue
        part = table if isinstance(table, TokenizedRows) else TokenizedRows.from_arrow(table)
        pending.append(part)
        rows += part.num_rows
        counts.truncated_texts += int(part.truncated.sum())
        if rows >= window_rows:
            yield TokenizedRows.concat(pending)
            pending, rows = [], 0
    if rows:
        yield TokenizedRows.concat(pending)


def cut_window(
    rows: TokenizedRows, plan: BatchPlan, key: tuple[int, ...], whole_only: bool, counts: SourceCounts
) -> tuple[list[np.ndarray], np.ndarray]:
    """A window's rows sorted by length (ties in a random order of this rank) and cut into batches, shuffled
    alike on every rank. ``whole_only``: only full batches, the other rows returned (carried to the next window);
    else every row goes into a batch, the last ones possibly short."""
    batches, leftover = _fill(_by_length(rows, plan, key), rows, plan, counts, keep_short=not whole_only)
    while not whole_only and len(leftover):  # rows that waited, until every one is in a batch
        more, leftover = _fill(leftover, rows, plan, counts, keep_short=True)
        batches += more
    return _shuffled(batches, key), leftover


def _by_length(rows: TokenizedRows, plan: BatchPlan, key: tuple[int, ...]) -> np.ndarray:
    """The window's rows in order of length, ties in a random order of this rank."""
    order = np.random.default_rng([*key, plan.rank]).permutation(len(rows))
    return order[np.argsort(rows.lengths[order], kind="stable")]


def _shuffled(batches: list[np.ndarray], key: tuple[int, ...]) -> list[np.ndarray]:
    """The window's batches in an order seeded alike on every rank."""
    return [batches[i] for i in np.random.default_rng(list(key)).permutation(len(batches))]


def _fill(order: np.ndarray, rows: TokenizedRows, plan: BatchPlan, counts: SourceCounts, keep_short: bool):
    """Rows in ``order`` into batches of ``plan.batch_size``; returns the batches and the rows left (a partial
    batch, unless ``keep_short`` makes it a batch, and rows waiting). With ``no_duplicates`` a row that shares a
    text with the batch being filled waits."""
    size = plan.batch_size
    if not plan.no_duplicates:
        whole = len(order) if keep_short else len(order) // size * size
        return [order[i : i + size] for i in range(0, whole, size)], order[whole:]
    batches, current, seen, waiting = [], [], set(), []
    for i in order:
        texts = {int(h[i]) for h in rows.hashes}
        if not texts.isdisjoint(seen):
            waiting.append(i)
            counts.deferred_duplicates += 1
            continue
        current.append(i)
        seen |= texts
        if len(current) == size:
            batches.append(np.array(current))
            current, seen = [], set()
    if current and keep_short:
        batches.append(np.array(current))
        current = []
    return batches, np.array(current + waiting, dtype=np.int64)


def local_sources(
    config: TrainConfig, index: int, encoder: SentenceEncoder, tokenise_every_pass: bool = False
) -> list[SourceStream]:
    """Stage ``index``'s sources read and tokenised in this process, for one worker without Ray (the training
    benchmark's ``--local`` runs, tests): the same rows the cluster's stream gives, counted by a first read. A
    registered dataset is read whole anyway (``data.readers``), so it is read and tokenised once, without pyarrow,
    and its rows kept for every pass, unless ``tokenise_every_pass`` (the ingest benchmark, which times
    tokenisation); the user's files are read through pyarrow, as on the cluster, pass after pass; a prepared
    source's shards as they are, by the rank ``StageBatches``' plan names, as a cluster's worker reads them
    (``share_batches``; refused when prepared for another tokenizer, length or prompts)."""
    stage = config.stages[index]

    def tables(source: Source, key: tuple[int, int, int]) -> Iterator[pa.Table]:
        read = (t for f, _ in pass_reads(source, stage, key) for t in read_tables(source, f, stage, config.data_dir))
        return (tokenize_table(t, encoder) for t in _first_rows(read, stage.limit))

    def registered(source: Source) -> Iterator[TokenizedRows]:
        read = _first_rows(read_registered(source, stage, config.data_dir), stage.limit)
        return (tokenize_texts(columns.texts, columns.labels, encoder) for columns in read)

    def stream(source: Source) -> SourceStream:
        if source.manifest is not None:  # tokenised: each rank reads its share straight from the shards
            prepared = PreparedPasses.of(source, stage)
            return SourceStream(source.name, prepared.rows, source.weight, None, prepared)
        if source.files or tokenise_every_pass:
            open_pass = functools.partial(tables, source) if source.files else lambda key: registered(source)
            rows = sum(t.num_rows for t in open_pass((0, 0, 0)))  # any pass's order holds every row
            return SourceStream(source.name, rows, source.weight, open_pass)
        rows = list(registered(source))
        return SourceStream(source.name, sum(part.num_rows for part in rows), source.weight, lambda key: rows)

    sources = stage_sources(stage, index)
    check_prepared(sources, stage, encoder.tokenizer, encoder.max_seq_length, encoder.prompts, encoder.joins_pairs)
    return [stream(source) for source in sources]


def _first_rows(tables: Iterable[pa.Table | TextColumns], limit: int | None) -> Iterator[pa.Table | TextColumns]:
    for table in tables:
        if limit is not None and table.num_rows >= limit:
            yield table.slice(0, limit)
            return
        yield table
        limit = None if limit is None else limit - table.num_rows
