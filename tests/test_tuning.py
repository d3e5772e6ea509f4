"""Sweeps: search-space parsing, and real sweeps of tiny models on a local Ray cluster tracked in MLflow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from ray.tune.search.optuna import OptunaSearch

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, TrainConfig, load_config
from sbert_ray.runs.sweep import max_concurrent_trials
from sbert_ray.tuning import SearchSpace, SweepConfig
from sbert_ray.tuning.space import METRIC

STAGE_OPTIONS = {
    "regression-stsb": {"dataset": "stsb", "objective": "regression"},
    "softmax-nli": {"dataset": "nli-offline", "objective": "softmax", "loss": {"concat": ["u", "v"]}, "limit": 100},
}


@pytest.fixture
def write_sweep(tmp_path: Path, tiny_train_config):
    """A sweep over the shared tiny training config, with one 0.5-CPU worker per trial."""

    def write(name: str, **settings) -> Path:
        base = yaml.safe_load(tiny_train_config(name="base").read_text())
        base["scaling"] = {"num_workers": 1, "cpus_per_worker": 0.5}
        base["checkpoint"]["max_failures"] = 0  # a broken trial fails at once instead of restarting
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, "base": base, **settings}, sort_keys=False))
        return path

    return write


# ------------------------------------------------------------------------------------ the search space


def test_trial_config_applies_whole_mappings_then_keys_inside_them():
    space = SearchSpace(
        TrainConfig(),
        {
            "stages.0.batch_size": {"choice": [32]},
            "stages.0": {"choice": STAGE_OPTIONS},
            "stages.0.loss": {"grid": [{}, {"concat": ["u*v"]}]},
            "stages.0.limit": {"grid": [50, 200]},
            "stages.0.learning_rate": {"loguniform": ["1e-5", 1.0e-4]},
        },
    )
    loss = next(p for p in space.params if p.key == "stages.0.loss")
    assert list(loss.options) == ["{}", '{"concat": ["u*v"]}']  # Tune sees plain strings
    sampled = {
        "stages.0": "softmax-nli",
        "stages.0.batch_size": 32,
        "stages.0.loss": loss.extremes()[1],
        "stages.0.limit": 200,
        "stages.0.learning_rate": 3e-5,
    }
    stage = space.config(sampled).stages[0]
    assert (stage.dataset, stage.objective, stage.batch_size, stage.learning_rate) == (
        "nli-offline",
        "softmax",
        32,
        3e-5,
    )
    assert stage.loss == {"concat": ["u*v"]} and stage.limit == 200  # deeper keys win over the option's values
    assert stage.warmup_ratio == TrainConfig().stages[0].warmup_ratio  # untouched keys keep the base values
    with pytest.raises(ConfigError, match="for objective 'regression'"):  # a setting of another objective
        space.config(sampled | {"stages.0": "regression-stsb"})


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"search_space": {"stages.0.learnig_rate": {"choice": [1e-5]}}}, "'stages.0.learnig_rate' is not a key"),
        ({"search_space": {"stages.3.learning_rate": {"choice": [1e-5]}}}, "'stages.3.learning_rate' is not a key"),
        ({"search_space": {"stages.0": {"choice": {"x": {"objectiv": "triplet"}}}}}, "stages.0.'objectiv'"),
        ({"search_space": {"model.pooling": {"choice": ["mean", "meen"]}}}, "'meen' is not one of"),
        ({"search_space": {"model.pooling": {"choise": ["mean"]}}}, "expected one of {choice | grid"),
        ({"search_space": {"stages.0.learning_rate": {"loguniform": [0, 1e-4]}}}, "0 < low < high"),
        ({"search_space": {"stages.0.batch_size": {"choice": [16, 1]}}}, "at least one example per worker"),
        ({"search": "optuna", "search_space": {"model.pooling": {"grid": ["mean"]}}}, "use choice instead of grid"),
        ({"search": "grid", "search_space": {"model.pooling": {"choice": ["mean"]}}}, "every search_space key"),
        ({"serach": "grid"}, "unknown key 'serach'"),
        ({"base": {"scaling": {"num_workers": [1, 2]}}}, "base.scaling.num_workers: [1, 2] is elastic"),
        ({"search_space": {"scaling.num_workers": {"choice": [2, [1, 2]]}}}, "must stay one number"),
    ],
)
def test_sweep_config_errors_name_the_key(tmp_path, settings, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": {"scaling": {"num_workers": 2}}} | settings))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, cls=SweepConfig)


def test_optuna_samples_every_kind_of_key():
    """Optuna only takes plain categorical values: option labels stand in for mappings and lists."""
    space = SearchSpace(
        TrainConfig(),
        {
            "stages.0": {"choice": STAGE_OPTIONS},
            "model.pooling": {"choice": ["mean", "max", "cls"]},
            "stages.0.learning_rate": {"loguniform": [1e-5, 1e-3]},
            "stages.0.warmup_ratio": {"uniform": [0.0, 0.2]},
        },
    )
    searcher = OptunaSearch(seed=0)
    assert searcher.set_search_properties(METRIC, "max", space.param_space())
    for i in range(5):
        config = space.config(searcher.suggest(f"trial_{i}"))
        assert 1e-5 <= config.stages[0].learning_rate <= 1e-3 and 0 <= config.stages[0].warmup_ratio <= 0.2
        assert config.stages[0].objective in ("regression", "softmax")


def test_concurrency_follows_cluster_and_trial_size(connect):  # the session's 2-CPU head
    def extremes(num_workers: list[int]) -> list[TrainConfig]:
        base = load_config(None, ["scaling.cpus_per_worker=0.5", "stages.0.batch_size=16"])
        return list(SearchSpace(base, {"scaling.num_workers": {"grid": num_workers}}).extreme_configs())

    assert max_concurrent_trials(extremes([1])) == 3  # 2 CPUs / (0.5 + the trial's token 0.01)
    assert max_concurrent_trials(extremes([1, 2])) == 1  # sized by the largest trial


# ---------------------------------------------------------------------------------- sweeps on Ray


def trial_statuses(sweep_dir: Path) -> list[str]:
    """Trial statuses as Tune last saved them (what a resumed sweep starts from)."""
    states = sorted(sweep_dir.glob("experiment_state-*.json"))
    if not states:
        return []
    try:
        trials = json.loads(states[-1].read_text())["trial_data"]
    except json.JSONDecodeError:  # caught while Tune rewrites it
        return []
    return [json.loads(trial)["status"] for trial, _ in trials]


def test_killed_sweep_resumes_without_rerunning_finished_trials(local_ray, write_sweep, capsys):
    """Killed after its first trial, the sweep continues with --resume: the finished trial is not run again, the
    interrupted one runs to the end and the sweep ends with its summary."""
    path = write_sweep(
        "resume",
        search_space={"model": {"grid": {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}}}},
        scheduler="fifo",
        max_concurrent_trials=1,
    )
    sweep = load_config(path, cls=SweepConfig)
    sweep_dir = Path(sweep.base.checkpoint.storage_path) / "resume"
    # The killed driver joins the session's cluster (Ray ends its job's actors and placement groups when it dies).
    # Tune saves its state each second, so the kill right after the first trial catches the second one in flight.
    first = subprocess.Popen(
        [sys.executable, "-m", "sbert_ray.cli", "tune", str(path)],
        env={**os.environ, "RAY_ADDRESS": local_ray, "TUNE_GLOBAL_CHECKPOINT_S": "1"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while "TERMINATED" not in trial_statuses(sweep_dir):
            assert time.time() < deadline and first.poll() is None, "the first trial did not finish"
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    client = MlflowClient(sweep.base.tracking.tracking_uri)
    experiment_id = client.get_experiment_by_name(sweep.base.tracking.experiment).experiment_id
    (finished,) = client.search_runs([experiment_id], "attributes.status = 'FINISHED'")

    # A second start never mixes two sweeps; refused before Ray starts.
    assert main(["tune", str(path)]) == 2 and "pass --resume" in capsys.readouterr().err
    assert main(["tune", str(path), "--resume"]) == 0, capsys.readouterr().err[-3000:]  # from this process
    assert "(resumed)" in capsys.readouterr().out

    runs = client.search_runs([experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]  # the same parent run, continued
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.status == "FINISHED" and len(children) == 2
    again_finished = children.pop(finished.info.run_name)
    assert (again_finished.info.run_id, again_finished.info.end_time) == (finished.info.run_id, finished.info.end_time)
    assert [r.info.status for r in children.values()] == ["FINISHED"]
    assert trial_statuses(sweep_dir) == ["TERMINATED", "TERMINATED"]
    assert (sweep_dir / "summary" / "best_config.yaml").exists()
