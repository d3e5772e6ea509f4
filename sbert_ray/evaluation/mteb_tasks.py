"""``mteb:<Task>[,<Task>...]`` and ``mteb:<benchmark>``: the ``mteb`` library's own tasks (its data, splits,
evaluators and main scores) run on an sbert-ray model through ``mteb.evaluate``, its encoding done by whatever
encoder sbert-ray gives tasks (``eval --workers N``: the Ray encoder pool).

Results are mteb's: its TaskResult files under ``<folder>/results/<model>/<fingerprint>/<Task>.json`` (mteb's own
cache layout, which ``mteb.ResultCache(<folder>)`` reads back), and our flat ``<Task>/<metric>`` numbers on mteb's
scale (0-1, where our STS tasks say x100). A task whose result file exists for the model is read, not run again; its
embeddings are kept under ``<folder>/embeddings/<model>/<fingerprint>/`` (mteb's ``CachedEmbeddingWrapper``), so a
task run again (its result file removed, a new mteb version) encodes nothing it encoded before.

Data comes from the Hub, or from a copy of each data set's repository under SBERT_RAY_HUB_MIRROR
(``<mirror>/mteb/stsbenchmark-sts``), as for every other Hub data set (``data.hub``). mteb is imported only here.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sbert_ray.config import ConfigError
from sbert_ray.data.hub import hub_reachable, mirror_copies_cached_apart, mirror_folder
from sbert_ray.data.records import DataError
from sbert_ray.evaluation.mteb_encoder import MtebEncoder, model_fingerprint
from sbert_ray.evaluation.task_contract import EvalTask, Results

DEFAULT_MTEB_DIR = Path("~/sbert-ray/mteb")


@dataclass(frozen=True)
class MtebOutput:
    """Where mteb's result files and the embedding cache go, and the ``organization/model`` name they are filed
    under (``mteb_encoder.mteb_model_name``)."""

    folder: Path = DEFAULT_MTEB_DIR
    model_name: str = "local/model"

    @property
    def model_results(self) -> Path:
        """The folder of the model's result files, one subfolder per fingerprint (mteb's ``ResultCache`` layout:
        ``results/<name with / as __>/<revision>/<Task>.json``)."""
        return self.folder.expanduser() / "results" / self.model_name.replace("/", "__").replace(" ", "_")


class MtebTask(EvalTask):
    """The mteb tasks and benchmarks named after ``mteb:``; one entry per mteb task (its name), its ``main_score``
    at the top level; the other metrics beside it, or under ``<split>/<subset>/`` when it has several."""

    primary_metric = "main_score"

    def __init__(self, spec: str, argument: str) -> None:
        super().__init__(spec)
        names = split_names(argument)
        if not names:
            raise ConfigError("task 'mteb' needs mteb task or benchmark names, e.g. mteb:STSBenchmark")
        tasks = [task for name in names for task in resolve(name)]
        self.tasks = tuple({task.metadata.name: task for task in tasks}.values())  # each once, in order

    def entries(self) -> tuple[str, ...]:
        return tuple(task.metadata.name for task in self.tasks)

    def metric_names(self) -> tuple[str, ...]:
        return ("main_score",)

    def check(self, data_dir=None) -> None:
        from datasets import config as datasets_config

        for task in self.tasks:
            for repo, name in data_sets(task):
                if mirror_folder(repo, name) is None and not (datasets_config.HF_HUB_OFFLINE or hub_reachable()):
                    raise DataError(
                        f"mteb task {name} reads {repo} from the Hugging Face Hub, which is unreachable; set "
                        "SBERT_RAY_HUB_MIRROR to a local copy of the Hub data sets, or HF_HUB_OFFLINE=1 to read the "
                        "datasets cache"
                    )

    def run(self, model, data_dir=None, batch_size: int = 64, output: MtebOutput | None = None) -> Results:
        import mteb
        from mteb.models.cache_wrappers import CachedEmbeddingWrapper

        output = output or MtebOutput()
        if logging.getLogger("mteb").level == logging.NOTSET:  # mteb logs each load and cache save at INFO
            logging.getLogger("mteb").setLevel(logging.WARNING)
        folder = output.folder.expanduser()
        encoder = MtebEncoder(model, output.model_name, model_fingerprint(model))
        meta = encoder.mteb_model_meta
        cached = CachedEmbeddingWrapper(encoder, folder / "embeddings" / output.model_results.name / encoder.revision)
        files = mteb.ResultCache(folder)
        try:
            with warnings.catch_warnings(), local_data(self.tasks) as tasks:
                # one warning per repeated text (STSb repeats many): the cache keeps one vector for them
                warnings.filterwarnings("ignore", "Hash collision or duplicate item", UserWarning)
                mteb.evaluate(
                    cached,
                    tasks,
                    cache=files,
                    overwrite_strategy="only-missing",  # a task with a result file is read, not run
                    encode_kwargs={"batch_size": batch_size},
                    show_progress_bar=False,
                    co2_tracker=False,
                )
        finally:
            cached.close()
        # Numbers as the result files hold them (mteb rounds to 6 decimals there): a task scored now and one read
        # back in a later run give the same numbers.
        return {
            key: value
            for task in self.tasks
            for key, value in flat_scores(files.load_task_result(task.metadata.name, meta)).items()
        }


def split_names(argument: str) -> list[str]:
    """Task and benchmark names from ``mteb:``'s argument, split at commas outside parentheses (a benchmark name
    such as ``MTEB(eng, v2)`` holds one)."""
    return [name.strip() for name in re.split(r",(?![^()]*\))", argument) if name.strip()]


def resolve(name: str) -> list:
    """The mteb task objects a name stands for: one task, or a benchmark's tasks (as the benchmark selects their
    splits and languages). Benchmark names match without their spaces (``MTEB(eng,v2)``: the task list splits
    at commas and strips each part). A ConfigError naming ``name``, with mteb's suggestion, otherwise."""
    import mteb

    try:
        return [mteb.get_task(name)]
    except KeyError as error:
        unknown_task = str(error.args[0] if error.args else error)
    compact = re.sub(r"\s", "", name)
    for benchmark in mteb.get_benchmarks():
        if re.sub(r"\s", "", benchmark.name) == compact:
            return list(benchmark.tasks)
    raise ConfigError(f"unknown mteb task or benchmark {name!r} ({unknown_task.removeprefix('KeyError: ')})")


