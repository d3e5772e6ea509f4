import re
import time

import pytest

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, TrainConfig, apply_override, flatten, load_config, parse_yaml, to_dict
from sbert_ray.tuning import SweepConfig


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "name: x\nstages:\n  - dataset: stsb\n    epochs: 2\n")
    config = load_config(path, ["stages.0.learning_rate=3e-5", "model.pooling=max", "scaling.num_workers=2"])
    assert config.name == "x"
    assert config.stages[0].epochs == 2 and config.stages[0].learning_rate == pytest.approx(3e-5)
    assert config.model.pooling == "max" and config.scaling.num_workers == 2
    assert isinstance(config, TrainConfig)


def test_registry_keys():
    config = load_config(None, ["tracking.registered_model_name=minilm-stsb", "tracking.alias=champion"])
    assert (config.tracking.registered_model_name, config.tracking.alias) == ("minilm-stsb", "champion")


def test_override_adds_a_stage():
    raw = {"stages": [{"dataset": "nli-offline", "objective": "softmax"}]}
    apply_override(raw, "stages.1.dataset=stsb")
    assert raw["stages"][1] == {"dataset": "stsb"}


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("nmae: x\n", [], "unknown key 'nmae'"),
        ("stages:\n  - objectve: softmax\n", [], "unknown key stages.0.'objectve'"),
        ("", ["model.pooling=avg"], "model.pooling: 'avg' is not one of mean, max, cls"),
        ("", ["stages.0.epochs=two"], "stages.0.epochs: expected int"),
        ("", ["stages.0.objective=softmax", "stages.0.loss.concat=[u, w]"], "stages.0.loss.concat.1: 'w' is not one"),
        ("", ["stages.0.objective=triplet", "stages.0.loss.marginn=2"], "unknown key stages.0.loss.'marginn'"),
        ("", ["stages.0.loss.concat=[u, v]"], "for objective 'regression' (its settings: none)"),
        ("", ["stages.0.objective=rank"], "stages.0.objective: 'rank' is not one of softmax, regression"),
        ("", ["stages.0.batch_size=15", "stages.0.grad_accum_steps=2"], "divisible"),
        ("", ["scaling.placement_strategy=spread"], "scaling.placement_strategy: 'spread' is not one of PACK, SPREAD"),
        ("", ["oops"], "key=value"),
        ("- a\n", [], "top level must be a mapping"),
        ("", ["tracking.alias=champion"], "tracking.alias needs tracking.registered_model_name"),
        ("", ["tracking.registered_model_name=team/model"], "tracking.registered_model_name: 'team/model'"),
        ("", ["tracking.registered_model_name=m", "tracking.alias=v2"], "tracking.alias: 'v2'"),
        ("", ["tracking.registered_model_name=m", "tracking.alias=latest"], "tracking.alias: 'latest'"),
    ],
)
def test_bad_configs_name_the_key_and_file(tmp_path, text, overrides, message):
    path = write(tmp_path, text) if text else None  # an empty file is an error of its own
    with pytest.raises(ConfigError, match=None) as err:
        load_config(path, overrides)
    assert message in str(err.value)
    if text:
        assert str(path) in str(err.value)


def test_loss_settings_are_typed_by_the_loss_class():
    config = load_config(None, ["stages.0.objective=triplet", "stages.0.loss={distance: manhattan, margin: 2}"])
    assert config.stages[0].loss == {"distance": "manhattan", "margin": 2.0}
    assert isinstance(config.stages[0].loss["margin"], float)  # YAML's int becomes the declared float


@pytest.mark.parametrize("objective", ["mnrl", "cached_mnrl"])
def test_duplicate_masking_of_in_batch_negatives_can_be_turned_off(objective: str):
    config = load_config(None, [f"stages.0.objective={objective}", "stages.0.loss.mask_duplicates=false"])
    assert config.stages[0].loss == {"mask_duplicates": False}
    with pytest.raises(ConfigError, match="stages.0.loss.mask_duplicates: expected bool"):
        load_config(None, [f"stages.0.objective={objective}", "stages.0.loss.mask_duplicates=sometimes"])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/c.yaml")


def test_flatten_round_trip_keys():
    flat = flatten(to_dict(TrainConfig()))
    assert flat["stages.0.objective"] == "regression"
    assert flat["stages.0.score_max"] == 5.0
    assert flat["model.max_seq_length"] == 128


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[1] / "jobs" / "configs").glob("*.yaml"))
    assert len(configs) >= 7
    for path in configs:
        if "sweep" in path.name or "ablation" in path.name:
            continue
        load_config(path)


