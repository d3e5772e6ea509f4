"""``sbert-ray encode``: embed a corpus of any size with Ray Data: one parquet file of (file, id, text, vector) per
input file, in a local folder or under an object storage prefix.

    input checked: every file readable, with the column and a first row (or the dataset is there)   (no Ray yet)
      -> the output claimed, files already written skipped, one read task per file (``runs.per_file``)
      -> model loaded once; a CPU copy in the object store; the replicas checked against the cluster's nodes
      -> tokenise: a CPU map_batches stage (token ids per row), so the replicas only run the model
      -> encode: map_batches on an actor pool, an EncoderReplica per actor (one GPU each with --device cuda);
         each block is cut into batches by a token budget (SentenceEncoder.encode_token_ids)
      -> each input file's rows written, joined and moved in whole (``runs.per_file``)

A row is ``(file, id)``: the input file's key (its path under the folder, prefix or glob; see
``sbert_ray.data.corpus``) and its 0-based row within that file. With ``keep_columns`` a row of a table file is
instead written with every column it has, the vector beside them: e.g. a translation beside the text a teacher
embedded, which objective ``mse`` trains a student on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pyarrow as pa
import ray
import ray.data

from sbert_ray.config import RESOURCE_WAIT_S, ConfigError
from sbert_ray.data.corpus import (
    DEFAULT_COLUMN,
    SCHEMA,
    TABLE_SUFFIXES,
    CorpusFile,
    CorpusSource,
    open_corpus,
    table_rows,
)
from sbert_ray.data.records import DataError
from sbert_ray.evaluation.encoder_pool import EncoderReplica, shareable
from sbert_ray.models import load_encoder
from sbert_ray.models.encoder import token_ids
from sbert_ray.models.load import one_tokenizer_thread
from sbert_ray.runs import per_file
from sbert_ray.runs.cluster import input_errors_unwrapped

BLOCK_BYTES = 1 << 20  # rows read into one block (~10k sentences), encoded (cut by the token budget) in one call
ENCODE_MARKER = "_sbert_ray_encode.json"  # marks an output folder as ours, with the settings its vectors were made with
TAGS = per_file.RowTags("file", "id", "last", kept=("file", "id"))
READ_SCHEMA = pa.schema([("file", pa.string()), *SCHEMA, ("last", pa.bool_())])


@dataclass
class EncodeResult:
    output: str
    rows: int  # written by this run
    dimension: int
    seconds: float
    files_written: int
    files_skipped: int  # complete from an earlier run


@dataclass(frozen=True)
class EncodeRequest:
    """What ``sbert-ray encode`` embeds (``input_spec``, see ``sbert_ray.data.corpus``), with which model and how many
    replicas (one GPU each with a cuda ``device``, or by default when the cluster has GPUs), into which folder or
    object storage prefix (created, or resumed: input files whose output is there are skipped)."""

    model_ref: str
    input_spec: str
    output: str | os.PathLike
    column: str | None = None
    batch_size: int = 32
    workers: int = 1
    device: str | None = None
    data_dir: str | os.PathLike | None = None
    block_bytes: int = BLOCK_BYTES
    prompt_name: str | None = None  # one of the model's prompts, put before every text; None: its default, if any
    keep_columns: bool = False  # table files: every column of a row goes out beside its vector (no file, id)
    resource_wait_s: float = RESOURCE_WAIT_S  # for the replicas' CPUs/GPUs while other work holds them

    def __post_init__(self) -> None:
        per_file.check_request(self.batch_size, self.workers, self.device, self.output, "encoding")


@input_errors_unwrapped()  # a bad row midway is found in a read task
def encode_corpus(request: EncodeRequest) -> EncodeResult:
    """Embed every row of the request's input into one parquet file per input file under ``request.output``;
    input files whose output is already there are skipped."""
    output = per_file.Output.of(request.output)
    sources = open_corpus(request.input_spec, request.column, request.data_dir)
    if request.keep_columns:
        _check_whole_rows(sources)
    encoder = load_encoder(request.model_ref)
    try:
        prompt = encoder.resolve_prompt(prompt_name=request.prompt_name)
    except ValueError as error:
        raise ConfigError(f"--prompt-name: {error}") from None
    per_file.claim(output, ENCODE_MARKER, _settings(request), "encode", "embeddings")
    pending = per_file.not_written(sources, output)
    rows, seconds = per_file.run(
        request, pending, output, functools.partial(_pipeline, request, pending, encoder, prompt)
    )
    return EncodeResult(output.uri, rows, encoder.embedding_dim, seconds, len(pending), len(sources) - len(pending))


def _check_whole_rows(sources: list[CorpusSource]) -> None:
    """``keep_columns`` keeps a table's columns: a text file or a dataset has none, and a ``vector`` column would be
    overwritten."""
    for source in sources:
        if not isinstance(source, CorpusFile) or source.suffix not in TABLE_SUFFIXES:
            where = source.uri if isinstance(source, CorpusFile) else source.key
            raise DataError(f"{where}: --keep-columns keeps the columns of table files ({', '.join(TABLE_SUFFIXES)})")
        if "vector" in next(table_rows(source.uri, 1)).column_names:
            raise DataError(f"{source.uri}: already has a column 'vector', where the embeddings would go")


def _settings(request: EncodeRequest) -> dict[str, str | bool | None]:
    """What decides the vectors of an output: a rerun into the same output must have the same. keep_columns only
    where set, so an output written before the option existed is still resumed."""
    model = per_file.model_setting(request.model_ref)
    kept = {"keep_columns": True} if request.keep_columns else {}
    return {"model": model, "column": request.column, "prompt_name": request.prompt_name, **kept}


def _pipeline(
    request: EncodeRequest,
    sources: list[CorpusSource],
    encoder,
    prompt: str,
    use_gpu: bool,
    placement: per_file.Placement,
) -> ray.data.Dataset:
    keep = request.keep_columns
    tags = per_file.WHOLE_ROW_TAGS if keep else TAGS
    rows = per_file.read_files(
        sources,
        lambda source: (
            source.whole_rows(per_file.ROWS_PER_READ, tags.row) if keep else source.tables(per_file.ROWS_PER_READ)
        ),
        tags,
        request.block_bytes,
        placement,
        None if keep else READ_SCHEMA,
    )
    # Tokenising takes no CPU from the actors (on a full cluster they would wait on each other); with GPU replicas
    # the actors hold one CPU each and tokenising gets one of the others per task.
    tokenized = rows.map_batches(
        _tokenize,
        fn_kwargs={
            "tokenizer": encoder.tokenizer,
            "max_length": encoder.max_seq_length,
            "prompt": prompt,
            "text": request.column or DEFAULT_COLUMN if keep else "text",  # the input's column, or the corpus's
        },
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=1 if use_gpu else 0,
    )
    embedded = tokenized.map_batches(
        _EmbedRows,
        fn_constructor_args=(
            shareable(encoder),
            "cuda" if use_gpu else "cpu",
            request.batch_size,
            encoder.prompt_length(prompt),
        ),
        batch_size=None,  # a whole block per call: its rows are sorted by length and cut by the token budget
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=request.workers),
        num_cpus=1,
        num_gpus=1 if use_gpu else 0,
    )
    return per_file.write_parts(embedded, tags, placement)


def _tokenize(rows: pa.Table, tokenizer, max_length: int, prompt: str, text: str) -> pa.Table:
    """Token ids of each row's column ``text``, the prompt before it."""
    one_tokenizer_thread()
    texts = [prompt + value for value in rows.column(text).to_pylist()]
    for name, ids in token_ids(tokenizer, texts, max_length).items():
        rows = rows.append_column(name, pa.array(ids, pa.list_(pa.int32())))
    return rows


class _EmbedRows(EncoderReplica):
    """Replaces the token ids of a block of rows by each row's vector."""

    def __init__(self, encoder: ray.ObjectRef, device: str, batch_size: int, prompt_length: int):
        super().__init__(encoder, device, threads=1)
        self.batch_size, self.prompt_length = batch_size, prompt_length

    def __call__(self, rows: pa.Table) -> pa.Table:
        names = [name for name in ("input_ids", "token_type_ids") if name in rows.column_names]
        ids = {name: rows.column(name).to_pylist() for name in names}
        vectors = self.encode_token_ids(ids, self.batch_size, self.prompt_length)
        vector = pa.FixedSizeListArray.from_arrays(vectors.reshape(-1), vectors.shape[1])
        return rows.drop_columns(names).append_column("vector", vector)