def data_sets(task) -> Iterator[tuple[str, str]]:
    """(Hub repository, task name) of each data set a task reads; an aggregate task reads its parts'."""
    parts = getattr(task.metadata, "tasks", None)
    if parts:
        for part in parts:
            yield from data_sets(part)
    else:
        yield task.metadata.dataset["path"], task.metadata.name


@contextlib.contextmanager
def local_data(tasks: Sequence) -> Iterator[list]:
    """The tasks reading their data sets' copies under SBERT_RAY_HUB_MIRROR (``with_local_data``), for as long as
    they load: datasets caches the copies apart (``hub.mirror_copies_cached_apart``), as mteb's retrieval loader
    gives ``load_dataset`` no cache folder of a copy's own."""
    tasks = [with_local_data(task) for task in tasks]
    copies = [Path(path) for task in tasks for path, _ in data_sets(task) if Path(path).is_absolute()]
    with mirror_copies_cached_apart(copies):
        yield tasks


def with_local_data(task):
    """``task`` reading each data set from its copy under SBERT_RAY_HUB_MIRROR, when that is set: mteb passes
    ``metadata.dataset`` to ``datasets.load_dataset`` as it is, so its path becomes the copy's folder (the
    revision stays, as the result files record it). The task's own copy of its metadata changes, not the class's."""
    for part in getattr(task.metadata, "tasks", None) or ():
        with_local_data(part)
    dataset = task.metadata.dataset
    if not dataset or Path(dataset["path"]).is_absolute():  # an aggregate, or its copy already
        return task
    folder = mirror_folder(dataset["path"], task.metadata.name)
    if folder is not None:
        local = {**dataset, "path": str(Path(folder).resolve())}
        task.metadata = task.metadata.model_copy(update={"dataset": local})
    return task


def flat_scores(result) -> Results:
    """A TaskResult as ``{"<Task>/<metric>": value}``: ``main_score`` (mteb's score of the task over its splits
    and subsets), then every number mteb reports, under ``<split>/<subset>/`` when there are several of them."""
    cells = [(split, scores) for split, subsets in result.scores.items() for scores in subsets]
    flat = {f"{result.task_name}/main_score": float(result.get_score())}
    for split, scores in cells:
        prefix = result.task_name if len(cells) == 1 else f"{result.task_name}/{split}/{scores['hf_subset']}"
        numbers = {key: value for key, value in scores.items() if isinstance(value, int | float)}
        flat |= {f"{prefix}/{key}": float(value) for key, value in numbers.items() if not isinstance(value, bool)}
    return flat
