"""The dev score: STSb dev Spearman by default (numbers unchanged), any task and metric by evaluation.dev_task /
dev_metric, the weighted mean of several by evaluation.dev_tasks; refused before any cluster work when a task or
metric does not exist."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, EvalConfig, load_config
from sbert_ray.config.schema import DevTaskConfig
from sbert_ray.data import load_records
from sbert_ray.evaluation.dev_score import DevScorer, dev_spec
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.evaluation.tasks import parse_tasks
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.runs.argsim_folds import finetune_config
from sbert_ray.runs.train_run import run_training
from sbert_ray.training.state import TrainState
from sbert_ray.tuning import SweepConfig


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return SentenceEncoder.load(str(tiny_model_dir))


def test_the_default_is_the_dev_pairs_spearman_as_before(tiny, data_dir):
    scorer = DevScorer(EvalConfig(dev_limit=200, batch_size=32), data_dir)
    pairs = load_records("stsb", "dev", data_dir)[:200]
    # the same number, under the same name
    assert scorer.scores(tiny) == {"dev/spearman_cosine": evaluate_pairs(tiny, pairs, batch_size=32)["spearman_cosine"]}


def test_a_retrieval_dev_task_scores_its_metric(tiny, data_dir):
    scorer = DevScorer(EvalConfig(dev_task="stsb-retrieval:dev", dev_metric="mrr_at_10_cosine"), data_dir)
    [task] = parse_tasks("stsb-retrieval:dev")
    assert scorer.scores(tiny) == {
        "dev/mrr_at_10_cosine": task.run(tiny, data_dir)["stsb-retrieval-dev/mrr_at_10_cosine"]
    }
    assert dev_spec(EvalConfig(dev_task="stsb-retrieval:dev")).metric == "ndcg_at_10_cosine"  # the primary metric
    # a normalised model has no separate dot ranking: its dot metric is the cosine one
    normalised = SentenceEncoder.load(str(tiny.transformer.name_or_path), normalize=True)
    dot = DevScorer(EvalConfig(dev_task="stsb-retrieval:dev", dev_metric="ndcg_at_10_dot"), data_dir)
    cosine = DevScorer(EvalConfig(dev_task="stsb-retrieval:dev"), data_dir)
    assert dot.scores(normalised)[dot.key] == cosine.scores(normalised)[cosine.key]


def test_a_dev_task_is_one_task(tiny, data_dir):
    scorer = DevScorer(EvalConfig(dev_task="sts12", dev_metric="pearson_cosine"), data_dir)
    assert scorer.scores(tiny) == {
        "dev/pearson_cosine": parse_tasks("sts12")[0].run(tiny, data_dir)["sts12/pearson_cosine"]
    }
    with pytest.raises(ConfigError, match="evaluation.dev_task: one task, got 2"):
        dev_spec(EvalConfig(dev_task="sts12,sts13"))


def test_several_dev_tasks_score_their_weighted_mean(tiny, data_dir):
    """Each task is logged under its entry and metric; the dev score is their mean weighted by hand."""
    tasks = [DevTaskConfig("stsb-retrieval:dev", "mrr_at_10_cosine", weight=3), DevTaskConfig("sts12")]
    scorer = DevScorer(EvalConfig(dev_tasks=tasks), data_dir)
    retrieval = parse_tasks("stsb-retrieval:dev")[0].run(tiny, data_dir)["stsb-retrieval-dev/mrr_at_10_cosine"]
    sts12 = parse_tasks("sts12")[0].run(tiny, data_dir)["sts12/spearman_cosine"]  # its primary metric
    scores = scorer.scores(tiny)
    assert scorer.key == "dev/weighted_mean" and set(scores) == {
        "dev/stsb-retrieval-dev/mrr_at_10_cosine",
        "dev/sts12/spearman_cosine",
        "dev/weighted_mean",
    }
    assert (
        scores["dev/stsb-retrieval-dev/mrr_at_10_cosine"] == retrieval and scores["dev/sts12/spearman_cosine"] == sts12
    )
    assert retrieval != sts12  # so the weights show
    assert scores["dev/weighted_mean"] == pytest.approx((3 * retrieval + sts12) / 4, rel=1e-12)
    # A sweep ranks its trials by it, as by any dev score.
    assert dev_spec(EvalConfig(dev_tasks=tasks)).metric == "weighted_mean"


NO_LIMIT = "evaluation.dev_limit=null"  # the tiny config limits the dev pairs, which a dev_task replaces
_DEV_TASKS = "evaluation.dev_tasks=[{task: sts12}, {task: stsb-retrieval:dev, metric: mrr_at_10_cosine, weight: 3}]"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["evaluation.dev_task=stsb-retrievl:dev", NO_LIMIT], "evaluation.dev_task: unknown task 'stsb-retrievl:dev'"),
        (
            ["evaluation.dev_task=stsb-retrieval:dev", "evaluation.dev_metric=ndcg@10", NO_LIMIT],
            "evaluation.dev_metric: 'ndcg@10' is not a metric of task 'stsb-retrieval:dev'; choose from accuracy_at_1",
        ),
        (["evaluation.dev_metric=accuracy"], "evaluation.dev_metric: 'accuracy' is not a metric of the dev pairs"),
        (["evaluation.dev_task=stsb-retrieval:dev"], "evaluation.dev_limit is replaced by evaluation.dev_task"),
        # 100 dev pairs in the tiny config's file
        ([_DEV_TASKS], "evaluation.dev_limit is replaced by evaluation.dev_tasks; leave it out"),
        ([_DEV_TASKS, NO_LIMIT, "evaluation.dev_metric=spearman_cosine"], "evaluation.dev_metric is replaced by"),
        (
            ["evaluation.dev_tasks=[{task: sts12, metric: ndcg_at_10_cosine}]", NO_LIMIT],
            "evaluation.dev_tasks.0.metric: 'ndcg_at_10_cosine' is not a metric of task 'sts12'",
        ),
        (["evaluation.dev_tasks=[{metric: spearman_cosine}]", NO_LIMIT], "evaluation.dev_tasks.0.task: required"),
        (["evaluation.dev_tasks=[{task: sts12, weight: 0}]", NO_LIMIT], "evaluation.dev_tasks.0.weight: must be > 0"),
        (["evaluation.dev_tasks=[{task: sts12}, {task: sts12}]", NO_LIMIT], "sts12/spearman_cosine is named twice"),
        (["evaluation.dev_tasks=[{task: sts12, wieght: 2}]", NO_LIMIT], "unknown key evaluation.dev_tasks.0.'wieght'"),
        (
            ["evaluation.dev_tasks=[{task: sts12}, {task: 'retrieval:/no/such/folder'}]", NO_LIMIT],
            "evaluation.dev_tasks.1.task: task 'retrieval:/no/such/folder'",
        ),
        (["evaluation.dev_task=retrieval:/no/such/folder", NO_LIMIT], "/no/such/folder: no such"),
    ],
)
def test_an_unknown_dev_task_or_metric_is_one_line_before_ray(tiny_train_config, capsys, overrides, message):
    assert main(["train", str(tiny_train_config()), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sbert-ray train: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "base, searched",
    [
        ("", "evaluation.dev_metric: {choice: [spearman_cosine, pearson_cosine]}"),
        ("evaluation: {dev_tasks: [{task: sts12}, {task: sts13}]}", "evaluation.dev_tasks.0.weight: {choice: [1, 2]}"),
    ],
)
def test_a_sweep_cannot_search_the_dev_score(tmp_path, base, searched):
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {{{base}}}\nsearch_space:\n  {searched}\n")
    with pytest.raises(ConfigError, match="trials are ranked by one dev score"):
        load_config(path, cls=SweepConfig)


def test_a_checkpoint_written_before_dev_score_resumes(tmp_path):
    (tmp_path / "train_state.json").write_text(json.dumps({"stage": 1, "global_step": 8, "dev_spearman": 71.5}))
    assert TrainState.load(tmp_path) == TrainState(stage=1, global_step=8, dev_score=71.5)


def test_a_weighted_dev_score_keeps_the_best_checkpoints(local_ray, tiny_train_config):
    """On the cluster: two retrieval metrics are scored at every report, each logged as dev/<task>/<metric>, their
    weighted mean as dev/weighted_mean, and Ray keeps the checkpoints with the best mean (keep_best=2) besides the
    latest."""
    tasks = "[{task: stsb-retrieval:dev, metric: mrr_at_10_cosine, weight: 3}, {task: stsb-retrieval:dev}]"
    dev = [f"evaluation.dev_tasks={tasks}", NO_LIMIT]
    config = load_config(tiny_train_config(eval_every=2, workers=1), [*dev, "evaluation.final_tasks=[]"])
    result = run_training(config)
    client = MlflowClient(config.tracking.tracking_uri)

    def history(metric: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(result.run_id, metric)}

    mrr, ndcg = (history(f"dev/stsb-retrieval-dev/{metric}_at_10_cosine") for metric in ("mrr", "ndcg"))
    mean = history("dev/weighted_mean")
    assert sorted(mean) == sorted(mrr) == sorted(ndcg) == [2, 4, 6, 8, 10, 12]
    assert not history("dev/spearman_cosine")
    for step, value in mean.items():  # MLflow stores float64: the mean as computed
        assert value == pytest.approx((3 * mrr[step] + ndcg[step]) / 4, rel=1e-12), step
    assert result.metrics["dev_score"] == mean[12]
    kept = {
        json.loads((folder / "train_state.json").read_text())["global_step"]
        for folder in (Path(config.checkpoint.storage_path) / config.name).glob("checkpoint_*")
        if folder.is_dir()
    }
    best_two = sorted(mean, key=mean.get)[-2:]
    assert kept == {*best_two, 12}, (mean, kept)


def test_argument_similarity_folds_refuse_a_dev_task():
    """Each fold picks its checkpoints on its own dev pairs: a dev_task would silently replace them."""
    with pytest.raises(ConfigError, match="evaluation.dev_task: argument-similarity folds choose checkpoints"):
        finetune_config("random:tiny", overrides=["evaluation.dev_task=stsb-retrieval:dev", NO_LIMIT])
    with pytest.raises(ConfigError, match="evaluation.dev_tasks: argument-similarity folds choose checkpoints"):
        finetune_config("random:tiny", overrides=[_DEV_TASKS, NO_LIMIT])
