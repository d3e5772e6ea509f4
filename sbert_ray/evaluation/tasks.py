"""Evaluation tasks: what ``sbert-ray eval --tasks`` and ``evaluation.final_tasks`` name.

A task is a small object with a contract (``task_contract.EvalTask``): ``check(data_dir)`` says before any work
whether its data can be had, ``run(model, data_dir, batch_size)`` scores a model and returns a flat
``{"<entry>/<metric>": number}`` mapping (nested parts such as STS sub-sets or argument-similarity folds continue
the path: ``sts12/subsets/MSRpar/spearman_cosine``), and ``primary_metric`` names each entry's headline metric.
Tasks only score; nothing here trains. ``mteb:`` tasks live in ``mteb_tasks``, loaded only when named.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from sbert_ray.config import ConfigError, flatten
from sbert_ray.data.readers import check_available, load_records, read_user_file, resolve_data_dir
from sbert_ray.data.records import DataError
from sbert_ray.data.retrieval_hub import NANOBEIR, hub_retrieval_layout, is_hub_retrieval, read_hub_retrieval
from sbert_ray.data.retrieval_sets import RetrievalSet, StreamedCorpus, read_beir, stsb_retrieval
from sbert_ray.evaluation import argsim, senteval, sts, triplets
from sbert_ray.evaluation.task_contract import EvalTask, Results


def _flat(nested: dict[str, dict]) -> Results:
    return flatten(nested, sep="/")


def correlation_names(similarities: Sequence[str]) -> tuple[str, ...]:
    """The correlation metrics of scored pairs (``sts.correlations``) for these similarities."""
    return tuple(f"{kind}_{name}" for name in similarities for kind in ("spearman", "pearson"))


class StsTask(EvalTask):
    """STS12-16 (each one concatenated set), STSb test and SICK-R: Spearman / Pearson x100 (paper, Table 1)."""

    primary_metric = "spearman_cosine"

    def __init__(self, spec: str, datasets: Sequence[str], similarities: Sequence[str] = ("cosine",)) -> None:
        super().__init__(spec)
        unknown = sorted(set(similarities) - set(sts.SIMILARITIES))
        if unknown or not similarities:
            raise ConfigError(
                f"unknown similarity {unknown or similarities}; choose from {', '.join(sts.SIMILARITIES)}"
            )
        self.datasets, self.similarities = tuple(datasets), tuple(similarities)

    def check(self, data_dir=None) -> None:
        for name in self.datasets:
            check_available(name, sts.sts_split(name, data_dir), data_dir)

    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        return _flat(sts.run_sts_suite(model, data_dir, self.datasets, batch_size, self.similarities))

    def entries(self) -> tuple[str, ...]:
        return self.datasets

    def metric_names(self) -> tuple[str, ...]:
        return correlation_names(self.similarities)


class ScoredPairsTask(EvalTask):
    """``pairs:<file>``: STS-style correlations on the user's own scored pairs (csv/tsv/jsonl with sentence1,
    sentence2, score); the entry is the file's stem. Argument-similarity fine-tuning scores each fold with it."""

    primary_metric = "spearman_cosine"

    def __init__(self, spec: str, path: str) -> None:
        super().__init__(spec)
        if not path:
            raise ConfigError("task 'pairs' needs a file: pairs:/path/to/pairs.jsonl")
        self.path = Path(path)

    def check(self, data_dir=None) -> None:
        pairs = read_user_file(self.path, "scored")
        if len(pairs) < 2:  # a correlation needs two pairs: refused before the model loads
            raise DataError(f"{self.path}: {len(pairs)} scored pair(s); a correlation needs at least 2")

    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        pairs = read_user_file(self.path, "scored")
        return _flat({self.path.stem: sts.evaluate_pairs(model, pairs, batch_size)})

    def entries(self) -> tuple[str, ...]:
        return (self.path.stem,)

    def metric_names(self) -> tuple[str, ...]:
        return correlation_names(("cosine",))


