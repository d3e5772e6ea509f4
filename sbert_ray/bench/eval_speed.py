"""Evaluation throughput over Ray workers: ``sbert-ray bench eval``.

The same tasks (``--tasks``, as ``sbert-ray eval`` takes them) are scored by the encoder in this process, by the
encoder pool (``RayEncoder``: what ``eval --workers N`` runs) at each worker count, and, for STS tasks, by
sentence-transformers' ``EmbeddingSimilarityEvaluator`` in one process on the same model. A layout's actors are
started and hold the model before its clock starts (their start-up is reported apart); each repeat then times the
whole scoring: tokenising and cutting batches on the driver, encoding on the workers, the metrics on the driver.
Layouts run one after another (a 2-core machine cannot hold them all at once), so each record keeps the spread of
its repeats. Records: seconds (median), texts encoded per second, speed-up over one worker, scaling efficiency
(rate at N / (N x rate at one worker)), and the primary scores, which the pool must give equal to one process's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sbert_ray.evaluation.tasks import EvalTasks, Results, StsTask, parse_tasks
from sbert_ray.models import SentenceEncoder

OURS, REFERENCE = "sbert-ray", "sentence-transformers"
COLUMNS = (  # (header, record key, format) for bench.tables.format_table
    ("impl", "impl", "{}"),
    ("workers", "workers", "{}"),
    ("threads", "threads_per_worker", "{}"),
    ("start s", "start_s", "{:.1f}"),
    ("score s", "seconds", "{:.2f}"),
    ("spread", "spread", "{:.0%}"),
    ("texts/s", "texts_per_s", "{:.0f}"),
    ("x 1 worker", "speedup_vs_one_worker", "{:.2f}"),
    ("efficiency", "scaling_efficiency", "{:.0%}"),
    ("x ST", "speedup_vs_reference", "{:.2f}"),
    ("= 1 process", "scores_equal_one_process", "{}"),
    ("primary", "primary_mean", "{:.2f}"),
)
LOGGED_METRICS = (
    "seconds",
    "texts_per_s",
    "speedup_vs_one_worker",
    "scaling_efficiency",
    "speedup_vs_reference",
    "primary_mean",
    "start_s",
)


@dataclass(frozen=True)
class EvalBenchSettings:
    model: str
    tasks: str = "stsb"
    data_dir: str | None = None
    batch_size: int = 64
    threads_per_worker: int = 1  # torch threads of each Ray worker, and of the one-process rows


def record_name(record: dict) -> str:
    return f"{record['impl']}/workers{record['workers']}"


@dataclass(frozen=True)
class EvalBench:
    """The tasks (their data checked) and the model, loaded before Ray starts: bad input fails here."""

    settings: EvalBenchSettings
    tasks: EvalTasks
    encoder: SentenceEncoder

    @classmethod
    def load(cls, settings: EvalBenchSettings) -> EvalBench:
        tasks = parse_tasks(settings.tasks)
        tasks.check(settings.data_dir)
        return cls(settings, tasks, SentenceEncoder.load(settings.model))

    def run(
        self,
        workers: Sequence[int],
        repeats: int = 3,
        reference: bool = True,
        progress: Callable[[str], None] = lambda line: None,
    ) -> list[dict]:
        """One record per layout: this process (``workers`` 0 in the record: no Ray), each Ray worker count, and
        sentence-transformers where it has an evaluator for every task."""
        from sbert_ray.evaluation.encoder_pool import RayEncoder

        settings, tasks, encoder = self.settings, self.tasks, self.encoder
        with _threads(settings.threads_per_worker):
            texts = _texts_encoded(encoder, tasks, settings)  # also warms the tokenizer and the data caches
            records = [_record(OURS, 0, settings, _timed(lambda: _score(encoder, tasks, settings), repeats), texts, 0)]
        progress(f"one process: {records[-1]['seconds']:.2f} s")
        for count in workers:
            start = time.perf_counter()
            with RayEncoder(encoder, count, cpus_per_worker=settings.threads_per_worker) as pool:
                pool.encode(["warm up"] * count, batch_size=1)  # a batch each: every actor has loaded the model
                start_s = time.perf_counter() - start
                timed = _timed(lambda pool=pool: _score(pool, tasks, settings), repeats)
            records.append(_record(OURS, count, settings, timed, texts, start_s))
            progress(f"{count} Ray worker(s): {records[-1]['seconds']:.2f} s (start-up {start_s:.1f} s)")
        if reference:
            records.append(_reference_record(settings, tasks, texts, repeats))
        return _compared(records, tasks)


def _score(model, tasks: EvalTasks, settings: EvalBenchSettings) -> Results:
    results: Results = {}
    for task in tasks:
        results |= task.run(model, settings.data_dir, settings.batch_size)
    return results


def _texts_encoded(encoder: SentenceEncoder, tasks: EvalTasks, settings: EvalBenchSettings) -> int:
    """How many texts one scoring of ``tasks`` encodes (the same work in every layout), counted in this process."""
    counted = 0
    encode = encoder.encode

    def counting(sentences, *args, **kwargs):
        nonlocal counted
        counted += len(sentences)
        return encode(sentences, *args, **kwargs)

    encoder.encode = counting  # on the instance: the tasks see the same object (isinstance, attributes)
    try:
        _score(encoder, tasks, settings)
    finally:
        del encoder.encode
    return counted


def _timed(score: Callable[[], Results], repeats: int) -> tuple[list[float], Results]:
    seconds, results = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        results = score()
        seconds.append(time.perf_counter() - start)
    return seconds, results


def _record(impl: str, workers: int, settings, timed, texts: int, start_s: float | None) -> dict:
    seconds, results = timed
    median = statistics.median(seconds)
    return {
        "impl": impl,
        "workers": workers,
        "threads_per_worker": settings.threads_per_worker,
        "start_s": start_s,
        "seconds": median,
        "spread": (max(seconds) - min(seconds)) / median,
        "texts": texts,
        "texts_per_s": texts / median,
        "results": results,
    }


def _reference_record(settings: EvalBenchSettings, tasks: EvalTasks, texts: int, repeats: int) -> dict:
    """sentence-transformers' EmbeddingSimilarityEvaluator per STS dataset, in this process; a record with
    ``skipped`` where a task has no such evaluator here."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from sbert_ray.models.resolve import resolve_model_ref

    others = [task.spec for task in tasks if not isinstance(task, StsTask)]
    if others:
        return {"impl": REFERENCE, "workers": 0, "skipped": f"no sentence-transformers evaluator compared for {others}"}
    model = SentenceTransformer(str(resolve_model_ref(settings.model)), device="cpu", trust_remote_code=False)
    evaluators = {
        name: EmbeddingSimilarityEvaluator(
            [p.sentence1 for p in pairs], [p.sentence2 for p in pairs], [p.score for p in pairs]
        )
        for task in tasks
        for name, pairs in _sts_pairs(task, settings.data_dir).items()
    }

    def score() -> Results:
        return {
            f"{name}/spearman_cosine": 100 * evaluator(model)["spearman_cosine"]
            for name, evaluator in evaluators.items()
        }

    with _threads(settings.threads_per_worker):
        return _record(REFERENCE, 0, settings, _timed(score, repeats), texts, start_s=None)


