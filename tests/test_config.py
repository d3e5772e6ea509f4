import pytest

from sbert_ray.config import ConfigError, TrainConfig, apply_override, flatten, load_config, to_dict


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
        ("", ["stages.0.concat=[u, w]"], "stages.0.concat: 'w'"),
        ("", ["stages.0.batch_size=15", "scaling.num_workers=2"], "divisible"),
        ("", ["scaling.placement_strategy=spread"], "scaling.placement_strategy: 'spread' is not one of PACK, SPREAD"),
        ("", ["oops"], "key=value"),
        ("- a\n", [], "top level must be a mapping"),
    ],
)
def test_bad_configs_name_the_key_and_file(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=None) as err:
        load_config(path, overrides)
    assert message in str(err.value)
    if text:
        assert str(path) in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/c.yaml")


def test_flatten_round_trip_keys():
    flat = flatten(to_dict(TrainConfig()))
    assert flat["stages.0.objective"] == "regression"
    assert flat["stages.0.concat"] == ["u", "v", "|u-v|"]
    assert flat["model.max_seq_length"] == 128


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[1] / "jobs" / "configs").glob("*.yaml"))
    assert len(configs) >= 7
    for path in configs:
        if "sweep" in path.name or "ablation" in path.name:
            continue
        load_config(path)