class ArgsimTask(EvalTask):
    """Cross-topic argument similarity (paper, Table 3): ``afs`` (``afs:<folder>``), ``ukp-aspect``, ``bws``."""

    primary_metric = "spearman_cosine"

    def __init__(self, spec: str, name: str, path: str | None = None) -> None:
        super().__init__(spec)
        self.name, self.path = name, path or None

    def check(self, data_dir=None) -> None:
        if self.name == "afs":
            argsim.load_argsim(self.name, data_dir, self.path)
        else:
            check_available(self.name, "all", data_dir)

    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        return _flat(argsim.evaluate_argsim(model, self.name, data_dir, batch_size, self.path))

    def entries(self) -> tuple[str, ...]:
        return argsim.entry_names(self.name)

    def metric_names(self) -> tuple[str, ...]:
        return correlation_names(("cosine",))


class TripletTask(EvalTask):
    """Triplet accuracy (paper, Table 4): ``wikisec`` (``wikisec:<file.csv>``) and ``nli-triplets``."""

    primary_metric = "accuracy_euclidean"

    def __init__(self, spec: str, name: str, path: str | None = None) -> None:
        super().__init__(spec)
        self.name, self.path = name, path or None

    def check(self, data_dir=None) -> None:
        if self.path:
            triplets.load_triplets(self.name, data_dir, self.path)
        else:
            check_available(self.name, "test", data_dir)

    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        data = triplets.load_triplets(self.name, data_dir, self.path)
        return _flat({self.name: triplets.evaluate_triplets(model, data, batch_size)})

    def entries(self) -> tuple[str, ...]:
        return (self.name,)

    def metric_names(self) -> tuple[str, ...]:
        return tuple(f"accuracy_{name}" for name in triplets.DISTANCES)


class SentEvalTask(EvalTask):
    """SentEval transfer tasks (paper, Table 5): ``senteval`` or ``senteval:MR,CR``; local files only."""

    primary_metric = "accuracy"

    def __init__(self, spec: str, tasks: Sequence[str] = senteval.SENTEVAL_TASKS) -> None:
        super().__init__(spec)
        unknown = [t for t in tasks if t not in senteval.SENTEVAL_TASKS]
        if unknown or not tasks:
            raise ConfigError(f"unknown SentEval task {unknown}; choose from {', '.join(senteval.SENTEVAL_TASKS)}")
        self.tasks = tuple(tasks)

    def check(self, data_dir=None) -> None:
        root = resolve_data_dir(data_dir)
        if root is None:
            raise DataError("SentEval tasks are read from local files: pass --data-dir or set SBERT_RAY_DATA_DIR")
        for name in self.tasks:
            try:
                senteval.load_task(name, root / "senteval-transfer")
            except FileNotFoundError as err:
                raise DataError(f"SentEval {name}: {err.filename} does not exist") from None

    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        return _flat(senteval.run_senteval(model, data_dir, self.tasks, batch_size))

    def entries(self) -> tuple[str, ...]:
        return self.tasks

    def metric_names(self) -> tuple[str, ...]:
        return ("accuracy",)


class RetrievalTask(EvalTask):
    """Retrieval: nDCG@10 and the rest of sentence-transformers' InformationRetrievalEvaluator metrics
    (``evaluation.retrieval``) on each retrieval set that ``loaders`` gives, one entry each."""

    primary_metric = "ndcg_at_10_cosine"

    @abstractmethod
    def loaders(self) -> dict[str, Callable[[object], RetrievalSet]]:
        """{entry: load(data_dir)}: the queries, corpus and judgements of each entry."""

    def check(self, data_dir=None) -> None:
        for load in self.loaders().values():
            load(data_dir)

    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        from sbert_ray.evaluation.retrieval import evaluate_retrieval  # torch: loaded to score, not to parse specs

        return _flat(
            {entry: evaluate_retrieval(model, load(data_dir), batch_size) for entry, load in self.loaders().items()}
        )

    def metric_names(self) -> tuple[str, ...]:
        from sbert_ray.evaluation.retrieval import metric_names

        return metric_names()

    def entries(self) -> tuple[str, ...]:
        return tuple(self.loaders())

    def entry_scores(self, results: Results, metric: str) -> dict[str, float]:
        """As for any task; a ``_dot`` metric of a model whose embeddings are unit length is its ``_cosine`` twin:
        there dot products are cosines, and the evaluator scores them once, as cosine."""
        scores = super().entry_scores(results, metric)
        if not scores and metric.endswith("_dot"):
            scores = super().entry_scores(results, metric.removesuffix("_dot") + "_cosine")
        return scores