# --- values that used to pass validation (issue 11) ------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["scaling.num_workers=0"], "scaling.num_workers must be >= 1, got 0"),  # was a ZeroDivisionError
        (["scaling.num_workers=-3"], "scaling.num_workers must be >= 1, got -3"),  # was "divisible by -3"
        (["scaling.num_workers=[2, 1]"], "scaling.num_workers: [min, max] needs min <= max, got [2, 1]"),
        (["scaling.num_workers=[0, 2]"], "scaling.num_workers must be >= 1, got 0"),
        (["scaling.num_workers=[1, 2, 4]"], "scaling.num_workers: a number or [min, max], got [1, 2, 4]"),
        (["scaling.num_workers=[1, two]"], "scaling.num_workers.1: expected int, got 'two'"),
        # 6 examples in 2 micro-batches of 3 leave the 4th worker of an elastic [3, 4] run without one
        (
            ["scaling.num_workers=[3, 4]", "stages.0.batch_size=6", "stages.0.grad_accum_steps=2"],
            "stages.0.batch_size=6 is the global batch and must hold at least one example per worker and "
            "accumulation step: scaling.num_workers * grad_accum_steps = 8 (scaling.num_workers=[3, 4])",
        ),  # fmt: skip
        (["scaling.use_gpu=true", "scaling.num_workers=[1, 2]", "scaling.gpus_per_worker=0.5"], "NCCL refuses"),
        (["stages.0.score_max=0"], "stages.0.score_max must be > 0"),
        (["stages.0.learning_rate=.nan"], "stages.0.learning_rate: nan is not a finite number"),
        (["stages.0.learning_rate=.inf"], "stages.0.learning_rate: inf is not a finite number"),
        (["stages.0.learning_rate=1e400"], "stages.0.learning_rate: '1e400' is not a finite number"),
        (["stages.0.limit=-5"], "stages.0.limit must be >= 1, got -5"),
        (["stages.0.limit=0"], "stages.0.limit must be >= 1, got 0 (leave it out or null for no limit)"),
        (["stages.0.max_steps=-1"], "stages.0.max_steps must be >= 1, got -1"),
        (["stages.0.max_steps=0"], "stages.0.max_steps must be >= 1, got 0"),
        (["evaluation.batch_size=0"], "evaluation.batch_size must be >= 1"),
        (["evaluation.batch_size=-2"], "evaluation.batch_size must be >= 1"),
        (["evaluation.dev_limit=1"], "evaluation.dev_limit must be >= 2"),
        (["evaluation.async_dev=maybe"], "evaluation.async_dev: 'maybe' is not one of auto, True, False"),
        (["evaluation.dev_resources={CPU: 0}"], "evaluation.dev_resources.CPU must be > 0"),
        (["evaluation.dev_resources={CPU: 1, GPU: 1.5}"], "evaluation.dev_resources.GPU: a share of one GPU or a"),
        (["evaluation.dev_resources={CPU: 1, TPU: 1}"], "evaluation.dev_resources: 'TPU' is not CPU or GPU"),
        (["evaluation.dev_workers=0"], "evaluation.dev_workers must be >= 1, got 0"),
        (["scaling.cpus_per_worker=0"], "scaling.cpus_per_worker must be > 0"),
        (["scaling.cpus_per_worker=-1"], "scaling.cpus_per_worker must be > 0"),
        (["scaling.resource_wait_s=-1"], "scaling.resource_wait_s must be >= 0, got -1"),
        (["checkpoint.full_every=0"], "checkpoint.full_every must be >= 1, got 0"),
        (["stages.0.adam_eps=-1e-6"], "stages.0.adam_eps must be > 0"),
        (["stages.0.weight_decay=-0.01"], "stages.0.weight_decay must be >= 0"),
        (["stages.0.max_grad_norm=-1"], "stages.0.max_grad_norm must be > 0"),
        (["seed=-1"], "seed must be in [0, 2**32)"),
        (["scaling.use_gpu=true", "scaling.num_workers=2", "scaling.gpus_per_worker=0.5"], "NCCL refuses"),
        (["scaling.use_gpu=true", "scaling.gpus_per_worker=1.5"], "scaling.gpus_per_worker: more than one GPU"),
        (["scaling.precision=half"], "scaling.precision: 'half' is not one of auto, bf16, fp16, fp32"),
        (["name=../elsewhere"], "name: '../elsewhere' must be a folder name"),
        (["stages.3.learning_rate=1e-5"], "override 'stages.3.learning_rate': index 3 is past the end of a list of 1"),
        (["stages.0.concat=[u, v"], "override 'stages.0.concat': '[u, v' is not a YAML value"),
    ],
)
def test_values_that_must_not_pass_name_the_key(tmp_path, overrides, message):
    path = write(tmp_path, "name: x\nstages:\n  - dataset: stsb\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert message in str(err.value) and str(path) in str(err.value)


def test_an_elastic_range_is_kept_and_told_apart_from_a_fixed_count():
    elastic = load_config(None, ["scaling.num_workers=[1, 2]"]).scaling
    assert (elastic.min_workers, elastic.max_workers, elastic.ray_num_workers()) == (1, 2, (1, 2))
    fixed = load_config(None, ["scaling.num_workers=2"]).scaling
    assert not fixed.elastic and fixed.ray_num_workers() == 2
    assert load_config(None, ["scaling.num_workers=[2, 2]"]).scaling.ray_num_workers() == 2  # one size: fixed


@pytest.mark.parametrize("num_workers", ["[3, 4]", "[48, 64]", "3"])
def test_a_global_batch_that_does_not_divide_by_every_worker_count_is_accepted(num_workers):
    """The global batch is dealt unevenly where it must be (``training.batches.split_batch``): 16 over 3 workers,
    1024 over 48 to 64 (the old rule refused every one)."""
    batch = 1024 if "48" in num_workers else 16
    config = load_config(None, [f"scaling.num_workers={num_workers}", f"stages.0.batch_size={batch}"])
    assert config.stages[0].batch_size == batch


def test_gpu_fractions_stay_allowed_for_one_worker():
    config = load_config(None, ["scaling.use_gpu=true", "scaling.gpus_per_worker=0.5"])
    assert config.scaling.gpus_per_worker == 0.5


def test_override_inside_a_scalar_is_a_config_error(tmp_path):
    path = write(tmp_path, "name: x\n")  # was a TypeError: 'str' object does not support item assignment
    with pytest.raises(ConfigError, match=r"override 'name.x': cannot set 'x' inside a str value \('x'\)"):
        load_config(path, ["name.x=1"])


def test_override_may_only_append_at_the_end_of_a_list():
    raw = {"stages": [{"dataset": "stsb"}]}
    apply_override(raw, "stages.0.epochs=2")  # an existing item
    apply_override(raw, "stages.1.dataset=nli-offline")  # exactly at the end: appends
    assert raw["stages"] == [{"dataset": "stsb", "epochs": 2}, {"dataset": "nli-offline"}]
    with pytest.raises(ConfigError, match="index 5 is past the end of a list of 2"):
        apply_override(raw, "stages.5.dataset=stsb")
    assert len(raw["stages"]) == 2  # nothing was added on the way to the error


def test_override_fills_a_null_mapping():
    raw = {"stages": [{"columns": None}]}
    apply_override(raw, "stages.0.columns.sentence1=premise")
    assert raw["stages"][0]["columns"] == {"sentence1": "premise"}


@pytest.mark.parametrize(
    "text, key",
    [
        ("stages:\n  - learning_rate: .nan\n", "stages.0.learning_rate"),
        ("scaling:\n  cpus_per_worker: .inf\n", "scaling.cpus_per_worker"),
        ("evaluation:\n  final_tasks: [sts, -.inf]\n", "evaluation.final_tasks.1"),
        ("tracking:\n  experiment: .nan\n", "tracking.experiment"),
    ],
)
def test_nan_and_inf_are_refused_anywhere_in_a_yaml_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"{path}: {key}: -?(nan|inf) is not a finite number"):
        load_config(path)


