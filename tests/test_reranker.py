"""Rerankers (``model.type: cross_encoder``): trained by the training core in process, saved as sentence-transformers'
CrossEncoder, their objectives equal to sentence-transformers' cross-encoder losses, bad configs refused by the CLI."""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray.train
import torch
import yaml

from sbert_ray.cli import main
from sbert_ray.config import EvalConfig, ModelConfig, ScalingConfig, StageConfig, TrainConfig
from sbert_ray.evaluation.dev_score import DevScorer, dev_spec
from sbert_ray.losses import RerankerBCELoss, RerankerMNRLoss
from sbert_ray.models.cross_encoder import CrossEncoderModel, pair_token_types
from sbert_ray.models.teachers import load_teacher
from sbert_ray.training.batches import tokenize_texts
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.stage_plan import stage_plans
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.state import MODEL_DIR
from sbert_ray.training.stream import local_sources
from sbert_ray.training.validation import checkpoint_model

CPU = torch.device("cpu")
QUERIES = ["what do cats eat", "how is rain made", "who wrote hamlet", "why is the sky blue"]
RELEVANT = ["cats eat meat and fish", "rain falls from clouds", "shakespeare wrote hamlet", "light scatters in air"]
IRRELEVANT = ["the stock market fell", "a recipe for bread", "trains run on rails", "the moon orbits earth"]


def scored_rows() -> dict[str, list]:
    """Each query with its relevant passage (score 1) and an irrelevant one (score 0)."""
    return {
        "sentence1": QUERIES * 2,
        "sentence2": RELEVANT + IRRELEVANT,
        "score": [1.0] * len(QUERIES) + [0.0] * len(QUERIES),
    }


def ntuple_rows() -> dict[str, list]:
    """Each query, its positive and two hard negatives (the n-tuples ``sbert-ray mine`` writes)."""
    return {
        "anchor": QUERIES,
        "positive": RELEVANT,
        "negative_1": IRRELEVANT,
        "negative_2": IRRELEVANT[1:] + IRRELEVANT[:1],
    }


def write_parquet(rows: dict[str, list], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(rows), path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir) -> tuple[Path, LocalReporter]:
    """A random tiny BERT reranker trained in process by the training core: a BCE stage on scored pairs (labels
    0/1: score_max 1), then a listwise stage on n-tuples; checkpoints written as a run writes them."""
    folder = tmp_path_factory.mktemp("reranker")
    stages = [
        StageConfig(
            dataset=str(write_parquet(scored_rows(), folder / "scored.parquet")), objective="reranker_bce",
            score_max=1.0, batch_size=8, epochs=6, learning_rate=1e-3, warmup_ratio=0.0,
        ),
        StageConfig(
            dataset=str(write_parquet(ntuple_rows(), folder / "ntuples.parquet")), objective="reranker_mnrl",
            loss={"scale": 10.0}, batch_size=4, epochs=10, learning_rate=3e-3, warmup_ratio=0.0,
        ),
    ]  # fmt: skip
    config = TrainConfig(
        seed=0,
        data_dir=str(data_dir),
        model=ModelConfig(name="random:tiny", type="cross_encoder", max_seq_length=24),
        stages=stages,
        evaluation=EvalConfig(eval_every=1, final_tasks=[]),
        scaling=ScalingConfig(torch_threads=torch.get_num_threads()),  # leaves this process's threads as they are
    )
    config.validate()
    reporter = LocalReporter(folder / "checkpoints")
    worker = Worker(CPU)
    started = start_worker(config, worker, None)
    assert isinstance(started.encoder, CrossEncoderModel)
    data = functools.partial(local_sources, config, encoder=started.encoder)
    train_stages(stage_plans(config), started, data, worker, reporter, StepMeter(time.time(), CPU))
    reporter.close()
    return folder / "checkpoints" / f"step-{reporter.reports[-1]['global_step']}", reporter, config


def test_both_objectives_train_the_reranker(trained):
    _, reporter, _ = trained
    for stage in (0, 1):
        losses = [report["train_loss"] for report in reporter.reports if report["stage"] == stage]
        assert len(losses) >= 4 and all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0], (stage, losses)


