"""``sbert-ray mine``: hard negatives for (anchor, positive) pairs as a Ray job, written as parquet a training
stage reads directly (``anchor, positive, negative_1..negative_n``, or ``anchor, positive, negative`` triplets).

    inputs checked: the pairs (file columns, or a registered dataset), the corpus (file, or an object-storage
    prefix listed), the settings, the teacher (--rescore-with), the output folder (new, or a mining output of the
    same inputs and settings)   (no Ray yet)
      -> the corpus and the positives stored in Ray's object store, deduplicated there (``mining_corpus``): a remote
         corpus read by Ray Data on the cluster, a local one put a read at a time; the pairs' anchors and positives
         looked up there (``MiningPairs.over``); the output folder claimed (a rerun: the same data's digest)
      -> the encoder actors started (each holding the teacher too, with --rescore-with)
      -> once per run, before the first shard to mine: each corpus chunk encoded on the actors, from the store, and
         written to the output's hidden work area, unless an earlier run of the same mining wrote it
         (``corpus_embeddings``)
      -> per shard of ``shard_size`` anchors, unless its file is already there (a rerun resumes):
           anchors encoded on the actors; the corpus chunks' embeddings read back one at a time and each searched
           on an actor, each chunk's top k merged here (``retrieval.search_chunks``); with a teacher (--rescore-with),
           every candidate and positive pair scored on the actors (``RayEncoder.score``); negatives chosen
           (``hard_negatives.choose_negatives``); the texts of the shard's rows taken from the store; the rows
           written to a hidden file, renamed to ``part-NNNNN.parquet`` once complete
      -> every shard written: the work area removed

Memory: the driver holds the pairs' texts, never the corpus's (a local corpus passes through one read of
ROWS_PER_READ rows at a time): the shard's anchor embeddings, each anchor's top k candidates (k = range_max +
max_positives + 1: 12 bytes each) and the texts of its output rows; with a teacher, the candidates' texts and
scores. Of the corpus embeddings, the chunk it writes or reads (4 bytes x dimensions x ``corpus_chunk``; those on
their way to the actors wait in Ray's object store, two per actor), never all of them. A worker holds one corpus
chunk's texts or embeddings and one score block of QUERY_CHUNK x CORPUS_CHUNK float32 values, or one piece of
teacher pairs. No anchor x corpus score matrix exists anywhere. The corpus is encoded once per run, whatever
``shard_size``: a smaller one loses less to an interruption and costs one more read of the embedding files (disk:
4 bytes x dimensions per corpus text) per shard.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from sbert_ray.atomic_files import atomic_write
from sbert_ray.config import RESOURCE_WAIT_S, ConfigError
from sbert_ray.data.corpus import TABLE_SUFFIXES, CorpusSource, open_corpus
from sbert_ray.data.readers import check_available, load_records
from sbert_ray.data.records import TEXT_FIELDS, DataError
from sbert_ray.data.remote_corpus import RemoteCorpus, check_remote_corpus
from sbert_ray.evaluation.encoder_pool import RayEncoder, replica_resources
from sbert_ray.evaluation.hard_negatives import MiningPairs, MiningSettings, Negatives, mine, output_columns
from sbert_ray.evaluation.retrieval import CORPUS_CHUNK, QUERY_CHUNK, check_faiss
from sbert_ray.models import load_encoder
from sbert_ray.models.teachers import load_teacher
from sbert_ray.progress import progress_bar
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs import owned_paths
from sbert_ray.runs.cluster import input_errors_unwrapped, refuse_impossible_encoders
from sbert_ray.runs.corpus_embeddings import WORK_AREA, CorpusEmbeddings
from sbert_ray.runs.mining_corpus import StoredCorpus
from sbert_ray.training.storage import is_remote

SHARD_ANCHORS = 65536  # anchors per output file
ROWS_PER_READ = 65536  # rows of a local corpus file read at a time (fewer of long texts: corpus.TABLE_CHARACTERS)
MANIFEST = "mine.json"  # what the output folder was mined from and how: a rerun resumes only the same mining


@dataclass(frozen=True)
class MineRequest:
    """What ``sbert-ray mine`` mines: ``pairs`` (a .csv/.tsv/.jsonl/.parquet file with ``anchor_column`` and
    ``positive_column``, or a registered dataset ``NAME[:SPLIT]``, whose records' first two texts are the anchor and
    the positive), optionally a separate ``corpus`` (a file, or an object-storage prefix), with which model and
    settings, into which folder."""

    model_ref: str
    pairs: str
    output: str | os.PathLike
    settings: MiningSettings = field(default_factory=MiningSettings)
    anchor_column: str | None = None
    positive_column: str | None = None
    corpus: str | None = None
    corpus_column: str | None = None
    batch_size: int = 32
    workers: int = 1
    device: str | None = None
    data_dir: str | os.PathLike | None = None
    shard_size: int = SHARD_ANCHORS
    corpus_chunk: int = CORPUS_CHUNK
    approximate: bool = False  # faiss HNSW per corpus chunk instead of the exact search
    rescore_with: str | None = None  # a teacher (a cross-encoder) whose scores the filters use (settings.rescored)
    resource_wait_s: float = RESOURCE_WAIT_S  # for the --workers replicas' CPUs/GPUs while other work holds them

    def __post_init__(self) -> None:
        for name in ("batch_size", "workers", "shard_size", "corpus_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.device and self.device.partition(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device}: mining encodes on Ray actors, on cpu or cuda")
        owned_paths.refuse_protected(self.output, "--output")
        if self.approximate:
            check_faiss()
        if (self.rescore_with is not None) != self.settings.rescored:
            raise ConfigError("settings.rescored says whether --rescore-with names a teacher: set both or neither")
        if is_remote(str(self.output)):
            raise ConfigError(f"--output {self.output}: mining writes a local folder (copy it to object storage after)")


@dataclass
class MineResult:
    output: str
    anchors: int
    corpus: int
    rows: int  # written by this run
    shards_written: int
    shards_skipped: int  # complete from an earlier run
    short_anchors: int  # anchors with fewer than num_negatives negatives (left out of n-tuples)
    dropped: dict[str, int]  # candidates each filter removed
    seconds: float
    corpus_chunks_embedded: int = 0  # the corpus's chunks encoded by this run (each once, whatever the shards)


@dataclass(frozen=True)
class ShardDone:
    """What the progress callback hears after each shard."""

    index: int
    shards: int
    rows: int
    skipped: bool
    seconds: float


@input_errors_unwrapped()  # a bad row of a remote corpus is found in a Ray Data task
def mine_negatives(request: MineRequest, progress: Callable[[ShardDone], None] = lambda done: None) -> MineResult:
    """Mine every shard of the request's pairs that its output folder does not hold yet (see the module docstring)."""
    start = time.perf_counter()
    anchors, positives = read_pairs(request)
    corpus = _check_corpus(request)
    output = Path(request.output).expanduser().resolve()
    _check_output_folder(output, _manifest(request))  # before any Ray work: the data's digest is compared later
    teacher = load_teacher(request.rescore_with) if request.rescore_with else None
    encoder = load_encoder(request.model_ref)
    connect_ray()
    stored = StoredCorpus.store(_corpus_blocks(request, corpus, positives), request.corpus_chunk)
    pairs = MiningPairs.over(stored, anchors, positives)
    _claim_output_folder(output, _manifest(request, pairs, stored))
    use_gpu = request.device.startswith("cuda") if request.device else ray.cluster_resources().get("GPU", 0) > 0
    shards = range(0, len(pairs.queries), request.shard_size)
    result = MineResult(str(output), len(pairs.queries), len(stored), 0, 0, 0, 0, {}, 0.0)
    refuse_impossible_encoders(replica_resources(use_gpu), request.workers)
    pool = RayEncoder(encoder, request.workers, use_gpu, resource_wait_s=request.resource_wait_s, teacher=teacher)
    with pool:
        embeddings = None  # the corpus embedded once, for the first shard to mine, and read by every shard after it
        for index, first in enumerate(progress_bar(shards, desc="shards", unit="shard")):
            shard_start, path = time.perf_counter(), output / f"part-{index:05d}.parquet"
            if path.exists():
                result.shards_skipped += 1
                progress(ShardDone(index, len(shards), pq.ParquetFile(path).metadata.num_rows, True, 0.0))
                continue
            if embeddings is None:
                embeddings = CorpusEmbeddings.open(output, len(stored), request.corpus_chunk, request.batch_size)
                result.corpus_chunks_embedded = embeddings.embed(pool, stored.chunk_texts, request.batch_size)
            shard = pairs.slice(first, first + request.shard_size)
            rows = _mine_shard(pool, shard, request, path, result, embeddings)
            progress(ShardDone(index, len(shards), rows, False, time.perf_counter() - shard_start))
    owned_paths.remove_work_area(output, WORK_AREA)  # every shard is written: the embeddings are not needed again
    result.seconds = time.perf_counter() - start
    return result