def test_unreadable_config_files_are_config_errors(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="latin1.yaml: cannot read the config"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path)  # a folder


def test_mixed_type_unknown_keys_are_reported(tmp_path):
    path = write(tmp_path, "1: a\nzz: b\n")  # sorting int and str keys used to raise a TypeError
    with pytest.raises(ConfigError, match="unknown key '1'"):
        load_config(path)


# --- config files that used to pass (issue 17) ----------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n\n# and another\n", "---\n", "~\n", "{}\n"])
def test_an_empty_config_file_is_refused_not_trained_with_every_default(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}: the config is empty"):
        load_config(path)
    with pytest.raises(ConfigError, match="the config is empty"):  # overrides do not make the file right
        load_config(path, ["name=x"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: a\nseed: 1\nname: b\n", "line 3: key 'name' given twice (first on line 1)"),
        ("model:\n  name: a\n  pooling: mean\n  name: b\n", "line 4: key 'name' given twice (first on line 2)"),
        ("stages:\n  - {dataset: stsb, epochs: 1, epochs: 2}\n", "line 2: key 'epochs' given twice (first on line 2)"),
        ("scaling:\n  use_gpu: true\n  use_gpu: yes\n", "line 3: key 'use_gpu' given twice (first on line 2)"),
    ],
)
def test_duplicate_keys_are_refused_with_file_and_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:  # PyYAML silently kept the last value
        load_config(path)
    assert str(err.value) == f"{path}, {message}"


