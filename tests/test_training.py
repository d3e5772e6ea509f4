"""Distributed training on a real local Ray cluster, tracked in a real MLflow store."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import mlflow
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from cluster_fixtures import complete_resume_points, snapshot_now, wait_for_registered_checkpoint
from mlflow.tracking import MlflowClient
from sentence_transformers import SentenceTransformer

from sbert_ray.config import ConfigError, load_config
from sbert_ray.data import load_records
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.models import load_encoder
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.runs.plan import prepare
from sbert_ray.runs.prepare_source import PrepareRequest, prepare_source
from sbert_ray.runs.train_run import run_training
from sbert_ray.training.resume_points import RESUME_FOLDER
from sbert_ray.training.sources import read_tables
from sbert_ray.training.stage_data import count_stages, stage_datasets, tokenize
from sbert_ray.training.state import TRAINING_FILE
from sbert_ray.training.trainer import TrainingDiverged


def only_run(tracking_uri: str):
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("sbert-ray")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_training_run_is_complete_in_mlflow_with_dev_scores_off_the_training_ranks(
    local_ray, tiny_train_config, tmp_path, data_dir
):
    """One run, two claims (one fit: every cluster test pays a TorchTrainer start-up). It is complete in MLflow:
    metrics, params, tags, artifacts, a model that loads in the reference library, its card, the registered
    version. And evaluation.async_dev: each checkpoint is scored beside training, its encoding shared by two
    scorers of half a CPU (the cluster's spare CPU; evaluation.dev_workers); its score reaches keep_best's ranking
    (the checkpoint's metrics), MLflow at the checkpoint's own step and the run's result, and it is that
    checkpoint's model's score in one process. With full state every other report point the first
    checkpoint holds weights only; the stage's last is full. The model trains LoRA adapters (``model.lora``): saved
    merged, it is what every one of those loads; a large alpha makes its steps move the scores as full training's.
    """
    registered = ["tracking.registered_model_name=tiny-stsb", "tracking.alias=champion"]
    # keep_best=3: every checkpoint stays, to be scored again here (keep_best=2 ranking by the dev score, plus the
    # latest: test_dev_score.py::test_a_retrieval_dev_metric_keeps_the_best_checkpoints)
    async_dev = ["evaluation.async_dev=true", "evaluation.dev_workers=2", "evaluation.dev_resources={CPU: 0.5}"]
    async_dev += ["checkpoint.full_every=2", "checkpoint.keep_best=3"]
    lora = ["model.lora.r=8", "model.lora.alpha=256"]
    config = load_config(tiny_train_config(eval_every=4), [*registered, *async_dev, *lora])
    result = run_training(config)

    client, run = only_run(config.tracking.tracking_uri)
    assert run.info.status == "FINISHED" and run.info.run_id == result.run_id
    metrics = run.data.metrics
    for key in ("train/loss", "train/learning_rate", "train/pairs_per_s", "dev/spearman_cosine"):
        assert key in metrics
    assert len(client.get_metric_history(run.info.run_id, "dev/spearman_cosine")) == 3  # steps 4, 8, 12
    # The last report (what the driver's progress line shows) carries the last logged loss and rate.
    assert result.metrics["train_loss"] == pytest.approx(metrics["train/loss"])
    assert result.metrics["pairs_per_s"] == pytest.approx(metrics["train/pairs_per_s"])
    assert metrics["final/stsb/spearman_cosine"] == pytest.approx(result.final["stsb/spearman_cosine"])
    assert result.headlines["stsb"] == ("spearman_cosine", result.final["stsb/spearman_cosine"])
    assert run.data.params["stages.0.objective"] == "regression"
    assert {"git_commit", "ray_version", "torch_version", "transformers_version"} <= set(run.data.tags)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "evaluation.json", "model", "plots"} <= artifacts

    # The logged model loads in the reference library and embeds exactly like the saved final model.
    model_dir = client.download_artifacts(run.info.run_id, "model", str(tmp_path / "download"))
    sentences = ["A man is playing a guitar.", "Two dogs run through a field of tall grass."]
    reference = SentenceTransformer(model_dir, device="cpu").encode(sentences)
    ours = SentenceEncoder.load(result.model_dir).encode(sentences)
    np.testing.assert_allclose(reference, ours, atol=1e-5)
    assert (Path(result.model_dir) / "adapter" / "adapter_config.json").is_file()  # the LoRA adapter, beside

    # Its model card names the data, the final score and the run; the registered version serves the same vectors.
    card = (Path(model_dir) / "README.md").read_text()
    assert (Path(result.model_dir) / "README.md").read_text() == card
    assert "stsb" in card and f"{result.final['stsb/spearman_cosine']:.2f}" in card and result.run_id in card
    mlflow.set_tracking_uri(config.tracking.tracking_uri)
    served = mlflow.pyfunc.load_model("models:/tiny-stsb@champion").predict(sentences)
    np.testing.assert_allclose(np.asarray(served), ours, atol=1e-5)

    logged = assert_dev_scores_land_on_their_own_checkpoints(config, run.info.run_id, data_dir)
    assert result.metrics["dev_score"] == logged[12]


def assert_dev_scores_land_on_their_own_checkpoints(config, run_id: str, data_dir: Path) -> dict[int, float]:
    """Scored off the training ranks, each checkpoint's dev score is in MLflow at its step and in its metrics (which
    keep_best ranks) and is what its own model scores. Returns the dev scores by step."""
    history = MlflowClient(config.tracking.tracking_uri).get_metric_history(run_id, "dev/spearman_cosine")
    logged = {m.step: m.value for m in history}
    run_dir = Path(config.checkpoint.storage_path) / config.name
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    kept = {c["metrics"]["global_step"]: c for c in snapshot["checkpoint_results"]}
    assert logged.keys() == kept.keys() == {4, 8, 12} and len(set(logged.values())) == 3
    # Ray Train keeps models; the full state of every other report point and the stage's end are resume points
    assert not any((run_dir / c["checkpoint_dir_name"] / TRAINING_FILE).exists() for c in kept.values())
    assert complete_resume_points(run_dir) == [8, 12]
    dev_pairs = load_records("stsb", "dev", data_dir)[:100]
    for step, checkpoint in kept.items():
        model = SentenceEncoder.load(str(run_dir / checkpoint["checkpoint_dir_name"] / "model"))
        score = evaluate_pairs(model, dev_pairs, batch_size=config.evaluation.batch_size)["spearman_cosine"]
        # Another thread count may sum cosines in another order (~1e-7): a near tie of 100 pairs can swap ranks,
        # moving Spearman x100 by ~1e-3; a neighbouring checkpoint's model scores further off than that.
        assert checkpoint["metrics"]["dev_score"] == logged[step] == pytest.approx(score, abs=2e-3), step
    return logged


def test_stages_stream_through_ray_data_tokenised_as_the_tokenizer_does(local_ray, tiny_train_config):
    """Regression (float targets), softmax (class labels) and triplet (three columns) stages, counted, read and
    tokenised by Ray Data with truncation at 16 tokens: every row arrives once, with the token ids the tokenizer
    gives, its length, one hash per text (equal texts, equal hashes), its truncated texts and its label."""
    stages = [
        "stages.1.dataset=nli-offline", "stages.1.objective=softmax", "stages.1.limit=300",
        "stages.2.dataset=nli-triplets", "stages.2.split=test", "stages.2.objective=triplet", "stages.2.limit=300",
    ]  # fmt: skip
    config, sources = prepare(load_config(tiny_train_config(limit=300), ["model.max_seq_length=16", *stages]))
    rows = count_stages(config, sources)
    assert rows == [[300], [300], [300]]
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # to compare row by row
    datasets, described = stage_datasets(config, sources, rows)
    assert [[d["key"] for d in stage] for stage in described] == [["stage0.0"], ["stage1.0"], ["stage2.0"]]
    tokenizer = load_encoder("random:tiny").tokenizer
    for i, stage in enumerate(config.stages):
        streamed = pa.concat_tables(datasets[f"stage{i}.0"].iter_batches(batch_size=None, batch_format="pyarrow"))
        read = pa.concat_tables(read_tables(sources[i][0], None, stage, config.data_dir)).slice(0, 300)
        assert streamed.num_rows == 300
        full = []
        for k in range(3 if stage.objective == "triplet" else 2):
            texts = read.column(f"text_{k}").to_pylist()
            ids = tokenizer(texts, truncation=True, max_length=16)["input_ids"]
            assert streamed.column(f"ids_{k}").to_pylist() == ids
            hashes = dict(zip(texts, streamed.column(f"hash_{k}").to_pylist(), strict=True))
            assert len(set(hashes.values())) == len(hashes)  # one hash per distinct text
            full.append([len(t) for t in tokenizer(texts)["input_ids"]])
        assert streamed.column("length").to_pylist() == [min(16, max(n)) for n in zip(*full, strict=True)]
        assert sum(streamed.column("truncated").to_pylist()) == sum(n > 16 for n in itertools.chain(*full)) > 0
        assert ("label" in streamed.column_names) == (stage.objective != "triplet")
        if stage.objective != "triplet":
            assert streamed.column("label").to_pylist() == read.column("label").to_pylist()


def test_the_tokenise_stage_tokenises_on_its_one_thread_inside_a_ray_data_task(local_ray):
    """The stream's tokenise stage (``stage_data.tokenize``) run by a Ray Data task in a fresh worker process (a
    runtime environment of its own): the process gains no thread while it tokenises; the same process, tokenising
    with the tokenizer's parallelism allowed again, starts a pool as wide as the node (what each data task did)."""
    model_json = json.dumps({"name": "random:tiny", "max_seq_length": 16})

    def threads_gained(batch: dict) -> dict:  # here, not at module level: Ray's workers cannot import this module
        from sbert_ray.models.random_bert import bert_tokenizer

        def threads() -> int:
            return len(os.listdir("/proc/self/task"))

        texts = ["a man is playing a guitar on the stage"] * 2000
        before = threads()
        tokenize(pa.table({"text_0": texts, "text_1": texts}), model_json)
        stream = threads() - before
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
        before = threads()
        bert_tokenizer()(texts)
        return {"stream": [stream], "parallel": [threads() - before]}

    fresh = {"env_vars": {"SBERT_RAY_PROBE": f"{os.getpid()}-{time.time()}"}}  # no pooled worker of an earlier test
    probe = ray.data.range(1).map_batches(threads_gained, batch_size=None, num_cpus=0, runtime_env=fresh)
    (gained,) = probe.take_all()
    assert gained["stream"] == 0 and gained["parallel"] >= 1, gained


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stages.0.dataset=stsbb"], "stsbb"),
        (["model.name=/nonexistent/model"], "/nonexistent/model"),
        (["stages.0.objective=softmax"], "needs LabelledPair"),
        (["stages.0.matryoshka_dims=[32, 64]"], r"stages\.0\.matryoshka_dims: 64 exceeds the model's 32"),
    ],
)
def test_bad_data_or_model_fails_before_ray(tiny_train_config, overrides, message):
    config = load_config(tiny_train_config(), overrides)
    with pytest.raises((ConfigError, ValueError), match=message):
        prepare(config)