def _sts_pairs(task: StsTask, data_dir) -> dict[str, list]:
    """Each dataset's scored pairs as our STS suite scores them (a year's subsets concatenated)."""
    from sbert_ray.data import load_records, load_sts_subsets
    from sbert_ray.evaluation.sts import STS_YEARS, sts_split

    return {
        name: [p for subset in load_sts_subsets(name, data_dir).values() for p in subset]
        if name in STS_YEARS
        else load_records(name, sts_split(name, data_dir), data_dir)
        for name in task.datasets
    }


def _compared(records: list[dict], tasks: EvalTasks) -> list[dict]:
    """Each record's primary scores (their mean too); for ours, whether its results equal this process's exactly,
    the speed-up over the one-worker Ray layout (else this process), the scaling efficiency and the speed-up over
    sentence-transformers' evaluator."""
    one_process = records[0]["results"]
    ours = [r for r in records if r["impl"] == OURS]
    base = next((r for r in ours if r["workers"] == 1), ours[0])
    reference = next((r for r in records if r["impl"] == REFERENCE and not r.get("skipped")), None)
    for record in records:
        if record.get("skipped"):
            continue
        results = record.pop("results")
        record["primary"] = {
            f"{entry}/{task.primary_metric}": score
            for task in tasks
            for entry, score in task.primary_scores(results).items()
        }
        record["primary_mean"] = statistics.fmean(record["primary"].values())
        if record["impl"] == OURS:
            record["scores_equal_one_process"] = results == one_process
            record["speedup_vs_one_worker"] = base["seconds"] / record["seconds"]
            workers = record["workers"]
            record["scaling_efficiency"] = record["speedup_vs_one_worker"] / workers if workers else None
            record["speedup_vs_reference"] = reference["seconds"] / record["seconds"] if reference else None
    return records


@contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
