"""The command line's own contract: rules of a command live in its request object (checked on creation, before any
data, model or Ray work), and the CLI prints them as one line with exit status 2."""

from __future__ import annotations

import pytest

from sbert_ray.bench.train_speed import TrainBenchSettings, worker_layouts
from sbert_ray.cli import main
from sbert_ray.config import ConfigError
from sbert_ray.evaluation.tasks import parse_tasks
from sbert_ray.runs.encode_corpus import EncodeRequest
from sbert_ray.runs.eval_run import EvalRequest


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "sts", "--baseline", "tfidf"], "--baseline tfidf scores argument-similarity tasks"),
        (["--tasks", "afs", "--mode", "finetune", "--truncate-dim", "8"], "--truncate-dim scores the model's own"),
        (["--tasks", "afs", "--baseline", "tfidf", "--truncate-dim", "8"], "--truncate-dim scores the model's own"),
        (["--tasks", "afs", "--baseline", "tfidf", "--precision", "bf16"], "precision 'bf16' encodes with the given"),
    ],
)
def test_eval_refuses_contradictory_options_before_any_work(argv, message, tmp_path, capsys):
    # A model that does not exist: the rule must fire before anything tries to load it.
    assert main(["eval", "--model", str(tmp_path / "no-model"), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"sbert-ray eval: error: {message}") and captured.out == "", captured


def test_eval_request_checks_on_creation():
    tasks = parse_tasks("afs")
    EvalRequest("m", tasks, baseline="tfidf")  # tf-idf on argument similarity, unsupervised: fine
    with pytest.raises(ConfigError, match="--baseline tfidf"):
        EvalRequest("m", parse_tasks("stsb"), baseline="tfidf")
    with pytest.raises(ConfigError, match="--truncate-dim"):
        EvalRequest("m", tasks, baseline="tfidf", truncate_dims=(8,))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "1,2", "--threads-per-worker", "1,2,3"], "--threads-per-worker takes one number, or one per"),
        (["--steps", "1"], "--steps must be >= 2"),
    ],
)
def test_bench_train_refuses_bad_layouts_and_steps(argv, message, capsys):
    assert main(["bench", "train", "--model", "random:tiny", "--no-mlflow", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"sbert-ray bench: error: {message}")


def test_bench_layouts_pair_worker_counts_with_threads():
    assert worker_layouts([1, 2], [2]) == [(1, 2), (2, 2)]
    assert worker_layouts([1, 2], [2, 1]) == [(1, 2), (2, 1)]
    with pytest.raises(ConfigError, match="--steps"):
        TrainBenchSettings(steps=1)


@pytest.mark.parametrize("field, value", [("batch_size", 0), ("workers", 0)])
def test_encode_request_refuses_non_positive_counts(field, value, tmp_path):
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} must be at least 1, got 0"):
        EncodeRequest("m", "corpus.txt", tmp_path / "out", **{field: value})


def test_report_needs_results_and_notes_for_known_labels(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["report", "--no-mlflow", "--out", str(out)]) == 2
    assert "sbert-ray report: error: give at least one results file or --run" in capsys.readouterr().err
    (tmp_path / "ours.json").write_text("{}")
    argv = ["report", f"mine={tmp_path / 'ours.json'}", "--note", "minilm=6 layers", "--no-mlflow", "--out", str(out)]
    assert main(argv) == 2
    assert "--note 'minilm=6 layers': no results labelled 'minilm'" in capsys.readouterr().err
    assert not out.exists()  # refused before anything is written
