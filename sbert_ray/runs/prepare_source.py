"""``sbert-ray prepare``: a training source tokenised once, into shards that training reads as they are
(``data.prepared``), with Ray Data.

    input checked: the source's files listed, parquet footers checked, the first file's first rows read as
    training reads them (a missing file or column is named here); the objective and the tokenizer loaded    (no Ray)
      -> the output claimed (a rerun must use the same settings), shards already written skipped (``runs.per_file``)
      -> read: one task per input file, its examples as training reads them (``training.sources.read_tables``)
      -> tokenise: an actor pool of ``workers`` tokenizers, what the training stream's map stage computes
         (``training.batches.tokenize_table``)
      -> each input file's rows joined into one shard ``OUTPUT/KEY.parquet`` in row groups of ``rows_per_group``
      -> ``manifest.json`` written last, whole or not at all, from every shard's footer: a folder without one is
         incomplete, and a run that resumes first removes it
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import posixpath
from dataclasses import dataclass
from importlib import metadata

import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from pyarrow import fs

from sbert_ray.config import RESOURCE_WAIT_S, ConfigError, StageConfig
from sbert_ray.data.prepared import MANIFEST, PREPARE_MARKER, Manifest, Shard, prepared_settings
from sbert_ray.data.records import DataError
from sbert_ray.losses.registry import OBJECTIVES
from sbert_ray.models.load import load_tokenizer, one_tokenizer_thread
from sbert_ray.models.model_type import ModelType
from sbert_ray.runs import per_file
from sbert_ray.runs.cluster import input_errors_unwrapped
from sbert_ray.runs.owned_paths import filesystem_of, write_marker
from sbert_ray.training.batches import tokenize_table
from sbert_ray.training.sources import Source, column_roles, is_path, known_rows, read_tables, reading, source_of

ROWS_PER_GROUP = 8192  # as the stream's tables (training.sources.ROWS_PER_TABLE)
BLOCK_BYTES = 1 << 20  # rows read into one block: the actors share a file's blocks
TAGS = per_file.WHOLE_ROW_TAGS  # dropped from the shards: they hold the tokenised columns only


@dataclass(frozen=True)
class PrepareRequest:
    """What ``sbert-ray prepare`` tokenises (``source``: a file, folder, glob, object storage prefix or Hub dataset's
    files, read as a stage of ``objective`` reads them), with which tokenizer (the model's, ``max_seq_length``,
    ``prompts``: None, the model's own), into which folder or prefix (created, or resumed). A reranker's objective
    (``reranker_*``) tokenises each row's anchor with each other text as one text pair, as its training does."""

    source: str
    model: str
    max_seq_length: int
    output: str | os.PathLike
    prompts: dict[str, str] | None = None
    objective: str = "regression"
    columns: dict[str, str] | None = None  # field -> the input's column, as a stage's `columns`
    score_max: float = 5.0
    errors: str = "raise"
    rows_per_group: int = ROWS_PER_GROUP
    workers: int = 1  # tokenizer actors, one CPU each
    resource_wait_s: float = RESOURCE_WAIT_S
    device: str = "cpu"  # tokenising runs on CPUs (``per_file.run`` reserves the actors' resources)

    def __post_init__(self) -> None:
        per_file.check_request(1, self.workers, self.device, self.output, "tokenising")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective {self.objective!r}: not one of {', '.join(sorted(OBJECTIVES))}")
        for option, value in (("--max-seq-length", self.max_seq_length), ("--rows-per-group", self.rows_per_group)):
            if value < 1:
                raise ConfigError(f"{option} must be at least 1, got {value}")
        if self.model_type == "cross_encoder" and self.prompts is not None:
            raise ConfigError(f"--prompt: --objective {self.objective} trains a reranker, which takes no prompts")
        if not is_path(self.source):
            raise ConfigError(f"{self.source}: prepare reads files (a file, folder, glob, s3:// or hf://datasets/)")

    @property
    def model_type(self) -> ModelType:
        """The kind of model the objective trains, which decides how rows are tokenised."""
        return OBJECTIVES[self.objective].model_type

    @property
    def stage(self) -> StageConfig:
        """A stage that reads the source as training on it would."""
        return StageConfig(
            dataset=self.source,
            objective=self.objective,
            columns=self.columns,
            score_max=self.score_max,
            errors=self.errors,
        )


@dataclass(frozen=True)
class ShardInput:
    """One input file and the shard it becomes (``KEY.parquet`` under the output)."""

    uri: str  # a local absolute path or an object storage URI: per_file reads local input on the driver's node
    key: str


@dataclass
class PrepareResult:
    output: str
    rows: int  # written by this run
    seconds: float
    files_written: int
    files_skipped: int  # complete from an earlier run


@input_errors_unwrapped()  # a bad row midway is found in a read task
def prepare_source(request: PrepareRequest) -> PrepareResult:
    """Tokenise every input file of ``request.source`` into a shard under ``request.output`` that has none yet, then
    write the manifest of all of them."""
    output = per_file.Output.of(request.output)
    stage = request.stage
    source = source_of("SOURCE", request.source, stage.split, 1.0, request.columns)
    if source.manifest is not None:
        raise ConfigError(f"{request.source}: already prepared ({MANIFEST}); train on it as it is")
    _check_input(source, stage)
    tokens = load_tokenizer(request.model, request.max_seq_length, request.prompts, request.model_type)
    settings = prepared_settings(
        tokens.tokenizer, tokens.max_seq_length, tokens.prompts, reading(stage), tokens.joins_pairs
    )
    marked = {
        "source": request.source,
        "model": per_file.model_setting(request.model),
        "input_columns": request.columns or {},
        "rows_per_group": request.rows_per_group,
        **settings,
    }
    per_file.claim(output, PREPARE_MARKER, json.loads(json.dumps(marked)), "prepare", "tokenised shards")
    inputs = shard_inputs(source.files)
    pending = per_file.not_written(inputs, output)
    if pending:  # the folder is incomplete until its manifest lists every shard again
        _remove_manifest(output)
    model_json = json.dumps(
        {
            "name": request.model,
            "max_seq_length": tokens.max_seq_length,
            "prompts": request.prompts,
            "type": request.model_type,
        }
    )
    pipeline = functools.partial(_pipeline, request, source, stage, pending, model_json)
    rows, seconds = per_file.run(request, pending, output, pipeline, request.rows_per_group)
    shards = [_shard(output, item) for item in inputs]
    roles = column_roles(stage, sum(name.startswith("ids_") for name in _schema(output, inputs[0]).names))
    manifest = Manifest(
        output.uri, settings, request.source, marked["model"], marked["input_columns"], roles, request.rows_per_group,
        tuple(shards),
    )  # fmt: skip
    written_by = f"sbert-ray {metadata.version('sbert-ray')}"
    write_marker(output.uri, MANIFEST, {**manifest.to_json(), "written_by": written_by})
    return PrepareResult(output.uri, rows, seconds, len(pending), len(inputs) - len(pending))


def _check_input(source: Source, stage: StageConfig) -> None:
    """What can be checked before Ray: every parquet file's footer, and the first file's first rows as training
    reads them (its columns, its first values); a bad row further on is named by the read task that meets it."""
    try:
        known_rows(source, stage, None)
        if next(read_tables(source, source.files[0], stage, None), None) is None:
            raise DataError(f"{source.files[0]}: no examples for objective {stage.objective!r}")
    except DataError as err:
        raise ConfigError(f"{source.key}: {err}") from None


def shard_inputs(files: tuple[str, ...]) -> list[ShardInput]:
    """Each input file keyed by its path under the files' common folder, its suffix dropped (a source has one
    kind of file, so keys stay distinct): ``train/part-0.csv`` -> shard ``train/part-0.parquet``."""
    paths = [file.partition("://")[2] if "://" in file else file for file in files]
    base = posixpath.dirname(paths[0]) if len(paths) == 1 else posixpath.commonpath(paths)
    return [
        ShardInput(file, posixpath.splitext(posixpath.relpath(path, base))[0])
        for file, path in zip(files, paths, strict=True)
    ]


def _pipeline(
    request: PrepareRequest,
    source: Source,
    stage: StageConfig,
    pending: list[ShardInput],
    model_json: str,
    use_gpu: bool,
    placement: per_file.Placement,
) -> ray.data.Dataset:
    reading = dataclasses.replace(source, files=())  # what reading one file needs: every task carries it
    rows = per_file.read_files(pending, functools.partial(_input_tables, reading, stage), TAGS, BLOCK_BYTES, placement)
    tokenized = rows.map_batches(
        _Tokenize,
        fn_constructor_args=(model_json,),
        batch_size=None,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=request.workers),
        num_cpus=1,
    )
    return per_file.write_parts(tokenized, TAGS, placement)


