"""A saved model as an MLflow Model: the sentence-transformers flavor, a Model Registry version and an alias.

The plain ``model/`` artifact folder loads in sentence-transformers, but MLflow knows nothing about it. Logged with
``mlflow.sentence_transformers`` it gets an MLmodel file (signature, input example, pinned requirements), so
``mlflow.pyfunc.load_model``, the Model Registry (versions, aliases) and ``mlflow models serve`` work on it.

Offline: the flavor saves the model again with ``SentenceTransformer.save``, which writes a model card. It reuses the
README.md of the folder the model was loaded from (our card, see ``sbert_ray.models.model_card``); for a folder
without one it generates a card and looks the base model up on the Hugging Face Hub, which ``local_files_only``
stops. Requirements are pinned to the installed versions rather than inferred (inference loads the model again in a
subprocess).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

import mlflow
from mlflow.tracking import MlflowClient

MODEL_NAME = "sentence_transformer"  # the logged model's name; also its path in runs:/<run id>/sentence_transformer
INPUT_EXAMPLE = ["A man is playing a guitar.", "A woman is slicing an onion."]


@dataclass(frozen=True)
class LoggedSentenceTransformer:
    model_uri: str  # models:/m-<id>, the logged model itself
    registered_name: str | None = None
    version: str | None = None  # the new version of registered_name
    alias: str | None = None  # now pointing at that version


def model_uri(run_id: str, registered_model_name: str | None = None, alias: str | None = None) -> str:
    """Where the model logged by ``log_sentence_transformer`` loads from (what ``mlflow.pyfunc.load_model`` and
    ``mlflow models serve -m`` take), known before it is logged, e.g. for the model card."""
    if registered_model_name:
        return f"models:/{registered_model_name}@{alias}" if alias else f"models:/{registered_model_name}/latest"
    return f"runs:/{run_id}/{MODEL_NAME}"


def log_sentence_transformer(
    tracking_uri: str,
    run_id: str,
    model_dir: str | os.PathLike[str],
    registered_model_name: str | None = None,
    alias: str | None = None,
) -> LoggedSentenceTransformer:
    """Log the sentence-transformers folder ``model_dir`` to run ``run_id`` with MLflow's sentence-transformers
    flavor; with ``registered_model_name`` register it as a new version, and point ``alias`` at that version."""
    if alias and not registered_model_name:
        raise ValueError("an alias needs a registered model name")
    # Imported here: sentence-transformers takes ~3 s to import, which every `sbert-ray train` driver would pay
    # before its first check (a bad row or key is refused without it).
    from sentence_transformers import SentenceTransformer

    # local_files_only also keeps the card generator (for a folder without a card) from asking the Hub about it.
    model = SentenceTransformer(os.fspath(model_dir), device="cpu", local_files_only=True, trust_remote_code=False)
    client = MlflowClient(tracking_uri)
    # Created here rather than by log_model, which puts a model logged to a run that is not the fluent active run
    # into the Default experiment instead of the run's.
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id)
    _use_tracking_uri(tracking_uri)
    info = mlflow.sentence_transformers.log_model(
        model,
        name=MODEL_NAME,
        model_id=logged.model_id,
        run_id=run_id,
        input_example=INPUT_EXAMPLE,  # the signature (a list of strings -> float32 [n, dim]) is inferred from it
        pip_requirements=pinned_requirements(),
    )
    if registered_model_name is None:
        return LoggedSentenceTransformer(info.model_uri)
    return register(tracking_uri, info.model_uri, registered_model_name, alias)


def pinned_requirements() -> list[str]:
    """What the flavor needs (MLflow adds itself), pinned to the installed versions without a local label such as
    ``+cpu``: ``torch==2.13.0+cpu`` is not on PyPI. MLflow 3.17 means to strip it too but cannot with packaging 26."""
    packages = ("sentence-transformers", "transformers", "torch")
    return [f"{package}=={metadata.version(package).partition('+')[0]}" for package in packages]


def register_run_model(
    tracking_uri: str, run_id: str, name: str, alias: str | None = None
) -> LoggedSentenceTransformer:
    """Register the sentence-transformers model that run ``run_id`` logged (e.g. a sweep's best trial) as a new
    version of ``name``, and point ``alias`` at it."""
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND name = '{MODEL_NAME}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
        max_results=1,
    )
    if not models:
        raise ValueError(f"MLflow run {run_id} at {tracking_uri} has no logged {MODEL_NAME!r} model to register")
    return register(tracking_uri, models[0].model_uri, name, alias)


def register(tracking_uri: str, model_uri: str, name: str, alias: str | None = None) -> LoggedSentenceTransformer:
    """A new version of registered model ``name`` (created if new) from ``model_uri``; ``alias`` moves to it."""
    _use_tracking_uri(tracking_uri)
    version = mlflow.register_model(model_uri, name).version
    if alias:
        MlflowClient(tracking_uri).set_registered_model_alias(name, alias, version)
    return LoggedSentenceTransformer(model_uri, name, str(version), alias)


def _use_tracking_uri(tracking_uri: str) -> None:
    # log_model and register_model are fluent: they read the process-wide URI (the registry follows it unless
    # MLFLOW_REGISTRY_URI says otherwise). Everything else in this package passes its URI explicitly.
    mlflow.set_tracking_uri(tracking_uri)
