"""Models a run could not use are refused with the file named, before any Ray or MLflow work: corrupt weights,
pickled weights (unless allowed), module paths leaving the model folder, custom code, a max_seq_length beyond the
position embeddings. Plus the eval command's own bad sizes."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, load_config, parse_device
from sbert_ray.models import ModelError, SentenceEncoder, check_model
from sbert_ray.models.encoder import position_limit
from sbert_ray.runs.train_run import run_training


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_corrupt_safetensors_names_the_file(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a download cut short
    message = rf"{weights}: not a readable safetensors file \(Error while deserializing header"
    with pytest.raises(ModelError, match=message):  # was a bare SafetensorError
        SentenceEncoder.load(model_copy)
    with pytest.raises(ModelError, match=rf"^model.name: {message}"):
        check_model(str(model_copy), 128)


def test_train_refuses_a_corrupt_model_before_mlflow(model_copy: Path, tiny_train_config, tmp_path: Path) -> None:
    (model_copy / "model.safetensors").write_bytes(b"not safetensors at all")
    config = load_config(tiny_train_config(), [f"model.name={model_copy}"])
    with pytest.raises(ModelError, match="model.safetensors: not a readable safetensors file"):
        run_training(config)
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was opened (it used to be, and left RUNNING)


def test_pickled_weights_need_an_explicit_opt_in(model_copy: Path, tiny_model_dir: Path) -> None:
    torch.save(load_file(model_copy / "model.safetensors"), model_copy / "pytorch_model.bin")
    (model_copy / "model.safetensors").unlink()
    message = r"pytorch_model.bin: only pickled PyTorch weights, which can run code when loaded"
    with pytest.raises(ModelError, match=message):
        SentenceEncoder.load(model_copy)
    with pytest.raises(ModelError, match=message):
        check_model(str(model_copy), 128)
    check_model(str(model_copy), 128, allow_unsafe_weights=True)
    opted_in = SentenceEncoder.load(model_copy, allow_unsafe_weights=True)
    sentences = ["a pickled model", "loads when allowed"]
    np.testing.assert_allclose(
        opted_in.encode(sentences), SentenceEncoder.load(tiny_model_dir).encode(sentences), rtol=1e-5, atol=1e-6
    )
    config = load_config(None, [f"model.name={model_copy}", "model.allow_unsafe_weights=true"])
    assert config.model.allow_unsafe_weights


@pytest.mark.parametrize("path", ["../outside", "/etc", "1_Pooling/../../outside", "link"])
def test_module_paths_stay_inside_the_model_folder(model_copy: Path, tmp_path: Path, path: str) -> None:
    (tmp_path / "outside").mkdir()
    (model_copy / "link").symlink_to(tmp_path / "outside")
    modules = json.loads((model_copy / "modules.json").read_text())
    modules[1]["path"] = path  # the Pooling module
    (model_copy / "modules.json").write_text(json.dumps(modules))
    message = rf"modules.json: the Pooling module's path '{path}' leads outside the model folder"
    with pytest.raises(ModelError, match=message):
        SentenceEncoder.load(model_copy)
    with pytest.raises(ModelError, match=rf"^model.name: .*{message}"):
        check_model(str(model_copy), 128)


def test_shard_names_stay_inside_the_model_folder(model_copy: Path) -> None:
    (model_copy / "model.safetensors").rename(model_copy / "shard.safetensors")
    index = {"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": "../shard.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"the shard '../shard.safetensors' leads outside the model folder"):
        SentenceEncoder.load(model_copy)


def test_custom_model_code_never_runs(model_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    config = json.loads((model_copy / "config.json").read_text())
    config |= {"model_type": "evil-bert", "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}}
    (model_copy / "config.json").write_text(json.dumps(config))
    (model_copy / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceEncoder.load(model_copy)
    with pytest.raises(ModelError, match="(?s)^model.name: .*trust_remote_code"):
        check_model(str(model_copy), 128)
    assert not marker.exists()


def test_every_model_load_in_the_package_refuses_remote_code() -> None:
    """Every from_pretrained / SentenceTransformer call in sbert_ray says trust_remote_code=False explicitly."""
    package = Path(__file__).resolve().parents[1] / "sbert_ray"
    calls = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            function = getattr(node, "func", None)
            name = getattr(function, "attr", None) or getattr(function, "id", None)
            if isinstance(node, ast.Call) and name in ("from_pretrained", "SentenceTransformer"):
                trust = next((k.value for k in node.keywords if k.arg == "trust_remote_code"), None)
                calls.append((f"{path.name}:{node.lineno}", isinstance(trust, ast.Constant) and trust.value is False))
    assert len(calls) >= 5  # the encoder, the model checks, the model card, the MLflow flavor
    assert [where for where, explicit in calls if not explicit] == []


@pytest.mark.parametrize("name", ["random:tiny", "tiny folder"])
def test_max_seq_length_beyond_the_position_embeddings(tiny_model_dir: Path, name: str) -> None:
    ref = str(tiny_model_dir) if name == "tiny folder" else name
    check_model(ref, 512)
    with pytest.raises(ModelError, match=r"^model.max_seq_length: 100000 is beyond the 512 positions of"):
        check_model(ref, 100_000)
    if name == "tiny folder":
        with pytest.raises(ModelError, match="max_seq_length 100000 is beyond the 512 positions"):
            SentenceEncoder.load(ref, max_seq_length=100_000)


@pytest.mark.parametrize(
    "positions, tokenizer_limit, limit",
    [
        (512, 512, 512),  # BERT
        (514, 512, 512),  # RoBERTa / MPNet / XLM-R: positions start after the padding index
        (512, 128, 512),  # sentence-transformers >= 6 saves max_seq_length as model_max_length: not a limit
        (512, VERY_LARGE_INTEGER, 512),  # a tokenizer without a limit
        (None, 512, None),  # relative positions: no limit from the config
    ],
)
def test_position_limit(positions, tokenizer_limit, limit) -> None:
    config = SimpleNamespace(**({"max_position_embeddings": positions} if positions else {}))
    assert position_limit(SimpleNamespace(model_max_length=tokenizer_limit), config) == limit


@pytest.mark.parametrize("name", ["random:tiny", "tiny folder"])
@pytest.mark.parametrize("length", [1, 2])
def test_max_seq_length_must_leave_room_for_text(tiny_model_dir: Path, name: str, length: int) -> None:
    """BERT's tokenizer adds [CLS] and [SEP]: at 1 it cannot cut at all (a long text then overflowed the position
    embeddings in a worker), at 2 every sentence became [CLS] [SEP], one embedding for all."""
    ref = str(tiny_model_dir) if name == "tiny folder" else name
    check_model(ref, 3)
    message = f"{length} leaves no token for the text: {ref!r} adds 2 special tokens to every input; use at least 3"
    with pytest.raises(ModelError) as err:
        check_model(ref, length)
    assert str(err.value) == f"model.max_seq_length: {message}"
    if name == "tiny folder":
        with pytest.raises(ModelError, match=f"^max_seq_length {length} leaves no token for the text"):
            SentenceEncoder.load(ref, max_seq_length=length)


@pytest.mark.parametrize(
    "length, message", [(100000, "100000 is beyond the 512 positions"), (2, "2 leaves no token for the text")]
)
def test_prepare_checks_max_seq_length(tiny_train_config, tmp_path: Path, length: int, message: str) -> None:
    config = load_config(tiny_train_config(), [f"model.max_seq_length={length}"])
    with pytest.raises(ModelError, match=f"model.max_seq_length: {message}"):
        run_training(config)
    assert not (tmp_path / "mlflow.db").exists()  # before any MLflow run


def test_unknown_random_shape_is_a_config_error() -> None:
    with pytest.raises(ModelError, match="model.name: unknown random BERT shape 'huge'"):
        check_model("random:huge", 128)


# --- sbert-ray eval arguments ------------------------------------------------------------------------------


def test_encode_refuses_a_batch_size_below_one(tiny_model_dir: Path) -> None:
    encoder = SentenceEncoder.load(tiny_model_dir)
    for batch_size in (0, -1):  # -1 used to return uninitialised memory as embeddings
        with pytest.raises(ValueError, match=f"batch_size must be >= 1, got {batch_size}"):
            encoder.encode(["a", "b"], batch_size=batch_size)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
        (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["--workers", "0"], "argument --workers: must be >= 1, got 0"),
    ],
)
def test_eval_refuses_bad_sizes(tiny_model_dir: Path, capsys, arguments: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", str(tiny_model_dir), "--tasks", "stsb", *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:1", "mps"])
def test_device_forms_torch_accepts(text: str) -> None:
    assert parse_device(text) == text


@pytest.mark.parametrize("text", ["foo", "gpu", "cuda:x", "xla", "meta", "", "CUDA"])
def test_unknown_devices_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"^'{text}' is not a device: use cpu, cuda, cuda:N or mps$"):
        parse_device(text)


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--model", "random:tiny"],
        ["encode", "--model", "random:tiny", "--input", "stsb", "--output", "unused"],
        ["bench", "encode", "--model", "random:tiny"],
        ["bench", "train", "--model", "random:tiny"],
    ],
)
def test_every_device_flag_names_the_accepted_forms(capsys, command: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # was a torch RuntimeError traceback, or a silent CPU run
        main([*command, "--device", "foo"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert error.endswith("error: argument --device: 'foo' is not a device: use cpu, cuda, cuda:N or mps")


def test_eval_refuses_a_gpu_this_process_does_not_have(tiny_model_dir: Path, data_dir: Path, capsys) -> None:
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU torch sees (cuda:0 on a CPU machine)
    code = main(
        ["eval", "--model", str(tiny_model_dir), "--tasks", "stsb", "--data-dir", str(data_dir), "--device", missing]
    )
    assert code == 2
    assert f"sbert-ray eval: error: --device {missing}: torch sees " in capsys.readouterr().err