def test_hub_evaluation_data_is_checked_in_prepare_when_offline(tiny_train_config, monkeypatch):
    """No data folder (a Hub user) while the Hub is unreachable: the final STS suite could never load, so the run
    stops in prepare(), before any training, naming the key, the task and the dataset."""
    monkeypatch.delenv("SBERT_RAY_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(tiny_train_config(), ["data_dir=", "evaluation.final_tasks=[sts]"])
    expected = (
        r"evaluation.final_tasks: task 'sts': 'sts12' \(mteb/sts12-sts\) needs the Hugging Face Hub, which is unr"
    )
    with pytest.raises(ConfigError, match=expected):
        prepare(config)


def loss_curve(tracking_uri: str, run_id: str) -> dict[int, list[float]]:
    """Every train/loss value logged at each step (a resumed run logs again the steps it retrains)."""
    curve: dict[int, list[float]] = {}
    for metric in MlflowClient(tracking_uri).get_metric_history(run_id, "train/loss"):
        curve.setdefault(metric.step, []).append(metric.value)
    return curve


RESUME_STEPS = 120  # global batch 8: a report point every 10 steps, full state every 30; the kill comes after 50


def test_a_killed_run_resumes_on_the_curve_of_an_uninterrupted_one(local_ray, tiny_train_config):
    """Checkpoints hold every rank's random state (dropout), optimizer, scheduler and stream position, so a run
    whose worker is killed retrains from its checkpoint along the very curve of an uninterrupted run with the same
    seed and ends with its weights: the steps before the kill show that one seed gives one curve, those after it
    that resuming is exact.

    Faults at scale on the way: with full state every third report point and keep_best 1, Ray Train keeps one
    model and the latest, which once deleted the last full-state checkpoint; the run is killed after the second
    weights-only report past a full one (step 50), while the dev score of that report is computed in its Ray task
    (evaluation.async_dev), and with a half-uploaded newer resume point in the run folder (what a kill during an
    upload leaves): it resumes from the newest complete resume point (step 30, or 60 if training got there before
    the kill), which the two workers of this one node download once."""
    overrides = ["evaluation.final_tasks=[]", "evaluation.dev_limit=20"]
    config = load_config(tiny_train_config(name="straight", limit=RESUME_STEPS * 8, eval_every=10), overrides)
    uninterrupted = run_training(config)
    straight = {
        step: values[-1] for step, values in loss_curve(uninterrupted.tracking_uri, uninterrupted.run_id).items()
    }
    assert len(straight) == RESUME_STEPS // 10 and len(set(straight.values())) > 1

    # Checkpoint kinds, their retention and where dev scores are computed do not change training.
    faults = ["checkpoint.full_every=3", "checkpoint.keep_best=1", "evaluation.async_dev=true"]
    path = tiny_train_config(name="killed", limit=RESUME_STEPS * 8, eval_every=10)
    config = load_config(path, overrides + faults)
    run_dir = Path(config.checkpoint.storage_path) / config.name
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_training(config)))
    thread.start()
    wait_for_registered_checkpoint(run_dir, global_step=50)
    half_uploaded = run_dir / RESUME_FOLDER / "step-000000090"  # newer than any complete point, no marker
    shutil.copytree(run_dir / RESUME_FOLDER / "step-000000030" / "model", half_uploaded / "model")
    # This test's own cluster (its raylet is a child of this process): other Ray Train workers on the machine are
    # another test's or another user's.
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    processes = psutil.process_iter(["cmdline"])  # a process gone meanwhile reads as None, not an error
    workers = [p for p in processes if p.pid in ours and "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]
    assert workers, "no Ray Train worker process found"
    workers[0].kill()
    complete_at_kill = complete_resume_points(run_dir)
    snapshot = snapshot_now(run_dir)
    validating = [r["metrics"]["global_step"] for r in snapshot["pending_training_results"]]
    thread.join(timeout=300)
    assert "result" in outcome, "training did not finish after the worker was killed"
    assert validating, "no dev score was being computed when the worker was killed"
    run_id = outcome["result"].run_id
    client = MlflowClient(config.tracking.tracking_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    resumed_from = client.get_metric_history(run_id, "train/resumed_from_step")
    # From the newest complete resume point: not the weights-only step 50, not the half-uploaded 90, not step 0.
    # Rank 0 lives on when another rank is killed, so step 60's upload, in flight at the kill, may complete after
    # it (CI of 2026-12-03: complete at the kill [30], resumed from 60): never older than the kill's newest.
    assert resumed_from and resumed_from[0].value in (30, 60) and resumed_from[0].value >= complete_at_kill[-1]
    assert [m.value for m in client.get_metric_history(run_id, "train/resume_downloads")] == [1]  # one node
    assert complete_resume_points(run_dir) == [90, 120]  # the two newest; the half-uploaded 90 was replaced
    kept = [c["metrics"]["global_step"] for c in snapshot_now(run_dir)["checkpoint_results"]]
    assert 120 in kept and len(kept) <= 2  # keep_best 1 (and Ray's latest) ranked models only
    resumed = loss_curve(config.tracking.tracking_uri, run_id)
    assert resumed.keys() == straight.keys()
    # Both runs execute the same float32 operations in the same order on this machine (same seed, data order,
    # worker count and threads; the resume restores weights, optimizer and random state bit for bit), so they
    # agree to the bit in principle; 1e-5 relative (~100 ulps) only absorbs a kernel choosing another blocking
    # after the restart, while a resume from another step or state logs another batch's loss. Same for the weights.
    for step, values in resumed.items():  # before the kill, and again after the resume
        assert values == pytest.approx([straight[step]] * len(values), rel=1e-5), step
    weights = [SentenceEncoder.load(r.model_dir).state_dict() for r in (uninterrupted, outcome["result"])]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_uneven_shards_give_every_worker_the_same_steps_and_a_nan_loss_stops_the_run(
    local_ray, tiny_train_config, tmp_path, data_dir
):
    """One run, two claims (one fit), under FSDP (``scaling.strategy: fsdp``: the encoder sharded over the two Ray
    Train workers, its checkpoint gathered whole on rank 0). Its first stage is a folder of parquet shards of very
    different sizes (7, 150 and 43 pairs) on 2 workers for 2 epochs: Ray Data splits the stream evenly and each
    worker takes exactly its planned batches, so the stage ends (no worker waits at a collective, FSDP's all-gather
    or reduce-scatter, for a step another never takes) after exactly the planned steps, having trained on every
    pair of each epoch. Its second stage, at an absurd learning rate, blows the weights up: the workers stop
    together at the next loss read instead of training on, no checkpoint is written from the broken weights, the
    error names the step and the checkpoint of the first stage, and the MLflow run ends FAILED. The second stage
    trains on a source ``sbert-ray prepare`` tokenised (on this cluster): the workers read their shares of it from
    its shards, with no Ray dataset."""
    pairs = load_records("stsb", "train", data_dir)[:200]
    folder = tmp_path / "shards"
    folder.mkdir()
    for name, (start, end) in {"a": (0, 7), "b": (7, 157), "c": (157, 200)}.items():
        rows = {f: [getattr(p, f) for p in pairs[start:end]] for f in ("sentence1", "sentence2", "score")}
        pq.write_table(pa.table(rows), folder / f"part-{name}.parquet")
    uneven = [f"stages.0.dataset={folder}", "stages.0.limit=null", "stages.0.epochs=2"]
    raw = tmp_path / "second" / "pairs.parquet"
    raw.parent.mkdir()
    pq.write_table(pq.read_table(folder / "part-b.parquet").slice(0, 96), raw)
    prepared = prepare_source(PrepareRequest(str(raw.parent), "random:tiny", 128, tmp_path / "prepared"))
    assert prepared.rows == 96
    second_stage = [
        f"stages.1.dataset={tmp_path / 'prepared'}",
        "stages.1.limit=96",
        "stages.1.batch_size=8",
        "stages.1.learning_rate=1e30",
    ]
    overrides = [*uneven, *second_stage, "evaluation.final_tasks=[]", "evaluation.dev_limit=20"]
    config = load_config(tiny_train_config(name="diverges", eval_every=0), [*overrides, "scaling.strategy=fsdp"])
    with pytest.raises(TrainingDiverged) as err:
        run_training(config)
    message = str(err.value)
    # 200 pairs: 100 per worker, in micro-batches of 4: 25 steps an epoch, 50 in the first stage.
    step = int(re.search(r"the loss was \S+ at step (\d+) \(stage 1\)", message).group(1))
    assert 50 < step <= 50 + 96 // 8
    run_dir = Path(config.checkpoint.storage_path) / config.name
    checkpoints = sorted(path for path in run_dir.glob("checkpoint_*") if path.is_dir())
    assert [json.loads((c / "train_state.json").read_text())["global_step"] for c in checkpoints] == [50]
    assert f"last good checkpoint: {checkpoints[0]} (step 50)" in message
    # Gathered from the two shards: the whole model, in the sentence-transformers layout, with finite weights.
    gathered = SentenceTransformer(str(checkpoints[0] / "model"), device="cpu").encode(["the last good weights"])
    assert gathered.shape == (1, 32) and np.isfinite(gathered).all()
    client, run = only_run(config.tracking.tracking_uri)
    assert run.info.status == "FAILED"
    history = client.get_metric_history(run.info.run_id, "data/shards/samples")
    assert history[-1].value == 200  # rank 0: its 100 pairs, twice
    assert client.get_metric_history(run.info.run_id, "data/shards/repeated")[-1].value == 0
    # Started again with the same config it would replay the same steps into the same NaN: refused up front.
    with pytest.raises(ConfigError, match=r"diverged \(training stopped: the loss was .* pass --restart"):
        run_training(config)