def test_the_trained_reranker_loads_in_sentence_transformers_and_predicts_as_ours(trained):
    from sentence_transformers import CrossEncoder

    model_dir = trained[0] / MODEL_DIR
    ours = CrossEncoderModel.load(model_dir)
    theirs = CrossEncoder(str(model_dir), device="cpu")
    assert theirs.num_labels == 1 and theirs.max_seq_length == ours.max_seq_length == 24
    pairs = [(q, p) for q in QUERIES for p in RELEVANT + IRRELEVANT]
    expected = theirs.predict(pairs, batch_size=7, show_progress_bar=False)
    scores = ours.predict(pairs, batch_size=7)
    # The same float32 kernels on the same token ids: equal up to rounding in the last bits of a sigmoid (< 1).
    tolerance = 16 * np.finfo(np.float32).eps
    np.testing.assert_allclose(scores, expected, rtol=0, atol=tolerance)
    assert np.ptp(expected) > 100 * tolerance  # trained apart: the comparison compares different numbers
    assert load_teacher(str(model_dir)).kind == "cross-encoder"  # a teacher for score and mine --rescore-with


def test_a_reranker_resumes_from_its_checkpoint_as_a_reranker(trained):
    checkpoint, reporter, config = trained
    started = start_worker(config, Worker(CPU), checkpoint)
    assert isinstance(started.encoder, CrossEncoderModel)
    assert started.state.global_step == reporter.reports[-1]["global_step"] and started.state.stage_done


def test_a_reranker_dev_score_is_the_correlation_of_its_pair_scores_with_the_gold_scores(trained, data_dir):
    """The dev pairs scored by sentence-transformers' CrossEncoder, correlated by scipy: what the run's dev score is."""
    from scipy.stats import pearsonr, spearmanr
    from sentence_transformers import CrossEncoder

    from sbert_ray.data.readers import load_records

    model_dir = trained[0] / MODEL_DIR
    evaluation = EvalConfig(dev_limit=60, batch_size=16)
    spec = dev_spec(evaluation, model_type="cross_encoder")
    assert spec.metric == "spearman_pair_score"  # the default for a reranker
    checkpoint = ray.train.Checkpoint.from_directory(str(trained[0]))  # as the off-rank scorer loads it
    scores = DevScorer(evaluation, data_dir, spec).scores(checkpoint_model(checkpoint, "cross_encoder"))
    pairs = load_records("stsb", "dev", data_dir)[:60]
    predicted = CrossEncoder(str(model_dir), device="cpu").predict(
        [(p.sentence1, p.sentence2) for p in pairs], show_progress_bar=False
    )
    gold = [p.score for p in pairs]
    assert scores == {"dev/spearman_pair_score": pytest.approx(spearmanr(gold, predicted).statistic * 100, abs=1e-3)}
    pearson_spec = dev_spec(EvalConfig(dev_metric="pearson_pair_score"), model_type="cross_encoder")
    pearson = DevScorer(evaluation, data_dir, pearson_spec)
    assert pearson.scores(CrossEncoderModel.load(model_dir))["dev/pearson_pair_score"] == pytest.approx(
        pearsonr(gold, predicted).statistic * 100, abs=1e-3
    )


def test_a_classifier_of_more_labels_is_refused_as_a_reranker_before_ray(tmp_path):
    from transformers import BertForSequenceClassification

    from sbert_ray.models import ModelError, check_model
    from sbert_ray.models.random_bert import bert_config, bert_tokenizer

    tokenizer = bert_tokenizer()
    BertForSequenceClassification(bert_config("tiny", tokenizer, num_labels=3)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="classifies into 3 labels; a reranker .* scores with one"):
        check_model(str(tmp_path), 24, model_type="cross_encoder")
    assert check_model(str(tmp_path), 24) == 32  # a bi-encoder takes its encoder


def test_a_plain_encoder_loads_as_a_reranker_with_a_new_one_label_head(tiny_model_dir):
    model = CrossEncoderModel.load(tiny_model_dir)
    assert model.transformer.config.num_labels == 1 and model.predict([("a", "b")]).shape == (1,)


def test_pair_token_types_are_the_tokenizers():
    model = CrossEncoderModel.random("tiny", max_seq_length=12)  # short: some pairs are truncated
    batch = model.tokenize_pairs(QUERIES, ["cats"] + [p + " " + p for p in RELEVANT[1:]])
    assert batch["attention_mask"].sum(dim=1).min() < batch["attention_mask"].shape[1]  # some padding
    rebuilt = pair_token_types(batch["input_ids"], batch["attention_mask"], model.tokenizer.sep_token_id)
    assert torch.equal(rebuilt, batch["token_type_ids"]) and rebuilt.any()