def _mine_shard(
    pool: RayEncoder,
    pairs: MiningPairs,
    request: MineRequest,
    path: Path,
    result: MineResult,
    embeddings: CorpusEmbeddings,
) -> int:
    chunks = progress_bar(total=-(-len(pairs.corpus) // request.corpus_chunk), desc="corpus chunks", unit="chunk")
    with chunks:
        negatives = mine(
            pool,
            pairs,
            request.settings,
            request.batch_size,
            QUERY_CHUNK,
            request.corpus_chunk,
            chunks.update,
            request.approximate,
            None if pool.teacher is None else functools.partial(pool.score, batch_size=request.batch_size),
            embeddings.chunks(),
        )
    table = pa.table(output_columns(pairs, negatives, request.settings), schema=_schema(request.settings))
    if table.num_rows == 0:  # training would refuse the shard; say why here, with what the filters dropped
        dropped = ", ".join(f"{name} {count}" for name, count in negatives.dropped.items() if count) or "none"
        raise DataError(
            f"{path.name}: none of its {len(pairs.queries)} anchors has {request.settings.num_negatives} negatives "
            f"left (candidates dropped: {dropped}); ask for fewer (--num-negatives), widen --range-max or loosen "
            "the filters"
        )
    with atomic_write(path) as partial:  # a file under the shard's name is always complete
        pq.write_table(table, partial)
    _count(result, negatives, request.settings, table.num_rows)
    return table.num_rows


def _schema(settings: MiningSettings) -> pa.Schema:
    negatives = (
        ["negative"]
        if settings.output_format == "triplet"
        else [f"negative_{i}" for i in range(1, settings.num_negatives + 1)]
    )
    texts = ["anchor", "positive", *negatives]
    scores = [f"score_{name}" for name in texts[1:]] if settings.output_scores else []
    return pa.schema([(name, pa.string()) for name in texts] + [(name, pa.float32()) for name in scores])


def _count(result: MineResult, negatives: Negatives, settings: MiningSettings, rows: int) -> None:
    result.rows += rows
    result.shards_written += 1
    result.short_anchors += sum(len(found) < settings.num_negatives for found in negatives.rows)
    for name, count in negatives.dropped.items():
        result.dropped[name] = result.dropped.get(name, 0) + count


# ------------------------------------------------------------------------------------------------ inputs


def read_pairs(request: MineRequest) -> tuple[list[str], list[str]]:
    """(anchors, positives) of the request's pairs file or dataset; a DataError names the file or dataset."""
    path = Path(request.pairs).expanduser()
    if path.suffix.lower() in TABLE_SUFFIXES or path.exists():
        columns = (request.anchor_column or "anchor", request.positive_column or "positive")
        if path.suffix.lower() not in TABLE_SUFFIXES:
            raise DataError(f"{path}: pairs are read from {', '.join(TABLE_SUFFIXES)} files")
        anchors, positives = (
            [_text(path, row, text, column) for row, text in _rows(path, column)] for column in columns
        )
        if not anchors:
            raise DataError(f"{path}: no pairs")
        return anchors, positives
    if request.anchor_column or request.positive_column:
        raise DataError(f"{request.pairs}: --anchor-column/--positive-column apply to files, not datasets")
    name, _, split = request.pairs.partition(":")
    check_available(name, split or "train", request.data_dir)
    records = load_records(name, split or "train", request.data_dir)
    if not records:
        raise DataError(f"{request.pairs}: no records")
    anchor, positive = TEXT_FIELDS[type(records[0])][:2]
    return [getattr(r, anchor) for r in records], [getattr(r, positive) for r in records]


def _rows(path: Path, column: str):
    return (row for source in open_corpus(str(path), column) for row in source.rows())


def _text(path: Path, row: int, text: str, column: str) -> str:
    """A pair's text; a blank one is refused as training refuses it, naming the file and row."""
    if not (text or "").strip():
        raise DataError(f"{path}, row {row + 1}: column {column!r} is empty")
    return text


def _check_corpus(request: MineRequest) -> list[CorpusSource] | RemoteCorpus | None:
    """The separate corpus, checked and not read yet: a local file's or dataset's sources, a remote prefix, or None."""
    if request.corpus is None:
        if request.corpus_column:
            raise ConfigError("--corpus-column needs --corpus")
        return None
    if is_remote(request.corpus):
        return check_remote_corpus(request.corpus, request.corpus_column)
    return open_corpus(request.corpus, request.corpus_column, request.data_dir)


def _corpus_blocks(
    request: MineRequest, corpus: list[CorpusSource] | RemoteCorpus | None, positives: list[str]
) -> Iterator[tuple[ray.ObjectRef, str]]:
    """The corpus's texts, then the positives, as blocks in Ray's object store (``StoredCorpus.store``), each with
    where it was read from: a remote corpus read by Ray Data on the cluster, a local one put a read at a time."""
    if isinstance(corpus, RemoteCorpus):
        yield from ((block, corpus.uri) for block in corpus.blocks())
    for source in corpus if isinstance(corpus, list) else ():
        yield from ((ray.put(table.select(["text"])), request.corpus) for table in source.tables(ROWS_PER_READ))
    for first in range(0, len(positives), ROWS_PER_READ):
        yield ray.put(pa.table({"text": positives[first : first + ROWS_PER_READ]})), request.pairs


# ------------------------------------------------------------------------------------------------ output folder


def _check_output_folder(output: Path, manifest: dict) -> None:
    """Before any Ray work: the folder is new, empty, or a mining output of ours (its manifest) with the same
    ``manifest`` keys, never another."""
    if output.is_file():
        raise ConfigError(f"--output {output} is a file, not a folder")
    _refuse_changes(output, manifest, owned_paths.recorded_settings(str(output), MANIFEST, _not_ours(output)))


def _not_ours(output: Path) -> str:
    return f"--output {output} exists and is not a mining output of sbert-ray (no {MANIFEST}): choose a new folder"


def _manifest(request: MineRequest, pairs: MiningPairs | None = None, corpus: StoredCorpus | None = None) -> dict:
    """What the shards depend on: the model, the inputs, the settings, the sharding; with the data read (``pairs``
    over the stored ``corpus``), a digest of it and its sizes."""
    manifest = {
        "model": request.model_ref,
        "pairs": request.pairs,
        "corpus": request.corpus,
        "settings": asdict(request.settings),
        "shard_size": request.shard_size,
        "approximate": request.approximate,
        # HNSW searches each chunk apart, so its negatives depend on where the chunks end; the exact search's do not.
        "corpus_chunk": request.corpus_chunk if request.approximate else None,
        "rescore_with": request.rescore_with,
    }
    if pairs is None:
        return manifest
    digest = hashlib.sha256(corpus.digest.encode())
    for part in (pairs.queries, pairs.positives):
        for item in part:
            digest.update(json.dumps(item).encode() + b"\n")
    return {**manifest, "data_digest": digest.hexdigest(), "anchors": len(pairs.queries), "corpus_size": len(corpus)}


def _claim_output_folder(output: Path, manifest: dict) -> None:
    """Write the manifest into a new folder, or check that an existing one was mined the same way (a rerun then
    resumes: shards already there are kept)."""
    _refuse_changes(output, manifest, owned_paths.claim_output(str(output), MANIFEST, manifest, _not_ours(output)))


def _refuse_changes(output: Path, manifest: dict, recorded: dict | None) -> None:
    """Shards of other data or settings than ``recorded`` (None: a new folder) would mix: refused, naming the keys."""
    changed = sorted(key for key in manifest if recorded is not None and manifest[key] != recorded.get(key))
    if changed:
        raise ConfigError(
            f"--output {output} holds shards mined with other {', '.join(changed)} ({MANIFEST}); choose a new "
            "folder, or rerun with the same inputs and settings to resume"
        )
