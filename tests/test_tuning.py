"""Sweeps: search-space parsing, trial sizing, and ASHA's decisions on dev scores a report late (the sweeps themselves
run in test_reliability.py and test_cluster_sweep.py)."""

from __future__ import annotations

import math
import random
import re
from types import SimpleNamespace

import pytest
import yaml
from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.search.optuna import OptunaSearch

from sbert_ray.config import ConfigError, TrainConfig, load_config
from sbert_ray.runs.sweep import asha_scheduler, max_concurrent_trials
from sbert_ray.tuning import SearchSpace, SweepConfig
from sbert_ray.tuning.dev_lag import DEV_STEP, LaggedDevScores, scored_now
from sbert_ray.tuning.space import METRIC, AshaConfig

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


# ------------------------------------------------------------------------------------ ASHA on lagged dev scores

ASHA = AshaConfig(grace_period=4, reduction_factor=2, max_t=1_000)
EVAL_EVERY, REPORTS = 4, 6  # each trial reports at steps 4, 8, ..., 24; rungs at 4, 8 and 16


def asha_stops(curves: list[list[float]], lagged: bool, scheduler: ASHAScheduler | None = None) -> dict[int, int]:
    """The sweep's ASHA scheduler fed each trial's reports as its gate hands them to Tune: trial i scores
    ``curves[i][k]`` at report k, inline (on that report) or ``lagged`` (on the next; scorer done by then). The
    trials report in turn (concurrent trials in step); a trial that ends reports its last score again (the trial's
    final result). Returns trial -> the global step of the report at which ASHA stopped it."""
    scheduler = scheduler or asha_scheduler(ASHA)  # the sweep's
    scheduler.set_search_properties(METRIC, "max")
    trials = [SimpleNamespace(trial_id=str(i)) for i in range(len(curves))]  # all the scheduler reads of a trial
    for trial in trials:
        scheduler.on_trial_add(None, trial)
    lags, stopped = [LaggedDevScores() for _ in curves], {}
    for k in range(REPORTS):
        for i, (trial, curve) in enumerate(zip(trials, curves, strict=True)):
            if i in stopped:
                continue
            step = (k + 1) * EVAL_EVERY
            if lagged:
                if k:
                    lags[i].scored(step - EVAL_EVERY, curve[k - 1])  # the previous checkpoint's scorer finished
                result = lags[i].for_tune({"global_step": step})
            else:
                result = scored_now({"global_step": step, METRIC: curve[k]})
            if scheduler.on_trial_result(None, trial, result) == TrialScheduler.STOP:
                stopped[i] = step
    for i, (trial, curve) in enumerate(zip(trials, curves, strict=True)):
        if i not in stopped:
            scheduler.on_trial_complete(
                None, trial, scored_now({"global_step": REPORTS * EVAL_EVERY, METRIC: curve[-1]})
            )
    return stopped


def test_asha_stops_the_same_trials_on_lagged_dev_scores_one_report_later():
    """Issue 31.2's claim, at the scheduler: a 4-trial ASHA sweep whose dev scores come a report late (async_dev)
    stops the same trials at the same rungs as the sweep scored inline, each one report (EVAL_EVERY steps) later,
    on 200 seeded sets of noisy curves. Comparing lagged scores at the report's own step instead (ASHA's time =
    global_step) stops other trials on some of them: the check can fail."""
    rng = random.Random(0)
    naive_differs = 0
    for _ in range(200):
        curves = [[rng.uniform(0, 100) for _ in range(REPORTS)] for _ in range(4)]
        inline = asha_stops(curves, lagged=False)
        assert inline  # ASHA stops someone: the comparison says something
        lagged = asha_stops(curves, lagged=True)
        assert lagged == {trial: step + EVAL_EVERY for trial, step in inline.items()}
        naive = ASHAScheduler(time_attr="global_step", grace_period=4, reduction_factor=2, max_t=1_000)
        naive_differs += set(asha_stops(curves, lagged=True, scheduler=naive)) != set(inline)
    assert naive_differs > 0


def test_lagged_dev_scores_carry_the_previous_report_and_wait_for_it():
    lag = LaggedDevScores()
    first = lag.for_tune({"global_step": 4})
    assert math.isnan(first[METRIC]) and DEV_STEP not in first  # nothing scored yet: ASHA skips it
    assert not lag.ready()  # step 4's score has not arrived: the gate waits
    lag.scored(4, 71.5)
    assert lag.ready()
    assert lag.for_tune({"global_step": 8}) == {"global_step": 8, METRIC: 71.5, DEV_STEP: 4}
    lag.scored(8, None)  # that scoring failed: the report goes without, the lag stays one report
    assert math.isnan(lag.for_tune({"global_step": 12})[METRIC])


def test_a_sweep_takes_async_dev_in_base_only():
    sweep = SweepConfig()
    sweep.base.evaluation.async_dev = True
    sweep.validate()
    sweep.search_space = {"evaluation.async_dev": {"choice": [True, False]}}
    with pytest.raises(ConfigError, match=r"^search_space: trials are ranked by one dev score, scored one way"):
        sweep.validate()
