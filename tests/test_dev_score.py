"""The dev score: STSb dev Spearman by default (numbers unchanged), any task and metric by evaluation.dev_task /
dev_metric, refused before any cluster work when the task or metric does not exist."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, EvalConfig, load_config
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
    assert scorer.metric == "spearman_cosine"
    assert scorer.score(tiny) == evaluate_pairs(tiny, pairs, batch_size=32)["spearman_cosine"]  # the same number


def test_a_retrieval_dev_task_scores_its_metric(tiny, data_dir):
    scorer = DevScorer(EvalConfig(dev_task="stsb-retrieval:dev", dev_metric="mrr_at_10_cosine"), data_dir)
    [task] = parse_tasks("stsb-retrieval:dev")
    assert scorer.score(tiny) == task.run(tiny, data_dir)["stsb-retrieval-dev/mrr_at_10_cosine"]
    assert dev_spec(EvalConfig(dev_task="stsb-retrieval:dev")).metric == "ndcg_at_10_cosine"  # the primary metric
    # a normalised model has no separate dot ranking: its dot metric is the cosine one
    normalised = SentenceEncoder.load(str(tiny.transformer.name_or_path), normalize=True)
    dot = DevScorer(EvalConfig(dev_task="stsb-retrieval:dev", dev_metric="ndcg_at_10_dot"), data_dir)
    assert dot.score(normalised) == DevScorer(EvalConfig(dev_task="stsb-retrieval:dev"), data_dir).score(normalised)


def test_a_dev_task_is_one_task(tiny, data_dir):
    scorer = DevScorer(EvalConfig(dev_task="sts12", dev_metric="pearson_cosine"), data_dir)
    assert scorer.score(tiny) == parse_tasks("sts12")[0].run(tiny, data_dir)["sts12/pearson_cosine"]
    with pytest.raises(ConfigError, match="evaluation.dev_task: one task, got 2"):
        dev_spec(EvalConfig(dev_task="sts12,sts13"))


NO_LIMIT = "evaluation.dev_limit=null"  # the tiny config limits the dev pairs, which a dev_task replaces


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["evaluation.dev_task=stsb-retrievl:dev", NO_LIMIT], "evaluation.dev_task: unknown task 'stsb-retrievl:dev'"),
        (
            ["evaluation.dev_task=stsb-retrieval:dev", "evaluation.dev_metric=ndcg@10", NO_LIMIT],
            "evaluation.dev_metric: 'ndcg@10' is not a metric of task 'stsb-retrieval:dev'; choose from accuracy_at_1",
        ),
        (["evaluation.dev_metric=accuracy"], "evaluation.dev_metric: 'accuracy' is not a metric of the dev pairs"),
        (["evaluation.dev_task=stsb-retrieval:dev"], "evaluation.dev_limit is for the dev pairs"),  # 100 in the file
        (["evaluation.dev_task=retrieval:/no/such/folder", NO_LIMIT], "/no/such/folder: no such"),
    ],
)
def test_an_unknown_dev_task_or_metric_is_one_line_before_ray(tiny_train_config, capsys, overrides, message):
    assert main(["train", str(tiny_train_config()), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sbert-ray train: error: ") and message in err and err.count("\n") == 1


def test_a_sweep_cannot_search_the_dev_metric(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("search_space:\n  evaluation.dev_metric: {choice: [spearman_cosine, pearson_cosine]}\n")
    with pytest.raises(ConfigError, match="trials are ranked by one dev score"):
        load_config(path, cls=SweepConfig)


def test_a_checkpoint_written_before_dev_score_resumes(tmp_path):
    (tmp_path / "train_state.json").write_text(json.dumps({"stage": 1, "global_step": 8, "dev_spearman": 71.5}))
    assert TrainState.load(tmp_path) == TrainState(stage=1, global_step=8, dev_score=71.5)


def test_a_retrieval_dev_metric_keeps_the_best_checkpoints(local_ray, tiny_train_config):
    """On the cluster: the dev task is scored at every report, logged as dev/<metric>, and Ray keeps the
    checkpoints with the best dev score (keep_best=2) besides the latest."""
    dev = ["evaluation.dev_task=stsb-retrieval:dev", "evaluation.dev_metric=mrr_at_10_cosine", NO_LIMIT]
    config = load_config(tiny_train_config(eval_every=2), [*dev, "evaluation.final_tasks=[]"])
    result = run_training(config)
    client = MlflowClient(config.tracking.tracking_uri)
    history = {m.step: m.value for m in client.get_metric_history(result.run_id, "dev/mrr_at_10_cosine")}
    assert sorted(history) == [2, 4, 6, 8, 10, 12] and not client.get_metric_history(
        result.run_id, "dev/spearman_cosine"
    )
    assert result.metrics["dev_score"] == history[12]
    kept = {
        json.loads((folder / "train_state.json").read_text())["global_step"]
        for folder in (Path(config.checkpoint.storage_path) / config.name).glob("checkpoint_*")
        if folder.is_dir()
    }
    best_two = sorted(history, key=history.get)[-2:]
    assert kept == {*best_two, 12}, (history, kept)


def test_argument_similarity_folds_refuse_a_dev_task():
    """Each fold picks its checkpoints on its own dev pairs: a dev_task would silently replace them."""
    with pytest.raises(ConfigError, match="evaluation.dev_task: argument-similarity folds choose checkpoints"):
        finetune_config("random:tiny", overrides=["evaluation.dev_task=stsb-retrieval:dev", NO_LIMIT])