def float64_pair(model_dir: Path):
    """Our reranker and sentence-transformers' CrossEncoder of one folder, both float64 and in eval mode (no
    dropout): the same weights, two implementations."""
    from sentence_transformers import CrossEncoder

    ours = CrossEncoderModel.load(model_dir).double()
    theirs = CrossEncoder(str(model_dir), device="cpu")
    theirs.to(torch.float64).eval()
    return ours, theirs


def batch_features(model: CrossEncoderModel, columns: list[list[str]], labels=None):
    rows = tokenize_texts(columns, labels, model)
    features, labels, _, widths = rows.collate(range(len(columns[0])), model.tokenizer.pad_token_id, False, CPU)
    return features, labels, widths


def assert_equal_losses_and_gradients(ours, theirs, loss, loss_theirs) -> None:
    """Float64 (eps 2e-16): the two computations differ at most in the order of their sums (over a few hundred
    terms), so by far less than 1e-10 of the loss and of the largest gradient. The bound is the largest gradient's,
    not each tensor's: some (the attention's key biases) are zero but for rounding."""
    loss.backward()
    loss_theirs.backward()
    assert loss.item() == pytest.approx(loss_theirs.item(), rel=1e-10, abs=0)
    mine = [p.grad for p in ours.transformer.parameters()]
    other = [p.grad for p in theirs.parameters() if p.requires_grad]
    assert len(mine) == len(other)
    scale = max(grad.abs().max().item() for grad in other)
    assert scale > 0
    for grad, expected in zip(mine, other, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-10 * scale)


def their_logits(theirs, queries: list[str], passages: list[str]) -> torch.Tensor:
    """sentence-transformers' logits of the pairs, as its cross-encoder losses compute them (with gradients)."""
    return theirs(theirs.preprocess(list(zip(queries, passages, strict=True))))["scores"].view(-1)


def test_reranker_bce_equals_sentence_transformers_binary_cross_entropy(trained):
    """On float64 logits: sentence-transformers' own forward casts the labels, and with them the loss, to float32."""
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    ours, theirs = float64_pair(trained[0] / MODEL_DIR)
    rows = scored_rows()
    labels = np.asarray(rows["score"], dtype=np.float32)
    features, labels, widths = batch_features(ours, [rows["sentence1"], rows["sentence2"]], labels)
    loss = RerankerBCELoss(ours)(features, labels, used_widths=widths)
    reference = BinaryCrossEntropyLoss(theirs)
    logits = reference.activation_fn(their_logits(theirs, rows["sentence1"], rows["sentence2"]))
    expected = reference.bce_with_logits_loss(logits, torch.tensor(rows["score"], dtype=torch.float64))
    assert_equal_losses_and_gradients(ours, theirs, loss, expected)


def test_reranker_mnrl_equals_sentence_transformers_multiple_negatives_ranking_with_hard_negatives_only(trained):
    """sentence-transformers' forward with ``num_negatives=0`` (no in-batch negatives) is its ``calculate_loss``
    over the logits of the positive's and each hard negative's pairs, which is what is called here (its
    in-batch sampling refuses to draw 0 negatives)."""
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    ours, theirs = float64_pair(trained[0] / MODEL_DIR)
    anchors, *candidates = columns = list(ntuple_rows().values())
    features, _, widths = batch_features(ours, columns)
    loss = RerankerMNRLoss(ours, scale=7.0)(features, None, used_widths=widths)
    reference = MultipleNegativesRankingLoss(theirs, num_negatives=0, scale=7.0)
    expected = reference.calculate_loss([their_logits(theirs, anchors, c) for c in candidates], len(anchors))
    assert_equal_losses_and_gradients(ours, theirs, loss, expected)