def test_duplicate_keys_in_an_override_value_are_refused():
    with pytest.raises(ConfigError, match=r"override 'model': .* \(line 1: key 'name' given twice"):
        load_config(None, ["model={name: random:tiny, name: random:mini}"])


def test_merge_keys_may_still_override_what_they_merge():
    assert parse_yaml("b: &b {x: 1, y: 2}\nc: {<<: *b, x: 3}\n")["c"] == {"x": 3, "y": 2}


def alias_bomb(levels: int = 10, width: int = 10) -> str:
    """The "billion laughs": each level lists the level below ``width`` times; 10 levels are 10**10 values."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\nname: *l9\n"


def test_a_yaml_alias_bomb_fails_fast(tmp_path):
    path = write(tmp_path, alias_bomb())
    assert path.stat().st_size < 2048
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:  # used to hang: every walk over the config expanded every alias
        load_config(path)
    assert time.perf_counter() - start < 5  # the expanded size is counted once per node: milliseconds
    assert str(err.value) == f"{path}, line 5: aliases expand this value past 100,000 values"
    with pytest.raises(ConfigError, match="is not a YAML value .*aliases expand this value past"):
        load_config(None, ["evaluation.final_tasks=" + alias_bomb().replace("\n", ", ").join("{}")])


def test_a_recursive_alias_is_refused(tmp_path):
    path = write(tmp_path, "name: x\nstages: &s\n  - dataset: stsb\n    loss: *s\n")
    with pytest.raises(ConfigError, match=rf"^{path}, line 2: an alias refers to a value that holds it$"):
        load_config(path)


def test_invalid_yaml_is_one_line_with_the_line_number(tmp_path):
    path = write(tmp_path, "name: x\nstages: [a\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}, line 3: ") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name, problem",
    [
        ("run\x00one", "holds a control character"),
        ("run\none", "holds a control character"),
        ("run\\one", "holds a path separator"),
        ("a/b", "holds a path separator"),
        ("..", "is '.' or '..'"),
        ("", "is empty"),
        ("x" * 201, "is 201 bytes long (at most 200)"),
        ("é" * 101, "is 202 bytes long (at most 200)"),
    ],
)
def test_names_must_be_usable_as_folder_names(name, problem):
    for cls, key in ((TrainConfig, "name"), (SweepConfig, "name")):
        config = cls(name=name)
        with pytest.raises(ConfigError, match=f"^{key}: .* must be a folder name: it {re.escape(problem)} "):
            config.validate()


def test_a_name_with_spaces_and_accents_is_a_folder_name():
    TrainConfig(name="café run 2").validate()
    SweepConfig(name="x" * 200).validate()


def test_a_global_batch_too_small_for_the_workers_is_one_line_from_train_before_ray(tiny_train_config, capsys):
    """As a user meets it: 6 examples in 2 micro-batches of 3 cannot give each of 4 workers one example."""
    overrides = ["scaling.num_workers=[3, 4]", "stages.0.batch_size=6", "stages.0.grad_accum_steps=2"]
    assert main(["train", str(tiny_train_config()), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sbert-ray train: error: ") and err.count("\n") == 1
    assert "stages.0.batch_size=6 is the global batch and must hold at least one example per worker" in err


def test_a_word_or_a_value_where_a_key_takes_either():
    """``bool | Literal["auto"]`` and ``int | Literal["auto"]`` keys: the word is a choice, anything else the
    value's type, and an unknown word an error naming the key."""
    assert load_config(None, []).scaling.compile == "auto"
    assert load_config(None, ["scaling.compile=false"]).scaling.compile is False
    with pytest.raises(ConfigError, match="scaling.compile"):
        load_config(None, ["scaling.compile=sometimes"])
    loss = ["stages.0.objective=cached_mnrl"]
    assert load_config(None, [*loss, "stages.0.loss.mini_batch_size=auto"]).stages[0].loss == {
        "mini_batch_size": "auto"
    }
    assert load_config(None, [*loss, "stages.0.loss.mini_batch_size=64"]).stages[0].loss == {"mini_batch_size": 64}
    with pytest.raises(ConfigError, match="stages.0.loss.mini_batch_size"):
        load_config(None, [*loss, "stages.0.loss.mini_batch_size=big"])
