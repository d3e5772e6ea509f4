"""The corpus ``sbert-ray mine`` draws negatives from, kept in Ray's object store: its texts never sit on the driver.

The corpus is the separate corpus's texts, then the pairs' positives, deduplicated as ``dict.fromkeys`` would (a
text's row is its first appearance: ``hard_negatives.MiningPairs.build``). ``StoredCorpus.store`` makes it from
blocks of texts already in the object store (a remote corpus's Ray Data blocks, read on the cluster; a local file's
tables, put one at a time as the driver reads them; the positives):

- a task per block digests its texts (BLAKE2b, 128 bits: two of 10^9 distinct texts collide with odds ~1e-21);
- one task finds each distinct digest's first appearance (``np.unique``), keeping in the object store the index
  (distinct digests and their rows) and each row's place among the blocks' texts;
- a task per chunk of ``chunk`` rows gathers its texts from the blocks it spans: the chunks ``CorpusEmbeddings``
  has the encoder actors embed, straight from the store. The blocks are released once gathered.

Lookups are tasks too, one per call: ``rows_of`` (texts to rows: the pairs' anchors and positives) and ``take``
(rows to texts: a shard's negatives and positives, for its output rows and the teacher's pairs, from the chunks
they fall in). The driver holds object references, the row count and what it asked for, whatever the corpus's
size; the store spills to disk what does not fit in memory. Storing runs before the encoder actors start, its tasks
on a CPU each (as many at once as the cluster has CPUs, each worker process serving one task after another);
lookups reserve no CPU: they are short, and run while the encoder actors may hold every CPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import ray

from sbert_ray.data.records import DataError

DIGEST = np.dtype("V16")


@dataclass(frozen=True)
class StoredCorpus:
    """The deduplicated corpus (``hard_negatives.Corpus``): ``size`` rows in chunks of ``chunk``, each chunk's texts
    (a ``pa.LargeStringArray``) an object in the store."""

    chunks: tuple[ray.ObjectRef, ...]
    chunk: int
    size: int
    index: ray.ObjectRef  # (distinct digests, sorted; the row of each)
    digest: str  # SHA-256 of every text's digest, in order: what a rerun's ``mine.json`` compares

    @classmethod
    def store(cls, blocks: Iterable[tuple[ray.ObjectRef, str]], chunk: int) -> StoredCorpus:
        """The corpus of ``blocks``: (a reference to a table whose first column holds texts, where they were read
        from, for errors), in corpus order. A DataError names the source of a null text."""
        blocks = list(blocks)
        digests = [_digests.remote(block, source) for block, source in blocks]
        index, places, summary = _deduplicate.remote(*digests)
        size, digest, starts = ray.get(summary)
        texts = [block for block, _ in blocks]
        chunks = tuple(
            _gather.remote(places, start, min(start + chunk, size), starts, texts) for start in range(0, size, chunk)
        )
        return cls(chunks, chunk, size, index, digest)

    def __len__(self) -> int:
        return self.size

    def chunk_texts(self, start: int, stop: int) -> ray.ObjectRef:
        """The texts of rows [start, stop), one of the chunks (a task given it gets the array itself)."""
        assert start % self.chunk == 0 and stop == min(start + self.chunk, self.size), (start, stop)
        return self.chunks[start // self.chunk]

    def rows_of(self, texts: Sequence[str]) -> list[int]:
        return ray.get(_lookup.remote(self.index, list(texts))).tolist()

    def take(self, rows: Sequence[int]) -> list[str]:
        rows = np.asarray(rows, dtype=np.int64)
        wanted = {index: self.chunks[index] for index in np.unique(rows // self.chunk).tolist()}
        return ray.get(_take.remote(rows, self.chunk, wanted))


def digests_of(texts: Iterable[str]) -> np.ndarray:
    return np.frombuffer(
        b"".join(hashlib.blake2b(text.encode(), digest_size=DIGEST.itemsize).digest() for text in texts), DIGEST
    )


@ray.remote
def _digests(block: pa.Table, source: str) -> np.ndarray:
    texts = block.column(0)
    if texts.null_count:
        raise DataError(f"{source}: a null where text should be")
    return digests_of(texts.to_pylist())


@ray.remote(num_returns=3)
def _deduplicate(*blocks: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray, tuple]:
    """(the index: distinct digests and their rows), each row's place among all texts, (rows, digest, where each
    block starts among all texts)."""
    every = np.concatenate(blocks) if blocks else np.empty(0, DIGEST)
    distinct, first = np.unique(every, return_index=True)
    places = np.sort(first)  # rows in order of first appearance
    starts = np.cumsum([0, *map(len, blocks)])[:-1]
    return (distinct, np.searchsorted(places, first)), places, (len(places), hashlib.sha256(every).hexdigest(), starts)


@ray.remote
def _gather(places: np.ndarray, start: int, stop: int, starts: np.ndarray, blocks: list[ray.ObjectRef]) -> pa.Array:
    """The texts of rows [start, stop), from the blocks their places fall in (fetched here, only those)."""
    wanted = places[start:stop]
    block_of = np.searchsorted(starts, wanted, side="right") - 1
    pieces = [
        ray.get(blocks[b]).column(0).take(pa.array(wanted[block_of == b] - starts[b])).cast(pa.large_string())
        for b in np.unique(block_of)
    ]
    return pa.concat_arrays([chunk for piece in pieces for chunk in piece.chunks])


@ray.remote(num_cpus=0)
def _lookup(index: tuple[np.ndarray, np.ndarray], texts: list[str]) -> np.ndarray:
    distinct, rows = index
    wanted = digests_of(texts)
    if not len(distinct):
        return np.full(len(wanted), -1)
    at = np.searchsorted(distinct, wanted).clip(max=len(distinct) - 1)
    return np.where(distinct[at] == wanted, rows[at], -1)


@ray.remote(num_cpus=0)
def _take(rows: np.ndarray, chunk: int, chunks: dict[int, ray.ObjectRef]) -> list[str]:
    """The texts of ``rows``, in their order, from ``chunks`` (of ``chunk`` rows each: the ones they fall in, in
    ascending order)."""
    texts = np.empty(len(rows), dtype=object)
    by_chunk = np.argsort(rows // chunk, kind="stable")  # each chunk's rows, one slice: O(rows log rows) in all
    bounds = np.searchsorted(rows[by_chunk] // chunk, [*chunks, max(chunks, default=0) + 1])
    for at, (index, chunk_texts) in enumerate(zip(chunks, ray.get(list(chunks.values())), strict=True)):
        here = by_chunk[bounds[at] : bounds[at + 1]]
        texts[here] = chunk_texts.take(pa.array(rows[here] - index * chunk)).to_pylist()
    return texts.tolist()
