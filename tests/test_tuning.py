"""Sweeps: search-space parsing and trial sizing (the sweeps themselves run in test_reliability.py and
test_cluster_sweep.py)."""

from __future__ import annotations

import re

import pytest
import yaml
from ray.tune.search.optuna import OptunaSearch

from sbert_ray.config import ConfigError, TrainConfig, load_config
from sbert_ray.runs.sweep import max_concurrent_trials
from sbert_ray.tuning import SearchSpace, SweepConfig
from sbert_ray.tuning.space import METRIC

STAGE_OPTIONS = {
    "regression-stsb": {"dataset": "stsb", "objective": "regression"},
    "softmax-nli": {"dataset": "nli-offline", "objective": "softmax", "loss": {"concat": ["u", "v"]}, "limit": 100},
}


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