def _input_tables(source: Source, stage: StageConfig, item: ShardInput):
    """An input file's examples as training reads them, each row tagged with its row in the file."""
    first = 0
    for table in read_tables(source, item.uri, stage, None):
        yield table.append_column(TAGS.row, pa.array(range(first, first + table.num_rows), pa.int64()))
        first += table.num_rows


class _Tokenize:
    """An actor's tokenizer: a block's examples as the training stream tokenises them, its row tags kept."""

    def __init__(self, model_json: str):
        one_tokenizer_thread()  # the actor's one CPU
        self.tokens = load_tokenizer(**json.loads(model_json))

    def __call__(self, rows: pa.Table) -> pa.Table:
        tokenized = tokenize_table(rows, self.tokens)
        for tag in (TAGS.file, TAGS.row, TAGS.last):
            tokenized = tokenized.append_column(tag, rows.column(tag))
        return tokenized


def _remove_manifest(output: per_file.Output) -> None:
    filesystem, root = filesystem_of(output.uri)
    if filesystem.get_file_info(f"{root}/{MANIFEST}").type == fs.FileType.File:
        filesystem.delete_file(f"{root}/{MANIFEST}")


def _shard(output: per_file.Output, item: ShardInput) -> Shard:
    """A written shard's rows per row group, from its footer."""
    parquet = _parquet(output, item)
    groups = tuple(parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups))
    return Shard(f"{item.key}.parquet", sum(groups), groups)


def _schema(output: per_file.Output, item: ShardInput) -> pa.Schema:
    return _parquet(output, item).schema_arrow


def _parquet(output: per_file.Output, item: ShardInput) -> pq.ParquetFile:
    filesystem, _ = filesystem_of(output.uri)
    return pq.ParquetFile(filesystem.open_input_file(output.file(item.key)))