class BeirRetrievalTask(RetrievalTask):
    """``retrieval:<folder>`` (the BEIR layout, its qrels/test.tsv) or ``retrieval:<folder>/qrels/<split>.tsv``,
    the folder on disk or an object-storage prefix (``s3://bucket/beir/scifact``, its corpus streamed); the entry
    is the folder's name, with ``-<split>`` after it for a split other than test. (A Hub set,
    ``retrieval:<owner>/<set>``, is a ``HubRetrievalTask``.)"""

    def __init__(self, spec: str, path: str) -> None:
        super().__init__(spec)
        if not path:
            raise ConfigError("task 'retrieval' needs a BEIR folder: retrieval:/path/to/folder")
        self.path = path if "://" in path else Path(path)
        scheme, _, location = path.rpartition("://")
        location = PurePosixPath(location) if scheme else self.path
        qrels = location.suffix == ".tsv" and location.parent.name == "qrels"
        folder, self.split = (location.parents[1], location.stem) if qrels else (location, "test")
        self.folder = f"{scheme}://{folder}" if scheme else folder
        self.entry = folder.name + ("" if self.split == "test" else f"-{self.split}")

    def load(self, data_dir=None) -> RetrievalSet:
        return read_beir(self.folder, self.split)

    def loaders(self) -> dict[str, Callable[[object], RetrievalSet]]:
        return {self.entry: self.load}


class StsbRetrievalTask(RetrievalTask):
    """``stsb-retrieval`` (STSb test) or ``stsb-retrieval:dev``: retrieval built from an STSb split
    (``retrieval_sets.stsb_retrieval``), from the data folder or the Hub like ``stsb``."""

    SPLITS = ("test", "dev")

    def __init__(self, spec: str, split: str) -> None:
        super().__init__(spec)
        if split not in self.SPLITS:
            raise ConfigError(f"unknown STSb split {split!r}; choose from {', '.join(self.SPLITS)}")
        self.split = split
        self.entry = "stsb-retrieval" + ("" if split == "test" else f"-{split}")

    def load(self, data_dir=None) -> RetrievalSet:
        return stsb_retrieval(load_records("stsb", self.split, data_dir))

    def loaders(self) -> dict[str, Callable[[object], RetrievalSet]]:
        return {self.entry: self.load}

    def check(self, data_dir=None) -> None:
        check_available("stsb", self.split, data_dir)


class HubRetrievalTask(RetrievalTask):
    """``retrieval:<owner>/<set>`` or ``retrieval:<owner>/<set>:<split>`` (default test): a retrieval set on the
    Hugging Face Hub by its published name, e.g. ``zeta-alpha-ai/NanoMSMARCO``, ``mteb/scifact``, ``BeIR/scifact``
    (``data.retrieval_hub``); ``nanobeir`` or ``nanobeir:msmarco,scifact`` names the NanoBEIR collection's sets.
    Each entry is the set's name (``NanoMSMARCO``, ``scifact``), with ``-<split>`` after it for another split."""

    def __init__(self, spec: str, repos: Sequence[str], split: str = "test") -> None:
        super().__init__(spec)
        for repo in repos:
            try:
                hub_retrieval_layout(repo, split)
            except DataError as error:
                raise ConfigError(str(error)) from None
        suffix = "" if split == "test" else f"-{split}"
        self.repos, self.split = {repo.partition("/")[2] + suffix: repo for repo in repos}, split

    def loaders(self) -> dict[str, Callable[[object], RetrievalSet]]:
        return {entry: functools.partial(self._load, repo) for entry, repo in self.repos.items()}

    def _load(self, repo: str, data_dir=None) -> RetrievalSet:
        return read_hub_retrieval(repo, self.split)


def _retrieval_task(spec: str, argument: str) -> RetrievalTask:
    """``retrieval:``: a Hub set by its published name (``<owner>/<set>[:<split>]`` of an owner whose layout we
    read), else a local BEIR folder (a relative folder under such a name is written ``./mteb/scifact``)."""
    name, _, split = argument.partition(":")
    if is_hub_retrieval(name):
        return HubRetrievalTask(spec, [name], split or "test")
    return BeirRetrievalTask(spec, argument)


