"""The corpus's embeddings for ``sbert-ray mine``, made once per run and kept as files. Every anchor shard searches
the whole corpus, so each corpus chunk is encoded once, on the encoder actors, and written as
``OUTPUT/.corpus-embeddings/rows-START-STOP.npy`` (float32, the chunk's rows in order); each shard's search reads
the chunks back one at a time and sends each to a worker.

- Resumable: a chunk's file is written whole or not at all (``atomic_write``); a rerun into the same output (its
  ``mine.json``: model, inputs, settings) encodes only the chunks whose files are missing.
- What the files depend on beyond ``mine.json`` (the corpus chunk and the batch size: batches decide the padding,
  and so the last bits of an embedding) is the work area's marker; a rerun with others starts it afresh.
- Owned: the work area is a hidden folder inside the claimed output, made and removed by ``owned_paths`` only;
  ``sbert-ray mine`` removes it once every anchor shard is written.
- Memory on the driver: the chunk being written or read (4 bytes x dimensions x corpus chunk: 25 MB for 16,384
  texts of 384 dimensions), whatever the corpus size. Disk: 4 bytes x dimensions per corpus text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from sbert_ray.atomic_files import atomic_write
from sbert_ray.runs import owned_paths

WORK_AREA = ".corpus-embeddings"
MARKER = "embeddings.json"


@dataclass(frozen=True)
class CorpusEmbeddings:
    """The embedding files of a corpus of ``size`` texts cut into chunks of ``chunk`` (``retrieval.text_chunks``)."""

    folder: Path
    size: int
    chunk: int

    @classmethod
    def open(cls, output: Path, size: int, chunk: int, batch_size: int) -> CorpusEmbeddings:
        """The work area of ``output`` (claimed already), keeping the files of an earlier run made the same way."""
        settings = {"corpus_size": size, "corpus_chunk": chunk, "batch_size": batch_size}
        return cls(owned_paths.work_area(output, WORK_AREA, MARKER, settings), size, chunk)

    def ranges(self) -> list[tuple[int, int]]:
        return [(start, min(start + self.chunk, self.size)) for start in range(0, self.size, self.chunk)]

    def path(self, start: int, stop: int) -> Path:
        return self.folder / f"rows-{start:012d}-{stop:012d}.npy"

    def embed(self, pool, chunk_texts: Callable[[int, int], object], batch_size: int) -> int:
        """Encode the corpus chunks that have no file yet on ``pool``'s workers (anything with
        ``RayEncoder.map_unordered``) and write each as it comes back; how many were encoded. ``chunk_texts(start,
        stop)``: the texts of rows [start, stop) as a ``pa.Array``, or a reference to one in Ray's object store
        (``StoredCorpus.chunk_texts``), which the worker that encodes it fetches."""
        missing = [(start, stop) for start, stop in self.ranges() if not self.path(start, stop).exists()]
        chunks = ((chunk_texts(start, stop), start, stop) for start, stop in missing)
        for embeddings, start, stop in pool.map_unordered(_encoded, chunks, batch_size):
            with atomic_write(self.path(start, stop)) as partial, open(partial, "wb") as file:
                np.save(file, embeddings)
        return len(missing)

    def chunks(self) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """Each chunk's embeddings and rows, read one at a time, in corpus order (as ``search_chunks`` takes them)."""
        for start, stop in self.ranges():
            yield np.load(self.path(start, stop)), torch.arange(start, stop)


def _encoded(encoder, texts: pa.Array, start: int, stop: int, batch_size: int) -> tuple[np.ndarray, int, int]:
    """One chunk's embeddings, as a search encodes them (``retrieval.search_chunk``: no prompt), on a worker."""
    return encoder.encode(texts.to_pylist(), batch_size=batch_size, convert_to="numpy"), start, stop
