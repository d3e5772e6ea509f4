"""Model cards: a README.md in a saved model folder that says what the model is, how it was trained, how well it
scores and how to load it, in the sentence-transformers style (Hub metadata as YAML, then Markdown).

sentence-transformers' own card generator (``sentence_transformers.base.model_card``) is fed by its Trainer:
hyperparameters from TrainingArguments, scores keyed by evaluator objects, datasets as ``datasets.Dataset``, and it
has no place for stages, workers or MLflow. So the card is rendered from plain data with a Jinja template through
``huggingface_hub.ModelCard``, as sentence-transformers renders its own.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoConfig

from sbert_ray.models.st_layout import read_st_layout

TEMPLATE = Path(__file__).with_name("model_card_template.md")
FRAMEWORKS = ("sbert-ray", "sentence-transformers", "transformers", "torch", "ray", "mlflow")
EXAMPLE_SENTENCES = ["A man is playing a guitar.", "A woman is slicing an onion.", "The weather is lovely today."]


@dataclass(frozen=True)
class StageInfo:
    """One training stage as it ran."""

    objective: str
    dataset: str
    split: str
    n_examples: int
    loss: dict[str, Any]  # the objective's settings, e.g. {"concat": ["u", "v", "|u-v|"]}
    batch_size: int  # global: summed over workers and accumulation steps
    learning_rate: float
    epochs: int
    steps: int  # optimizer steps taken
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # the rest: warm-up, weight decay, ...


@dataclass(frozen=True)
class ModelCardInfo:
    """What is known about a trained model beyond its folder (pooling, length and size are read from the folder)."""

    base_model: str
    stages: list[StageInfo]
    hardware: str  # e.g. "NVIDIA H100 80GB HBM3" or "CPU (x86_64)"
    num_workers: int
    train_seconds: float
    results: dict[str, float]  # final evaluation, flat: {"stsb/spearman_cosine": 85.08, ...}
    primary_metrics: dict[str, str]  # the headline metric of each entry: {"stsb": "spearman_cosine", ...}
    name: str | None = None  # the training run's name
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    mlflow_model_uri: str | None = None  # models:/<name>@<alias> or runs:/<run id>/<model name>
    registered_model_name: str | None = None


def write_model_card(model_dir: str | os.PathLike[str], info: ModelCardInfo) -> Path:
    """Render the card for the sentence-transformers folder ``model_dir`` into ``model_dir/README.md``."""
    model_dir = Path(model_dir).resolve()
    layout = read_st_layout(str(model_dir))
    if layout is None:
        raise ValueError(f"{model_dir}: not a sentence-transformers folder (no modules.json)")
    config = AutoConfig.from_pretrained(model_dir, subfolder=layout.transformer_subfolder, trust_remote_code=False)
    hub_base_model = _hub_id(info.base_model)
    card_data = ModelCardData(
        base_model=hub_base_model,
        library_name="sentence-transformers",
        pipeline_tag="sentence-similarity",
        tags=["sentence-transformers", "sentence-similarity", "feature-extraction", "sbert-ray"],
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        info=info,
        hub_base_model=hub_base_model,
        model_dir=str(model_dir),
        layout=layout,
        embedding_dim=config.hidden_size,
        stages=[_stage_row(number, stage) for number, stage in enumerate(info.stages, start=1)],
        evaluation=_evaluation_rows(info.results, info.primary_metrics),
        train_time=_duration(info.train_seconds),
        versions=_versions(),
        examples=EXAMPLE_SENTENCES,
    )
    path = model_dir / "README.md"
    card.save(path)
    return path


def write_reranker_card(model_dir: str | os.PathLike[str], info: ModelCardInfo, artifact_path: str) -> Path:
    """A short card for the reranker (sentence-transformers' ``CrossEncoder`` folder) ``model_dir``, into
    ``model_dir/README.md``: what it is, how to load it, its stages, where the run logged it (``artifact_path``)."""
    model_dir = Path(model_dir).resolve()
    card_data = ModelCardData(
        base_model=_hub_id(info.base_model),
        library_name="sentence-transformers",
        pipeline_tag="text-ranking",
        tags=["sentence-transformers", "cross-encoder", "reranker", "sbert-ray"],
    )
    stages = [_stage_row(number, stage) for number, stage in enumerate(info.stages, start=1)]
    rows = [
        f"| {s['number']} | {s['objective']} | {s['dataset']} | {s['examples']} | {s['batch_size']} | "
        f"{s['learning_rate']} | {s['epochs']} | {s['steps']} |"
        for s in stages
    ]
    versions = ", ".join(f"{name} {version}" for name, version in _versions().items())
    text = "\n".join([
        f"---\n{card_data.to_yaml()}\n---",
        f"# {info.name or model_dir.name}: a reranker",
        "",
        "A cross-encoder trained with sbert-ray: it reads a (query, passage) pair together and scores how well the "
        "passage answers the query, in (0, 1) (the sigmoid of its one logit).",
        "",
        "```python",
        "from sentence_transformers import CrossEncoder",
        "",
        f'model = CrossEncoder("{model_dir}")',
        'scores = model.predict([("How do I bake bread?", "Mix flour, water and yeast, then bake.")])',
        "```",
        "",
        "## Training",
        "",
        f"Base model: {info.base_model}. {info.num_workers} worker(s) on {info.hardware}, "
        f"{_duration(info.train_seconds)}.",
        "",
        "| Stage | Objective | Dataset | Examples | Batch size | Learning rate | Epochs | Steps |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"MLflow run {info.mlflow_run_id} ({info.tracking_uri}): this folder is its artifact {artifact_path}/.",
        "",
        f"Versions: {versions}.",
        "",
    ])  # fmt: skip
    path = model_dir / "README.md"
    path.write_text(text)
    return path


def _stage_row(number: int, stage: StageInfo) -> dict[str, Any]:
    """The stage's cells as table text."""
    return {
        "number": number,
        "objective": stage.objective,
        "dataset": _cell(stage.dataset),
        "split": stage.split,
        "examples": f"{stage.n_examples:,}",
        "loss": _settings(stage.loss),
        "batch_size": stage.batch_size,
        "learning_rate": f"{stage.learning_rate:g}",
        "epochs": stage.epochs,
        "steps": stage.steps,
        "hyperparameters": _settings(stage.hyperparameters),
    }


def _settings(settings: dict[str, Any]) -> str:
    """{"concat": ["u", "v"], "scale": 20.0} -> "concat=u, v; scale=20.0" (| escaped for a table cell)"""
    parts = [f"{k}={', '.join(map(str, v)) if isinstance(v, list | tuple) else v}" for k, v in settings.items()]
    return _cell("; ".join(parts))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | ends a Markdown table cell


def _evaluation_rows(results: dict[str, float], primary: dict[str, str]) -> list[dict[str, Any]]:
    """One row per entry, nested ones (``sts12/subsets/MSRpar``) included: the primary metric of its top-level entry
    (as ``evaluation.tasks.headlines`` keys them) first, then the others."""
    by_entry: dict[str, dict[str, float]] = {}
    for key, value in results.items():
        entry, sep, metric = key.rpartition("/")
        if not sep:
            raise ValueError(f"evaluation result {key!r} is not of the form <entry>/<metric>")
        by_entry.setdefault(entry, {})[metric] = value
    rows = []
    for entry, metrics in by_entry.items():
        main = primary.get(entry.split("/")[0])  # sts12/subsets/MSRpar is headed as sts12 is
        if main not in metrics:
            raise ValueError(f"evaluation entry {entry!r} has no primary metric among {sorted(metrics)}")
        others = ", ".join(f"{k} {_number(v)}" for k, v in metrics.items() if k != main)
        rows.append({"entry": _cell(entry), "metric": main, "value": _number(metrics[main]), "others": others})
    return rows


def _hub_id(ref: str) -> str | None:
    """``ref`` when it names a Hugging Face Hub model (the card's ``base_model``), None for folders and random:*."""
    if ref.startswith("random:") or Path(ref).expanduser().exists():
        return None
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return None
    return ref


def _number(value: float) -> str:
    if float(value).is_integer() and abs(value) >= 1:
        return str(int(value))
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return " ".join(f"{n} {unit}" for n, unit in ((hours, "h"), (minutes, "min"), (secs, "s")) if n) or "0 s"


def _versions() -> dict[str, str]:
    versions = {"Python": platform.python_version()}
    for package in FRAMEWORKS:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions
