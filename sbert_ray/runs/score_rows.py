"""``sbert-ray score``: a teacher's scores of (query, passage) pairs or mined n-tuples, with Ray Data: one parquet file
per input file holding its rows and their scores (``score``, or ``score_positive``, ``score_negative_1``...), in a
local folder or under an object storage prefix.

    input checked: every file readable, with the query and passage columns and a first row   (no Ray yet)
      -> the teacher loaded once (a cross-encoder folder or a bi-encoder; anything else refused)
      -> the output claimed, files already written skipped, one read task per file (``runs.per_file``)
      -> score: map_batches on an actor pool, a teacher per actor (one GPU each with --device cuda)
      -> each input file's rows written, joined and moved in whole (``runs.per_file``)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import ray
import ray.data
import torch

from sbert_ray.config import RESOURCE_WAIT_S
from sbert_ray.data.score_inputs import ScoreFile, ScoreLayout, open_score_inputs
from sbert_ray.models.load import one_tokenizer_thread
from sbert_ray.models.teachers import Teacher, load_teacher
from sbert_ray.runs import per_file
from sbert_ray.runs.cluster import input_errors_unwrapped

BLOCK_BYTES = 1 << 20  # rows read into one block, scored in one call
SCORE_MARKER = "_sbert_ray_score.json"  # marks an output folder as ours, with the settings its scores were made with
TAGS = per_file.WHOLE_ROW_TAGS  # the input's own columns go to the output unchanged


@dataclass
class ScoreResult:
    output: str
    rows: int  # written by this run
    teacher: str  # cross-encoder or bi-encoder
    score_columns: tuple[str, ...]
    seconds: float
    files_written: int
    files_skipped: int  # complete from an earlier run


@dataclass(frozen=True)
class ScoreRequest:
    """Which rows ``sbert-ray score`` scores (``input_spec``: a file, folder, glob or object storage prefix of tables)
    with which teacher, on how many replicas (one GPU each with a cuda ``device``, or by default when the cluster has
    GPUs), into which folder or object storage prefix (created, or resumed: input files whose output is there are
    skipped)."""

    model_ref: str
    input_spec: str
    output: str | os.PathLike
    query_column: str | None = None
    passage_column: str | None = None
    batch_size: int = 32
    workers: int = 1
    device: str | None = None
    block_bytes: int = BLOCK_BYTES
    resource_wait_s: float = RESOURCE_WAIT_S  # for the replicas' CPUs/GPUs while other work holds them

    def __post_init__(self) -> None:
        per_file.check_request(self.batch_size, self.workers, self.device, self.output, "scoring")


@input_errors_unwrapped()  # a bad row midway is found in a read task
def score_rows(request: ScoreRequest) -> ScoreResult:
    """Score every row of the request's input into one parquet file per input file under ``request.output``; input
    files whose output is already there are skipped."""
    output = per_file.Output.of(request.output)
    sources = open_score_inputs(request.input_spec, request.query_column, request.passage_column)
    teacher = load_teacher(request.model_ref)
    per_file.claim(output, SCORE_MARKER, _settings(request), "score", "scores")
    pending = per_file.not_written(sources, output)
    rows, seconds = per_file.run(request, pending, output, functools.partial(_pipeline, request, pending, teacher))
    layout = sources[0].layout
    return ScoreResult(
        output.uri, rows, teacher.kind, layout.score_columns, seconds, len(pending), len(sources) - len(pending)
    )


def _settings(request: ScoreRequest) -> dict[str, str | None]:
    """What decides the scores of an output: a rerun into the same output must have the same."""
    return {
        "model": per_file.model_setting(request.model_ref),
        "query_column": request.query_column,
        "passage_column": request.passage_column,
    }


def _pipeline(
    request: ScoreRequest, sources: list[ScoreFile], teacher: Teacher, use_gpu: bool, placement: per_file.Placement
) -> ray.data.Dataset:
    rows = per_file.read_files(
        sources, lambda source: source.tables(per_file.ROWS_PER_READ, TAGS.row), TAGS, request.block_bytes, placement
    )
    scored = rows.map_batches(
        _ScoreRows,
        fn_constructor_args=(ray.put(teacher), "cuda" if use_gpu else "cpu", sources[0].layout, request.batch_size),
        batch_size=None,  # a whole block per call: the teacher sorts its pairs by length and batches them
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=request.workers),
        num_cpus=1,
        num_gpus=1 if use_gpu else 0,
    )
    return per_file.write_parts(scored, TAGS, placement)


class _ScoreRows:
    """Adds the teacher's score columns to a block of rows."""

    def __init__(self, teacher: ray.ObjectRef, device: str, layout: ScoreLayout, batch_size: int):
        torch.set_num_threads(1)  # the actor's one CPU
        one_tokenizer_thread()  # the teacher tokenises each block's pairs
        self.teacher, self.layout, self.batch_size = ray.get(teacher).to(device), layout, batch_size

    def __call__(self, rows: pa.Table) -> pa.Table:
        return with_scores(self.teacher, rows, self.layout, self.batch_size)


def with_scores(teacher: Teacher, rows: pa.Table, layout: ScoreLayout, batch_size: int) -> pa.Table:
    """``rows`` with the teacher's score of each (query, passage column) pair appended, as float32 columns
    named by ``layout.score_columns``; every pair of the block is scored in one call."""
    queries = rows.column(layout.query).to_pylist()
    passages = [rows.column(column).to_pylist() for column in layout.passages]
    scores = np.asarray(teacher.score(queries, passages, batch_size), dtype=np.float32)
    for name, column_scores in zip(layout.score_columns, scores, strict=True):
        rows = rows.append_column(name, pa.array(column_scores, pa.float32()))
    return rows
