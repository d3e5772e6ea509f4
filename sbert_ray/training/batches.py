"""From tokenised tables to the objective's inputs: tokenisation of a source's text columns (a map stage of the
stream, see ``training.stage_data``), a window of tokenised rows as compact arrays, and its batches padded (collation).

Tokenised rows are numpy arrays: a worker without Ray reads and tokenises its data without pyarrow (a GPU machine
may have none); Arrow tables are only the form Ray Data's stream carries them in (``tokenize_table``,
``TokenizedRows.from_arrow``), and pyarrow is imported where one is made or read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sbert_ray.config import StageConfig
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.cross_encoder import CrossEncoderModel
from sbert_ray.models.load import TextTokenizer
from sbert_ray.models.padded_widths import bucketed_width
from sbert_ray.models.prompts import prompt_for_column

if TYPE_CHECKING:
    import pyarrow as pa


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """How a stage's global batch (``batch_size``) is split at ``workers`` live workers, any number up to the most.

    The unit is the global micro-batch: ``batch_size / grad_accum_steps`` examples from one source, one entry of
    the data order, whatever the world size. It is dealt over the ranks as evenly as whole examples allow, the
    first ranks one more (``shares``: 16 over 3 ranks is 6, 5, 5). Each rank trains its share as ``chunks``
    micro-batches, as even as whole examples allow (``training.stream``): with in-batch negatives one (gathered
    across workers, every anchor still meets the global micro-batch's candidates; cached MNRL bounds memory by its
    ``mini_batch_size`` chunks as ever), else as few as keep every micro-batch no larger than the largest share at
    the most workers. An optimizer step is ``grad_accum_steps`` global micro-batches, ``accumulation`` micro-batches
    on each worker (the same number on every rank, as DDP's synchronised steps need). The loop weighs each
    micro-batch's mean loss by its rows over the global batch (``training.loop``), so the step is the one over the
    global batch however it is cut."""

    workers: int
    shares: tuple[int, ...]  # per rank: its examples of one global micro-batch (they sum to it)
    chunks: int  # micro-batches per global micro-batch on each worker
    accumulation: int  # micro-batches per optimizer step on each worker

    @property
    def largest_micro_batch(self) -> int:
        """The most rows any worker's micro-batch holds (the first rank's share, cut as evenly as ``chunks``
        allows; a pass's last batch is smaller): what a cross-worker gather pads to, known on every rank."""
        return -(-self.shares[0] // self.chunks)


def split_batch(stage: StageConfig, max_workers: int, workers: int, in_batch_negatives: bool) -> BatchSplit:
    """The stage's global batch at ``workers`` live workers of a run configured for up to ``max_workers`` (the
    config's validation made every share at least one example)."""
    unit = stage.batch_size // stage.grad_accum_steps
    shares = [unit // workers + (rank < unit % workers) for rank in range(workers)]
    largest = -(-unit // max_workers)  # the largest micro-batch of the most workers: the memory a run is sized for
    chunks = 1 if in_batch_negatives else -(-shares[0] // largest)
    return BatchSplit(workers, tuple(shares), chunks, stage.grad_accum_steps * chunks)


def text_hashes(texts: Sequence[str]) -> np.ndarray:
    """A 64-bit hash per text: equal texts, equal hashes (how batches find duplicates without comparing strings),
    the same in every process (the workers gather them)."""
    digests = b"".join(hashlib.blake2b(text.encode(), digest_size=8).digest() for text in texts)
    return np.frombuffer(digests, dtype=np.int64).copy()


def tokenize_texts(
    texts: Sequence[Sequence[str]],
    labels: np.ndarray | None,
    encoder: SentenceEncoder | CrossEncoderModel | TextTokenizer,
) -> TokenizedRows:
    """A source's text columns (``texts[k]``: column k, every column one text per row) tokenised with the
    encoder's tokenizer: per column the token ids (truncated to its ``max_seq_length``; the anchor column after
    the model's query prompt, the others after its document prompt, as ``encode_query`` / ``encode_document`` put
    them) and a hash of each text itself; per row its longest text (which sets its batch's padded width), the texts
    that lost tokens, and ``labels``. A reranker (``joins_pairs``) reads the anchor with each other column as one
    text pair, as ``CrossEncoder`` tokenises pairs (truncated longest first): its columns are those pairs, each
    hashed by its passage."""
    tokenizer, max_seq_length = encoder.tokenizer, encoder.max_seq_length
    queries = texts[0] if encoder.joins_pairs else None
    if queries is not None:
        texts = texts[1:]
    rows = len(texts[0])
    columns, hashes, truncated = [], [], np.zeros(rows, dtype=np.int8)
    for index, column in enumerate(texts):
        if queries is None:
            prompt = prompt_for_column(encoder.prompts, index)
            inputs = ([prompt + text for text in column],)
        else:
            inputs = (list(queries), list(column))
        ids = tokenizer(
            *inputs, truncation=True, max_length=max_seq_length, return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]  # fmt: skip
        lengths = np.fromiter(map(len, ids), dtype=np.int32, count=rows)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
        columns.append(TokenizedColumn(flat, offsets))
        hashes.append(text_hashes(column))
        truncated += truncated_rows(tokenizer, inputs, ids, max_seq_length)
    lengths = np.max([np.diff(column.offsets) for column in columns], 0)
    return TokenizedRows(columns, hashes, lengths, labels, truncated)


def tokenize_table(table: pa.Table, encoder: SentenceEncoder | TextTokenizer) -> pa.Table:
    """A source's table (``text_<k>`` columns, optional ``label``) tokenised (``tokenize_texts``) as an Arrow table
    (the stream's map stage): per column ``ids_<k>`` (int32 token ids) and ``hash_<k>``; per row ``length``,
    ``truncated`` and the label."""
    width = sum(name.startswith("text_") for name in table.column_names)
    tokens = tokenize_texts([table.column(f"text_{k}").to_pylist() for k in range(width)], None, encoder).to_arrow()
    return tokens.append_column("label", table.column("label")) if "label" in table.column_names else tokens


def truncated_rows(
    tokenizer, inputs: Sequence[Sequence[str]], input_ids: Sequence[Sequence[int]], max_length: int
) -> np.ndarray:
    """1 for each input that lost tokens when tokenised to ``input_ids`` with ``max_length``, else 0; ``inputs``:
    the texts (one sequence), or the pairs' first and second texts (two). Only those that came out exactly
    max_length long can have, so only they are tokenised again, in full."""
    flags = np.zeros(len(input_ids), dtype=np.int8)
    full_length = [i for i, ids in enumerate(input_ids) if len(ids) >= max_length]
    if full_length:
        again = [[texts[i] for i in full_length] for texts in inputs]
        lengths = tokenizer(*again, return_attention_mask=False, verbose=False)["input_ids"]
        flags[[i for i, ids in zip(full_length, lengths, strict=True) if len(ids) > max_length]] = 1
    return flags


@dataclasses.dataclass(frozen=True)
class TokenizedColumn:
    """One text column's token ids, back to back: sentence i is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # one more than there are sentences

    @classmethod
    def from_arrow(cls, ids: pa.ListArray) -> TokenizedColumn:
        """From a tokenised table's ``ids_<k>`` column (one chunk), zero-copy; a slice of one (a prepared shard's
        row group cut at a window's edge) holds only its rows' ids (``flatten``, not the whole ``values``)."""
        offsets = ids.offsets.to_numpy()
        return cls(ids.flatten().to_numpy(), offsets - offsets[0] if offsets[0] else offsets)

    @classmethod
    def concat(cls, parts: Sequence[TokenizedColumn]) -> TokenizedColumn:
        starts = np.cumsum([0] + [len(part.ids) for part in parts])
        offsets = [part.offsets[:-1] + start for part, start in zip(parts, starts[:-1], strict=True)]
        return cls(np.concatenate([part.ids for part in parts]), np.concatenate([*offsets, starts[-1:]]))

    def take(self, indices: np.ndarray) -> TokenizedColumn:
        lengths, source = self._tokens(indices)
        offsets = np.zeros(len(indices) + 1, dtype=self.offsets.dtype)
        np.cumsum(lengths, out=offsets[1:])
        return TokenizedColumn(self.ids[source], offsets)

    def _tokens(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The lengths of these sentences, and where each of their tokens is in ``ids``, sentence after sentence."""
        starts, lengths = self.offsets[indices], self.offsets[indices + 1] - self.offsets[indices]
        first_of_row = np.repeat(np.cumsum(lengths) - lengths, lengths)
        return lengths, np.repeat(starts, lengths) + np.arange(lengths.sum()) - first_of_row

    def pad(
        self, indices: np.ndarray, pad_token_id: int, pad_left: bool, pin: bool, buckets: tuple[int, ...] | None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """input_ids and attention_mask of these sentences, stacked [2, batch, width], padded with numpy into one
        (pinned, with ``pin``) host buffer, as ``tokenizer.pad`` pads them; width: the longest, rounded up to one of
        the ``buckets`` (``models.padded_widths``). And the columns each row uses (its last attended one plus one:
        its length when padded on the right, the width on the left), known here on the host."""
        lengths, source = self._tokens(indices)
        width = bucketed_width(int(lengths.max()), buckets)
        buffer = torch.empty((2, len(indices), width), dtype=torch.long, pin_memory=pin)
        input_ids, attention_mask = buffer.numpy()
        positions = np.arange(width)
        # Row after row, as `source` lists the real tokens: the order boolean indexing fills `filled`.
        filled = positions >= width - lengths[:, None] if pad_left else positions < lengths[:, None]
        input_ids.fill(pad_token_id)
        input_ids[filled] = self.ids[source]
        np.copyto(attention_mask, filled)
        return buffer, np.full_like(lengths, width) if pad_left else lengths


@dataclasses.dataclass(frozen=True)
class TokenizedRows:
    """Tokenised examples as compact numpy arrays (a window of a worker's stream), padded per batch when
    collated: batches of similar lengths pad little (smart batching)."""

    columns: list[TokenizedColumn]  # one per siamese branch
    hashes: list[np.ndarray]  # int64 per column: a hash of each text
    lengths: np.ndarray  # per example: its longest text
    labels: np.ndarray | None  # int64 class labels, float32 scaled scores, float32 [rows, n] teacher scores, or None
    truncated: np.ndarray  # int8 per example: its texts that lost tokens to max_seq_length

    @classmethod
    def from_arrow(cls, table: pa.Table) -> TokenizedRows:
        """From a tokenised table (``tokenize_table``), as Ray Data's stream hands them to a worker."""
        table = table.combine_chunks()
        width = sum(name.startswith("ids_") for name in table.column_names)
        column = lambda name: table.column(name).chunk(0) if table.num_rows else table.column(name)  # noqa: E731
        return cls(
            columns=[TokenizedColumn.from_arrow(column(f"ids_{k}")) for k in range(width)],
            hashes=[table.column(f"hash_{k}").to_numpy() for k in range(width)],
            lengths=table.column("length").to_numpy(),
            labels=_labels(table.column("label")) if "label" in table.column_names else None,
            truncated=table.column("truncated").to_numpy(),
        )

    def to_arrow(self) -> pa.Table:
        """As the tokenised table ``from_arrow`` reads (the label apart)."""
        import pyarrow as pa

        columns = {}
        for k, (column, hashes) in enumerate(zip(self.columns, self.hashes, strict=True)):
            columns[f"ids_{k}"] = pa.ListArray.from_arrays(pa.array(column.offsets), pa.array(column.ids))
            columns[f"hash_{k}"] = pa.array(hashes)
        return pa.table({**columns, "length": pa.array(self.lengths), "truncated": pa.array(self.truncated)})

    @property
    def num_rows(self) -> int:
        """As ``pa.Table.num_rows``: a stream's parts are either (``training.stream``)."""
        return len(self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, indices: Sequence[int]) -> TokenizedRows:
        index = np.asarray(indices, dtype=np.int64)
        return TokenizedRows(
            [column.take(index) for column in self.columns],
            [hashes[index] for hashes in self.hashes],
            self.lengths[index],
            None if self.labels is None else self.labels[index],
            self.truncated[index],
        )

    @classmethod
    def concat(cls, parts: Sequence[TokenizedRows]) -> TokenizedRows:
        """One window of consecutive parts of a stream."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            [TokenizedColumn.concat(columns) for columns in zip(*(p.columns for p in parts), strict=True)],
            [np.concatenate(hashes) for hashes in zip(*(p.hashes for p in parts), strict=True)],
            np.concatenate([p.lengths for p in parts]),
            None if parts[0].labels is None else np.concatenate([p.labels for p in parts]),
            np.concatenate([p.truncated for p in parts]),
        )

    def collate(
        self,
        indices: Sequence[int],
        pad_token_id: int,
        pad_left: bool,
        device: torch.device,
        buckets: tuple[int, ...] | None = None,
    ) -> tuple[list[dict], torch.Tensor | None, list[torch.Tensor], list[np.ndarray]]:
        """The batch's features per column, each column padded to its own width (rounded up to one of the
        ``buckets``, ``models.padded_widths.buckets_for``; None: exact), its labels and its texts' hashes on
        ``device`` (on CUDA from pinned host memory, copied without blocking the host), and per column the padded
        columns each row uses, on the host (``MicroBatch.used_widths``)."""
        index = np.asarray(indices, dtype=np.int64)
        pin = device.type == "cuda"
        features, used_widths = [], []
        for column in self.columns:
            padded, widths = column.pad(index, pad_token_id, pad_left, pin, buckets)
            padded = padded.to(device, non_blocking=True)
            features.append({"input_ids": padded[0], "attention_mask": padded[1]})
            used_widths.append(widths)
        hashes = [_to(torch.from_numpy(h[index]), device, pin) for h in self.hashes]
        labels = None if self.labels is None else _to(torch.from_numpy(self.labels[index]), device, pin)
        return features, labels, hashes, used_widths


def _labels(column: pa.ChunkedArray) -> np.ndarray:
    """A label per row, or a teacher's scores per row (a fixed-size list column) as a [rows, n] array."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(column.type):
        return column.combine_chunks().flatten().to_numpy().reshape(len(column), column.type.list_size)
    return column.to_numpy()


def _to(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    return (tensor.pin_memory() if pin else tensor).to(device, non_blocking=True)
