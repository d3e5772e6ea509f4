"""The final model as an MLflow Model against a real `mlflow server`: logged with the sentence-transformers flavor,
registered with an alias, loaded back through pyfunc and served by `mlflow models serve`, always giving the
embeddings of ``SentenceEncoder.encode``."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import urllib.request
from importlib.metadata import version
from pathlib import Path

import mlflow
import numpy as np
import pytest
from local_cluster import BIN, free_port, start, stop, wait_for_url
from mlflow.tracking import MlflowClient

from sbert_ray.models import SentenceEncoder
from sbert_ray.models.model_card import ModelCardInfo, StageInfo, write_model_card
from sbert_ray.tracking.mlflow_run import RunTracker
from sbert_ray.tracking.model_registry import (
    MODEL_NAME,
    log_sentence_transformer,
    model_uri,
    register_run_model,
)

NAME, ALIAS = "tiny-sbert", "champion"
SENTENCES = [
    "A man is playing a guitar.",
    "A woman slices an onion in the kitchen while the radio plays an old song.",
    "Hi",
    "The weather is lovely today.",
]

_host_lookups: list[str] | None = None


def _record_host_lookup(event: str, args: tuple) -> None:
    if event == "socket.getaddrinfo" and _host_lookups is not None:
        _host_lookups.append(str(args[0]))


@contextlib.contextmanager
def host_lookups():
    """Every host name this process resolves inside the block (Python's socket.getaddrinfo audit event)."""
    global _host_lookups
    _host_lookups = []
    try:
        yield _host_lookups
    finally:
        _host_lookups = None


sys.addaudithook(_record_host_lookup)  # audit hooks cannot be removed; it records only inside host_lookups()


@pytest.fixture(scope="module")
def logged(mlflow_server, tiny_model_dir, tmp_path_factory):
    """A finished run whose final model (with its model card) is logged with the flavor, registered and aliased."""
    model_dir = tmp_path_factory.mktemp("registry") / "final-model"
    shutil.copytree(tiny_model_dir, model_dir)
    with RunTracker(mlflow_server, "model-registry", run_name="tiny") as tracker:
        card = write_model_card(
            model_dir,
            ModelCardInfo(
                base_model="random:tiny",
                stages=[StageInfo("regression", "stsb", "train", 96, {"score_max": 5.0}, 8, 1e-4, 1, 12)],
                hardware="CPU (x86_64)",
                num_workers=2,
                train_seconds=12.0,
                results={"stsb/spearman_cosine": 10.5, "stsb/pearson_cosine": 11.0},
                primary_metrics={"stsb": "spearman_cosine"},
                mlflow_run_id=tracker.run_id,
                tracking_uri=mlflow_server,
                mlflow_model_uri=model_uri(tracker.run_id, NAME, ALIAS),
                registered_model_name=NAME,
            ),
        )
        with host_lookups() as hosts:
            result = log_sentence_transformer(mlflow_server, tracker.run_id, model_dir, NAME, ALIAS)
    return {
        "result": result,
        "run_id": tracker.run_id,
        "encoder": SentenceEncoder.load(model_dir),
        "card": card.read_text(),
        "hosts": hosts,
    }


def test_flavor_is_logged_to_the_run_and_registered_offline(logged, mlflow_server, tmp_path):
    mlflow.set_tracking_uri(mlflow_server)
    result, run_id = logged["result"], logged["run_id"]
    assert set(logged["hosts"]) <= {"127.0.0.1"}, f"logging looked up {logged['hosts']} (the Hub?)"
    assert (result.registered_name, result.version, result.alias) == (NAME, "1", ALIAS)
    client = MlflowClient(mlflow_server)
    assert client.get_model_version_by_alias(NAME, ALIAS).version == "1"
    (model,) = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert model.source_run_id == run_id and model.name == MODEL_NAME and model.model_uri == result.model_uri

    info = mlflow.models.get_model_info(f"models:/{NAME}@{ALIAS}")
    assert "sentence_transformers" in info.flavors
    assert info.signature.inputs.to_dict() == [{"type": "string", "required": True}]
    (output,) = info.signature.outputs.inputs
    assert output.type == np.dtype("float32") and output.shape == (-1, 32)
    requirements = Path(mlflow.pyfunc.get_model_dependencies(f"models:/{NAME}@{ALIAS}")).read_text().split()
    for package in ("sentence-transformers", "transformers", "torch", "mlflow"):
        assert f"{package}=={version(package).partition('+')[0]}" in requirements, requirements  # torch without +cpu

    copy = mlflow.artifacts.download_artifacts(f"models:/{NAME}@{ALIAS}", dst_path=str(tmp_path))
    assert (Path(copy) / "model.sentence_transformer" / "README.md").read_text() == logged["card"]


def test_pyfunc_from_the_alias_gives_the_encoders_embeddings(logged, mlflow_server):
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@{ALIAS}")
    np.testing.assert_allclose(model.predict(SENTENCES), logged["encoder"].encode(SENTENCES), atol=1e-5)


def test_served_model_answers_with_the_encoders_embeddings(logged, mlflow_server, tmp_path):
    port = free_port()
    server = start(
        [
            str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{NAME}@{ALIAS}", "--env-manager", "local",
            "-h", "127.0.0.1", "-p", str(port),
        ],
        tmp_path / "serve.log",
        {"MLFLOW_TRACKING_URI": mlflow_server},
    )  # fmt: skip
    try:
        wait_for_url(f"http://127.0.0.1:{port}/ping", timeout=120, process=server)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps({"inputs": SENTENCES}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            predictions = json.load(response)["predictions"]
    finally:
        stop(server)
    np.testing.assert_allclose(np.array(predictions), logged["encoder"].encode(SENTENCES), atol=1e-5)


def test_a_runs_model_registers_as_a_new_version_and_takes_the_alias(logged, mlflow_server):
    """What a sweep does with its best trial's run."""
    result = register_run_model(mlflow_server, logged["run_id"], NAME, ALIAS)
    assert (result.version, result.model_uri) == ("2", logged["result"].model_uri)
    assert MlflowClient(mlflow_server).get_model_version_by_alias(NAME, ALIAS).version == "2"


def test_registering_a_run_without_a_model_names_the_run(mlflow_server):
    with RunTracker(mlflow_server, "model-registry", run_name="no-model") as tracker:
        pass
    with pytest.raises(ValueError, match=f"run {tracker.run_id} .* has no logged 'sentence_transformer' model"):
        register_run_model(mlflow_server, tracker.run_id, NAME)


def test_sqlite_store_keeps_the_model_beside_its_database(tiny_model_dir, tmp_path):
    """The default store, offline: the model goes to the run's experiment (artifacts beside the database), not to
    MLflow's Default experiment in the working directory, and nothing is looked up on the network."""
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with RunTracker(tracking_uri, "model-registry", run_name="sqlite") as tracker, host_lookups() as hosts:
        # a folder without a card: sentence-transformers would ask the Hub about it
        result = log_sentence_transformer(tracking_uri, tracker.run_id, tiny_model_dir, "tiny-sqlite")
    assert hosts == [], f"logging to a local store looked up {hosts}"
    model = MlflowClient(tracking_uri).get_logged_model(result.model_uri.removeprefix("models:/"))
    assert model.artifact_location.startswith((tmp_path / "artifacts").as_uri())
    mlflow.set_tracking_uri(tracking_uri)
    loaded = mlflow.pyfunc.load_model(model_uri(tracker.run_id, "tiny-sqlite"))  # models:/tiny-sqlite/latest
    np.testing.assert_allclose(
        loaded.predict(SENTENCES), SentenceEncoder.load(tiny_model_dir).encode(SENTENCES), atol=1e-5
    )