RERANK_TOP_K = 100  # first-stage candidates per query that ``sbert-ray eval --reranker`` reorders by default


class RerankTask(EvalTask):
    """``rerank:<set>``: the model under evaluation retrieves each query's top k of a retrieval set, named as
    ``retrieval:`` names it (a BEIR folder or a Hub set) or ``stsb-retrieval[:dev]``, and ``sbert-ray eval
    --reranker`` reorders them (``evaluation.reranking``); the entry is the set's, with ``-rerank`` after it."""

    primary_metric = "ndcg_at_10_reranked"

    def __init__(self, spec: str, argument: str) -> None:
        super().__init__(spec)
        if not argument:
            raise ConfigError("task 'rerank' needs a retrieval set: rerank:/path/to/beir-folder")
        name, _, split = argument.partition(":")
        self.retrieval = StsbRetrievalTask(spec, split or "test") if name == "stsb-retrieval" else None
        self.retrieval = self.retrieval or _retrieval_task(spec, argument)
        self.path = self.retrieval.path
        (self.entry,) = (f"{entry}-rerank" for entry in self.retrieval.entries())

    def check(self, data_dir=None) -> None:
        self.retrieval.check(data_dir)
        if isinstance(self.load(data_dir).corpus, StreamedCorpus):
            raise DataError("reranking reads the candidates' texts from a corpus held in memory: copy the set locally")

    def load(self, data_dir=None) -> RetrievalSet:
        (load,) = self.retrieval.loaders().values()
        return load(data_dir)

    def run(self, model, data_dir=None, batch_size: int = 64, reranker=None, top_k: int = RERANK_TOP_K) -> Results:
        """Score ``model`` as the first stage (its top ``top_k``) and ``reranker`` (a ``models.teachers`` teacher)
        as the second."""
        if reranker is None:
            raise ConfigError(f"task {self.spec!r} reranks with a reranker: sbert-ray eval --reranker PATH")
        from sbert_ray.evaluation.reranking import evaluate_reranking  # torch: loaded to score, not to parse specs

        return _flat({self.entry: evaluate_reranking(model, reranker, self.load(data_dir), top_k, batch_size)})

    def metric_names(self) -> tuple[str, ...]:
        from sbert_ray.evaluation.reranking import metric_names

        return metric_names()

    def entries(self) -> tuple[str, ...]:
        return (self.entry,)


def _nanobeir_task(spec: str, argument: str) -> HubRetrievalTask:
    names = [name.strip().lower() for name in argument.split(",") if name.strip()] or list(NANOBEIR)
    unknown = [name for name in names if name not in NANOBEIR]
    if unknown:
        raise ConfigError(f"unknown NanoBEIR set {unknown[0]!r}; choose from {', '.join(NANOBEIR)}")
    return HubRetrievalTask(spec, [f"zeta-alpha-ai/{NANOBEIR[name]}" for name in names])


def _mteb_task(spec: str, argument: str) -> EvalTask:
    from sbert_ray.evaluation.mteb_tasks import MtebTask  # imports mteb: only when an mteb task is named

    return MtebTask(spec, argument)


# name -> task factory(spec, argument after "name:", similarities)
TaskFactory = Callable[[str, str, Sequence[str]], EvalTask]
TASKS: dict[str, TaskFactory] = {
    "sts": lambda spec, arg, sims: StsTask(spec, sts.STS_DATASETS, sims),
    **{name: (lambda spec, arg, sims, name=name: StsTask(spec, (name,), sims)) for name in sts.STS_DATASETS},
    "pairs": lambda spec, arg, sims: ScoredPairsTask(spec, arg),
    **{name: (lambda spec, arg, sims, name=name: ArgsimTask(spec, name, arg)) for name in argsim.ARGSIM_DATASETS},
    **{name: (lambda spec, arg, sims, name=name: TripletTask(spec, name, arg)) for name in triplets.TRIPLET_DATASETS},
    "senteval": lambda spec, arg, sims: SentEvalTask(spec, arg.split(",") if arg else senteval.SENTEVAL_TASKS),
    "retrieval": lambda spec, arg, sims: _retrieval_task(spec, arg),
    "nanobeir": lambda spec, arg, sims: _nanobeir_task(spec, arg),
    "stsb-retrieval": lambda spec, arg, sims: StsbRetrievalTask(spec, arg or "test"),
    "rerank": lambda spec, arg, sims: RerankTask(spec, arg),
    "mteb": lambda spec, arg, sims: _mteb_task(spec, arg),
}