RERANKER = ["model.type=cross_encoder", "stages.0.objective=reranker_bce"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stages.0.objective=reranker_bce"], "stages.0.objective: 'reranker_bce' trains a cross_encoder and "
         "model.type is bi_encoder; set model.type: cross_encoder"),
        (["model.type=cross_encoder"], "stages.0.objective: 'regression' trains a bi_encoder and model.type is "
         "cross_encoder; set model.type: bi_encoder, or use one of: reranker_bce, reranker_mnrl"),
        (["model.type=cross_encoder", "model.pooling=cls", "stages.0.objective=reranker_bce"],
         "model.pooling: a bi-encoder setting, which model.type cross_encoder has not; leave it out"),
        (RERANKER, "evaluation.final_tasks: ['stsb'] score embeddings, which model.type cross_encoder has not; "
         "set final_tasks: []"),
        ([*RERANKER, "evaluation.final_tasks=[]", "evaluation.before_tasks=[sts12]"],
         "evaluation.before_tasks: ['sts12'] score embeddings"),
        ([*RERANKER, "evaluation.final_tasks=[]", "evaluation.dev_limit=null",
          "evaluation.dev_task=stsb-retrieval:dev"],
         "evaluation.dev_task: evaluation tasks score embeddings, which model.type cross_encoder has not"),
        ([*RERANKER, "evaluation.final_tasks=[]", "evaluation.dev_workers=2"],
         "evaluation.dev_workers: the scorers' pool shares encoding"),
        ([*RERANKER, "evaluation.final_tasks=[]", "tracking.registered_model_name=tiny"],
         "tracking.registered_model_name: a reranker is logged as the run's artifacts (model/)"),
        ([*RERANKER, "evaluation.final_tasks=[]", "evaluation.dev_metric=spearman_cosine"],
         "evaluation.dev_metric: 'spearman_cosine' is not a metric of the dev pairs of 'stsb' (a reranker's); "
         "choose from spearman_pair_score, pearson_pair_score"),
        ([*RERANKER, "evaluation.final_tasks=[rerank:stsb-retrieval:dev]"],
         "evaluation.first_stage: the final tasks ['rerank:stsb-retrieval:dev'] rerank a first stage's candidates; "
         "name the bi-encoder that retrieves them"),
        ([*RERANKER, "evaluation.final_tasks=['rerank:stsb-retrieval:dev,sts']", "evaluation.first_stage=random:tiny"],
         "evaluation.final_tasks: ['sts'] score embeddings"),
        ([*RERANKER, "evaluation.final_tasks=[]", "evaluation.first_stage=random:tiny"],
         "evaluation.first_stage: no final rerank: task uses it; leave it out"),
        ([*RERANKER, "evaluation.final_tasks=[rerank:stsb-retrieval:dev]", "evaluation.first_stage=/no/encoder"],
         "evaluation.first_stage: model reference '/no/encoder' looks like a path but is not a folder"),
        (["evaluation.first_stage=random:tiny"],
         "evaluation.first_stage: the retriever of a reranker's rerank: tasks (model.type cross_encoder)"),
        (["evaluation.dev_metric=spearman_pair_score"],
         "evaluation.dev_metric: 'spearman_pair_score' is not a metric of the dev pairs of 'stsb'; choose from "
         "spearman_cosine, pearson_cosine"),
    ],
)  # fmt: skip
def test_a_reranker_config_error_is_one_line_from_train_before_ray(tiny_train_config, capsys, overrides, message):
    assert main(["train", str(tiny_train_config()), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sbert-ray train: error: ") and err.count("\n") == 1
    assert message in err


def test_a_scored_source_without_its_score_column_is_refused_naming_it(tmp_path, data_dir):
    """Before Ray: the parquet footer tells that the objective's label column is missing."""
    from sbert_ray.data.records import DataError
    from sbert_ray.training.sources import known_rows, stage_sources

    rows = scored_rows()
    del rows["score"]
    stage = StageConfig(dataset=str(write_parquet(rows, tmp_path / "unscored.parquet")), objective="reranker_bce")
    (source,) = stage_sources(stage, 0)
    with pytest.raises(DataError, match="no column 'score'"):
        known_rows(source, stage, str(data_dir))


def test_sbert_ray_train_trains_a_reranker_on_ray(local_ray, tiny_train_config, tiny_model_dir, data_dir, capsys):
    """``sbert-ray train`` of a random tiny reranker by 2 Ray Train workers on STSb's scored pairs (scores / 5 as
    BCE labels), one worker killed after the first checkpoint: the run resumes from a checkpoint loaded as a
    reranker and ends. Each checkpoint is scored off the training ranks as a reranker (the correlation of its pair
    scores with the dev pairs' gold scores), that score is in MLflow at the checkpoint's step and in keep_best's
    ranking and is what the checkpoint's model scores in this process; the final folder loads in
    sentence-transformers' CrossEncoder and predicts as ours, carded and logged as the run's artifacts. Its final
    task reranks a retrieval set's candidates from a first-stage bi-encoder: in MLflow, what ``sbert-ray eval
    --reranker`` scores for the final folder."""
    from cluster_fixtures import train_workers, wait_for_registered_checkpoint
    from mlflow.tracking import MlflowClient
    from sentence_transformers import CrossEncoder
    from test_reranking import write_toy_beir

    from sbert_ray.config import load_config
    from sbert_ray.data.readers import load_records
    from sbert_ray.evaluation.sts import evaluate_pair_scores

    path = tiny_train_config(name="rerank", limit=480, eval_every=20)  # 60 steps: the kill comes after step 20
    beir = write_toy_beir(path.parent / "toy")
    overrides = [*RERANKER, f"evaluation.final_tasks=[rerank:{beir}]", f"evaluation.first_stage={tiny_model_dir}"]
    overrides += ["evaluation.dev_limit=40", "stages.0.learning_rate=1e-3"]
    overrides += ["evaluation.async_dev=true", "evaluation.dev_resources={CPU: 0.5}", "checkpoint.keep_best=3"]
    config = load_config(path, overrides)
    run_dir = Path(config.checkpoint.storage_path) / config.name
    exit_code: list[int] = []
    training = threading.Thread(target=lambda: exit_code.append(main(["train", str(path), *overrides])))
    training.start()
    wait_for_registered_checkpoint(run_dir, global_step=20)
    workers = train_workers()
    assert workers, "no Ray Train worker process found"
    workers[0].kill()
    training.join(timeout=300)
    assert exit_code == [0], capsys.readouterr().err[-3000:]

    client = MlflowClient(config.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sbert-ray").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["model.type"] == "cross_encoder"
    resumed_from = [m.value for m in client.get_metric_history(run.info.run_id, "train/resumed_from_step")]
    assert resumed_from and resumed_from[0] >= 20  # from a checkpoint, not from step 0
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "dev/spearman_pair_score")}
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    kept = {c["metrics"]["global_step"]: c for c in snapshot["checkpoint_results"]}
    assert logged.keys() == kept.keys() == {20, 40, 60}  # 480 pairs in global batches of 8, scored every 20 steps
    dev_pairs = load_records("stsb", "dev", data_dir)[:40]
    for step, checkpoint in kept.items():
        model = CrossEncoderModel.load(run_dir / checkpoint["checkpoint_dir_name"] / MODEL_DIR)
        score = evaluate_pair_scores(model, dev_pairs, config.evaluation.batch_size)["spearman_pair_score"]
        assert checkpoint["metrics"]["dev_score"] == logged[step] == pytest.approx(score, abs=2e-3), step

    final = Path(config.output_dir or run_dir / "final-model")
    pairs = [(p.sentence1, p.sentence2) for p in dev_pairs]
    theirs = CrossEncoder(str(final), device="cpu").predict(pairs, show_progress_bar=False)
    np.testing.assert_allclose(CrossEncoderModel.load(final).predict(pairs), theirs, rtol=0, atol=1e-6)
    assert np.ptp(theirs) > 0
    assert "CrossEncoder(" in (final / "README.md").read_text() and run.info.run_id in (final / "README.md").read_text()
    assert {a.path for a in client.list_artifacts(run.info.run_id, "model")} >= {"model/config.json", "model/README.md"}

    output = path.parent / "eval.json"
    argv = ["eval", "--model", str(tiny_model_dir), "--tasks", f"rerank:{beir}", "--reranker", str(final)]
    assert main([*argv, "--batch-size", str(config.evaluation.batch_size), "--output", str(output)]) == 0
    expected = json.loads(output.read_text())["toy-rerank"]
    final_metrics = {k.removeprefix("final/toy-rerank/"): v for k, v in run.data.metrics.items() if "toy-rerank" in k}
    assert final_metrics == pytest.approx(expected, abs=1e-12) and final_metrics["queries"] == 3


def test_a_rerankers_final_rerank_task_scores_what_eval_reranker_scores(trained, tiny_model_dir, tmp_path):
    """``evaluation.final_tasks: [rerank:<set>]`` with ``evaluation.first_stage``: the final scoring of a reranker's
    run (a checkpoint's model, loaded as sentence-transformers' CrossEncoder) gives the numbers ``sbert-ray eval
    --reranker`` gives for the same folder on the same first stage."""
    from test_reranking import write_toy_beir

    from sbert_ray.evaluation.tasks import parse_tasks
    from sbert_ray.runs.scoring import _evaluate, checkpoint_reranker

    checkpoint, _, _ = trained
    folder, output = write_toy_beir(tmp_path / "toy"), tmp_path / "eval.json"
    tasks = parse_tasks([f"rerank:{folder}"], reranks=True)
    load = functools.partial(checkpoint_reranker, ray.train.Checkpoint(str(checkpoint)))
    final = _evaluate(load, list(tasks), None, 16, "cpu", 1, str(tiny_model_dir))
    argv = ["eval", "--model", str(tiny_model_dir), "--tasks", f"rerank:{folder}", "--reranker"]
    assert main([*argv, str(checkpoint / MODEL_DIR), "--batch-size", "16", "--output", str(output)]) == 0
    assert final == {
        f"toy-rerank/{name}": value for name, value in json.loads(output.read_text())["toy-rerank"].items()
    }
    assert final["toy-rerank/top_k"] == 100 and 0 < final["toy-rerank/ndcg_at_10_reranked"] <= 1


def test_a_sweeps_best_reranker_is_retrained_without_the_embedding_suite(trained):
    """A sweep retrains its best trial's config scored on the STS suite; a reranker's on none (it has no embeddings)."""
    from sbert_ray.runs.sweep import _retrain_config

    retrained = _retrain_config(trained[2], "sweep", "/tmp/storage")
    assert retrained.evaluation.final_tasks == []
    retrained.validate()  # a config a reranker's run takes


def test_a_reranker_sweep_tunes_its_learning_rate_on_ray(local_ray, tiny_train_config, tmp_path):
    """A sweep of a reranker's learning rate, two trials at once on Ray Tune: each trial trains a reranker and
    scores it on its dev pairs (the metric the sweep ranks by), one MLflow child run each under the sweep's run, the
    best config a reranker's, each trial's final folder a CrossEncoder."""
    from mlflow.tracking import MlflowClient
    from sentence_transformers import CrossEncoder

    from sbert_ray.config import load_config
    from sbert_ray.runs.sweep import run_sweep
    from sbert_ray.tuning import SweepConfig

    base = yaml.safe_load(tiny_train_config(name="base", limit=32, eval_every=2).read_text())
    base["model"]["type"] = "cross_encoder"
    base["stages"][0]["objective"] = "reranker_bce"
    base["evaluation"].update(final_tasks=[], dev_limit=20, async_dev=False)
    base["scaling"] = {"num_workers": 1, "cpus_per_worker": 0.5}
    base["output_dir"] = str(tmp_path / "models")
    path = tmp_path / "sweep.yaml"
    sweep = {
        "name": "rerankers",
        "base": base,
        "scheduler": "fifo",
        "search_space": {"stages.0.learning_rate": {"grid": [1e-4, 1e-3]}},
    }
    path.write_text(yaml.safe_dump({**sweep, "max_concurrent_trials": 2}))
    result = run_sweep(load_config(path, cls=SweepConfig))

    assert result.dev_metric == "spearman_pair_score"
    assert [row.status for row in result.rows] == ["finished", "finished"]
    assert all(math.isfinite(row.dev_score) for row in result.rows) and len({r.dev_score for r in result.rows}) == 2
    assert result.best is max(result.rows, key=lambda row: row.dev_score)
    best = yaml.safe_load((result.summary / "best_config.yaml").read_text())
    assert best["model"]["type"] == "cross_encoder" and best["stages"][0]["objective"] == "reranker_bce"

    client = MlflowClient(result.tracking_uri)
    assert client.get_run(result.run_id).info.status == "FINISHED"
    for row in result.rows:
        child = client.get_run(row.run_id)
        assert child.info.status == "FINISHED" and child.data.tags["mlflow.parentRunId"] == result.run_id
        assert child.data.params["model.type"] == "cross_encoder"
        assert child.data.metrics["dev/spearman_pair_score"] == pytest.approx(row.dev_score)
        final = tmp_path / "models" / row.trial_id
        assert CrossEncoder(str(final), device="cpu").predict([("a query", "a passage")]).shape == (1,)
