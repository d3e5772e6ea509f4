"""The report renders from a results file, with our numbers beside the paper's and every dataset difference
stated; the generic CLI printing of every number; task specs with arguments."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys

import pytest

from sbert_ray.cli import main
from sbert_ray.config import flatten
from sbert_ray.evaluation import reproduction_report
from sbert_ray.evaluation.paper_numbers import PAPER_TABLES
from sbert_ray.evaluation.results import format_results, nest
from sbert_ray.evaluation.tasks import SentEvalTask, StsTask, parse_tasks


def test_paper_table_rows_have_one_value_per_column():
    for table in PAPER_TABLES.values():
        assert all(len(values) == len(table.columns) for values in table.rows.values()), table.title
    assert PAPER_TABLES[1].rows["SBERT-NLI-base"][-1] == 74.89
    assert PAPER_TABLES[3].rows["SBERT-AFS-base (cross-topic)"] == (52.34, 50.65)


RESULTS = {
    "stsb": {"spearman_cosine": 82.03, "pearson_cosine": 83.0, "n": 1379},
    "ukp-aspect": {
        "pearson_cosine": 40.5,
        "spearman_cosine": 38.25,
        "n": 10,
        "folds": {"fold0": {"pearson_cosine": 40.5, "spearman_cosine": 38.25, "n": 10, "train_pairs": 90}},
    },
    "nli-triplets": {"accuracy_euclidean": 0.8123, "accuracy_cosine": 0.8222, "n": 3247},
    "MR": {"accuracy": 75.5, "accuracy_std": 1.0, "n": 10662},
}


def test_report_renders_from_a_results_file(tmp_path):
    path = tmp_path / "minilm.json"
    path.write_text(json.dumps(RESULTS))
    assert main(["report", str(path), "--out", str(tmp_path / "out"), "--no-mlflow", "--note", "minilm=6 layers"]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| **ours: minilm** | – | – | – | – | – | 82.03 | – | – |" in text  # Table 1, no Avg
    assert "| **ours: minilm, ukp-aspect, fine-tuned per fold** | 40.50 | 38.25 |" in text
    assert "| **ours: minilm, nli-triplets** | 0.8123 |" in text
    assert "| SBERT-NLI-base | 70.97 |" in text
    for entry in ("ukp-aspect", "nli-triplets", "MR"):
        assert reproduction_report.DATA_NOTES[entry] in text
    assert "- minilm: 6 layers" in text
    assert "| ukp-aspect | folds/fold0/train_pairs | 90 |" in text
    for number in (1, 2, 3, 4, 5):
        assert (tmp_path / "out" / f"table{number}.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "out" / "table6.png").exists()


def test_report_without_mlflow_creates_no_mlflow_store(tmp_path):
    """As a new user would run it: the real CLI in a fresh HOME, no MLFLOW_TRACKING_URI."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (work / "r.json").write_text(json.dumps(RESULTS))
    import matplotlib

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"HOME": str(home)}
    env["MPLCONFIGDIR"] = matplotlib.get_cachedir()  # reuse the font cache: building it takes most of a minute
    command = [sys.executable, "-m", "sbert_ray.cli", "report", "r.json", "--out", "out", "--no-mlflow"]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (work / "out" / "report.md").is_file()
    created = [
        p for p in [*home.rglob("*"), *work.rglob("*")] if "mlflow" in p.name or p.name in ("sbert-ray", "mlruns")
    ]
    assert created == []  # resolving the default tracking URI used to create ~/sbert-ray/mlflow


def test_report_is_logged_to_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    path = tmp_path / "r.json"
    path.write_text(json.dumps(RESULTS))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result_sets = [reproduction_report.read_results_file(f"run1={path}")]
    run_id = reproduction_report.log_report(
        reproduction_report.build_report(result_sets, tmp_path / "out"), result_sets, uri, "reports"
    )
    client = MlflowClient(uri)
    assert client.get_run(run_id).data.metrics["run1/stsb/spearman_cosine"] == 82.03
    assert "report/report.md" in [a.path for a in client.list_artifacts(run_id, "report")]


def test_generic_printing_shows_every_number():
    flat = flatten(RESULTS, sep="/")
    assert nest(flat) == RESULTS  # the JSON file format round-trips through the flat results
    text = format_results(flat, {"stsb": "spearman_cosine"})
    for value in ("82.03", "38.25", "0.8123", "0.8222", "75.50", "10662", "90"):
        assert value in text
    assert text.splitlines()[0].split() == ["stsb", "spearman_cosine", "82.03", "pearson_cosine", "83.00", "n", "1379"]


def test_task_spec_arguments():
    tasks = parse_tasks("ukp-aspect,senteval:MR,CR,bws")
    assert [t.spec for t in tasks] == ["ukp-aspect", "senteval:MR,CR", "bws"]
    assert isinstance(tasks[1], SentEvalTask) and tasks[1].tasks == ("MR", "CR")
    sts = parse_tasks(["sts"], similarities=["cosine", "dot"])[0]
    assert isinstance(sts, StsTask) and sts.similarities == ("cosine", "dot") and len(sts.datasets) == 7
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("stsb,nonsense")
    with pytest.raises(ValueError, match="unknown similarity"):
        parse_tasks("stsb", similarities=["foo"])