class EvalTasks(tuple):
    """The tasks ``parse_tasks`` made of one flag or config key (``key``, which their errors name), carried as they
    are to every phase that checks or scores them."""

    key: str

    def __new__(cls, tasks: Sequence[EvalTask] = (), key: str = "--tasks") -> EvalTasks:
        made = super().__new__(cls, tasks)
        made.key = key
        return made

    @property
    def specs(self) -> list[str]:
        return [task.spec for task in self]

    def check(self, data_dir) -> None:
        """Every task's data can be had, or a ConfigError naming the key and the task."""
        for task in self:
            task.check_for(self.key, data_dir)

    def primary_scores(self, results: Results) -> dict[str, tuple[str, float]]:
        """{entry: (primary metric, value)} over the results of these tasks: what tables and summaries show."""
        return {
            entry: (task.primary_metric, value)
            for task in self
            for entry, value in task.primary_scores(results).items()
        }


def parse_tasks(
    spec: str | Sequence[str],
    similarities: Sequence[str] = ("cosine",),
    key: str = "--tasks",
    absolute: bool = False,
    reranks: bool = False,
) -> EvalTasks:
    """Comma-separated task names (or a config's list of them, which may be empty); ``name:argument`` passes an
    argument (a path, or SentEval task names, whose own commas continue it: ``senteval:MR,CR,bws`` = SentEval MR
    and CR, then bws). A ConfigError names ``key`` (the flag or config key the tasks came from). ``absolute``: each
    task's file or folder made absolute (and its spec with it), for processes in other working directories.
    ``reranks``: the caller gives ``rerank:`` tasks a reranker (``sbert-ray eval --reranker``); elsewhere they are
    refused here, not after the work that precedes scoring (a training run, before its final tasks)."""
    names: list[str] = []
    tokens = spec.split(",") if isinstance(spec, str) else [t for item in spec for t in item.split(",")]
    for token in (t.strip() for t in tokens if t.strip()):
        if names and ":" in names[-1] and token.partition(":")[0] not in TASKS:
            names[-1] += f",{token}"
        else:
            names.append(token)
    unknown = [n for n in names if n.partition(":")[0] not in TASKS]
    if unknown:
        raise ConfigError(f"{key}: unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if isinstance(spec, str) and not names:
        raise ConfigError(f"{key}: no task given; choose from {', '.join(TASKS)}")
    tasks = []
    for name in names:
        try:
            tasks.append(_task(name, similarities, absolute))
        except ConfigError as err:
            raise ConfigError(f"{key}: task {name!r}: {err}") from None
    _refuse_shared_entries(tasks, key)
    rerank = next((task for task in tasks if isinstance(task, RerankTask)), None)
    if rerank is not None and not reranks:
        raise ConfigError(f"{key}: task {rerank.spec!r} needs a reranker: only sbert-ray eval --reranker gives one")
    return EvalTasks(tasks, key)


def _task(name: str, similarities: Sequence[str], absolute: bool) -> EvalTask:
    make = TASKS[name.partition(":")[0]]
    task = make(name, name.partition(":")[2], similarities)
    if absolute and task.absolute_spec() != name:  # made again from its absolute spec: its paths derive from it
        spec = task.absolute_spec()
        task = make(spec, spec.partition(":")[2], similarities)
    return task


def _refuse_shared_entries(tasks: Sequence[EvalTask], key: str) -> None:
    """Results are keyed by entry: two tasks with one entry name (``retrieval:v1/scifact,retrieval:v2/scifact``,
    two ``pairs:`` files with one stem) would overwrite each other's numbers, so they are refused before any work."""
    owner: dict[str, EvalTask] = {}
    for task in tasks:
        for entry in task.entries():
            first = owner.setdefault(entry, task)
            if first is not task:
                raise ConfigError(
                    f"{key}: tasks {first.spec!r} and {task.spec!r} both give results named {entry!r} (one "
                    "would overwrite the other): name each once, or rename a file or folder so that the names differ"
                )