@pytest.mark.parametrize(
    "key, tasks, message",
    [
        ("final_tasks", "[sts, stsx]", "evaluation.final_tasks: unknown task 'stsx'; choose from sts, sts12"),
        ("before_tasks", "[senteval:XX]", "evaluation.before_tasks: task 'senteval:XX': unknown SentEval task ['XX']"),
        ("final_tasks", "['pairs:']", "evaluation.final_tasks: task 'pairs:': task 'pairs' needs a file"),
    ],
)
def test_unknown_tasks_in_a_config_name_their_key(tiny_train_config, capsys, key, tasks, message):
    code = main(["train", str(tiny_train_config()), f"evaluation.{key}={tasks}"])
    assert code == 2  # was a ConfigError naming neither the key nor the file, from inside the run
    assert capsys.readouterr().err.startswith(f"sbert-ray train: error: {message}")


@pytest.mark.parametrize("rows", [0, 1])
def test_a_pairs_file_needs_two_rows_before_the_model_loads(tmp_path, capsys, rows):
    path = tmp_path / "few.csv"
    path.write_text("sentence1,sentence2,score\n" + "a,b,1\n" * rows)
    code = main(["eval", "--model", str(tmp_path / "no-model-here"), "--tasks", f"pairs:{path}"])
    assert code == 2  # was a traceback from the correlation, after the model loaded
    assert capsys.readouterr().err == (
        f"sbert-ray eval: error: --tasks: task 'pairs:{path}': {path}: {rows} scored pair(s); "
        "a correlation needs at least 2\n"
    )


# --- undefined metrics (issue 17) ---------------------------------------------------------------------------


def pairs_file(path, rows) -> str:
    path.write_text("sentence1,sentence2,score\n" + "".join(f"{a},{b},{s}\n" for a, b, s in rows))
    return str(path)


def test_constant_scores_give_an_undefined_metric_with_its_reason(tiny_model_dir):
    from sbert_ray.data.records import ScoredPair
    from sbert_ray.evaluation.sts import evaluate_pairs
    from sbert_ray.models import SentenceEncoder

    model = SentenceEncoder.load(tiny_model_dir)
    same_gold = [ScoredPair("a cat", "a dog", 2.0), ScoredPair("the sun", "a car", 2.0), ScoredPair("x", "y", 2.0)]
    same_pair = [ScoredPair("a cat", "a dog", score) for score in (0.0, 2.5, 5.0)]
    for pairs, reason in ((same_gold, "all 3 gold scores are equal"), (same_pair, "all 3 pairs the same similarity")):
        metrics = evaluate_pairs(model, pairs)  # scipy said NaN (with a warning), and NaN went into the JSON
        for key in ("spearman_cosine", "pearson_cosine"):
            assert math.isnan(metrics[key]) and reason in metrics[key].reason
        assert pickle.loads(pickle.dumps(metrics["spearman_cosine"])).reason == metrics["spearman_cosine"].reason
    assert math.isfinite(evaluate_pairs(model, same_gold[:2] + same_pair[:1])["spearman_cosine"])


def test_eval_output_writes_undefined_metrics_as_null_with_the_reason(tiny_model_dir, tmp_path, capsys):
    tasks = pairs_file(tmp_path / "flat.csv", [("a cat", "a dog", 3), ("the sun", "a car", 3), ("x", "y", 3)])
    output = tmp_path / "results.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", f"pairs:{tasks}", "--output", str(output)]) == 0
    assert (
        "flat                         spearman_cosine undefined  pearson_cosine undefined  n 3"
        in capsys.readouterr().out
    )
    written = json.loads(output.read_text(), parse_constant=pytest.fail)  # NaN is not JSON
    reason = "all 3 gold scores are equal"
    assert written == {
        "flat": {
            "spearman_cosine": None,
            "pearson_cosine": None,
            "n": 3,
            "undefined": {"spearman_cosine": reason, "pearson_cosine": reason},
        }
    }


def test_nest_gives_every_non_finite_value_a_reason():
    nested = nest({"a/b": float("nan"), "a/c": float("inf"), "a/d": 1.5})
    assert nested == {
        "a": {"b": None, "c": None, "d": 1.5, "undefined": {"b": "not a number (nan)", "c": "not a number (inf)"}}
    }


def test_an_undefined_fold_leaves_the_argsim_average_undefined():
    from sbert_ray.evaluation.argsim import average_folds
    from sbert_ray.evaluation.results import Undefined

    folds = {"f0": {"pearson_cosine": 50.0, "spearman_cosine": 40.0, "n": 3}}
    folds["f1"] = {"pearson_cosine": Undefined("all 3 gold scores are equal"), "spearman_cosine": 60.0, "n": 3}
    result = average_folds(folds)
    assert result["spearman_cosine"] == 50.0
    assert math.isnan(result["pearson_cosine"]) and result["pearson_cosine"].reason == "undefined on fold(s) f1"


def test_the_report_reads_null_scores(tmp_path):
    results = {name: {"spearman_cosine": 70.0} for name in ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb")}
    results["sickr"] = {"spearman_cosine": None, "undefined": {"spearman_cosine": "all 9 gold scores are equal"}}
    rows = reproduction_report.our_rows(1, reproduction_report.ResultSet("ours", results, source="x.json"))
    assert rows == {"ours: ours": (70.0, 70.0, 70.0, 70.0, 70.0, 70.0, None, None)}  # no average over a gap
