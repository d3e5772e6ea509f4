"""A training run's final model: copied out of the last checkpoint and swapped into ``output_dir``, carded, logged
to the run and registered."""

from __future__ import annotations

import shutil
from pathlib import Path

import ray.train

from sbert_ray.config import StageConfig
from sbert_ray.evaluation.tasks import Results
from sbert_ray.models.model_card import ModelCardInfo, StageInfo, write_model_card, write_reranker_card
from sbert_ray.runs import owned_paths
from sbert_ray.runs.plan import RunPlan
from sbert_ray.tracking.mlflow_run import RunTracker
from sbert_ray.tracking.model_registry import log_sentence_transformer, model_uri
from sbert_ray.training.state import MODEL_DIR

MODEL_ARTIFACTS = "model"  # the final model's folder among the run's artifacts


def save_final_model(checkpoint: ray.train.Checkpoint, output_dir: Path, **run: str) -> None:
    """Copy the model of the last checkpoint into a staging folder beside ``output_dir``, mark it as ours (naming
    ``run``: name, folder, MLflow run) and swap it in: a crash never leaves a partial folder at ``output_dir``, and
    our previous model there stays until the new one is in place (``owned_paths.replace_model``)."""
    with owned_paths.staging_beside(output_dir) as staging:
        with checkpoint.as_directory() as directory:
            shutil.copytree(Path(directory) / MODEL_DIR, staging / MODEL_DIR)
        owned_paths.write_model_marker(staging / MODEL_DIR, **run)
        owned_paths.replace_model(staging / MODEL_DIR, output_dir, staging)


def log_final_model(plan: RunPlan, card: ModelCardInfo, tracker: RunTracker) -> None:
    """The final model (already in ``output_dir``) carded, logged as artifacts and as the sentence-transformers
    flavor, and registered when the config names a registered model. A reranker is carded and logged as artifacts
    only: MLflow's sentence-transformers flavor loads bi-encoders (the config refuses registering one)."""
    config, tracking = plan.config, plan.config.tracking
    if config.model.type == "cross_encoder":
        write_reranker_card(config.output_dir, card, MODEL_ARTIFACTS)
        tracker.log_artifacts(config.output_dir, MODEL_ARTIFACTS)
        return
    write_model_card(config.output_dir, card)
    tracker.log_artifacts(config.output_dir, MODEL_ARTIFACTS)
    tracker.call(
        log_sentence_transformer,
        plan.store.uri,
        tracker.run_id,
        config.output_dir,
        tracking.registered_model_name,
        tracking.alias,
    )


def model_card_info(
    plan: RunPlan, metrics: dict, train_seconds: float, final: Results, tracker: RunTracker
) -> ModelCardInfo:
    """What the final model's card says beyond its folder: data and settings per stage, hardware, time, scores."""
    config, tracking = plan.config, plan.config.tracking
    return ModelCardInfo(
        base_model=config.model.name,
        stages=[_stage_info(*stage) for stage in zip(config.stages, map(sum, plan.rows), plan.steps, strict=True)],
        hardware=metrics.get("hardware", "unknown"),
        num_workers=config.scaling.max_workers,
        train_seconds=train_seconds,
        results=final,
        primary_metrics={entry: metric for entry, (metric, _) in plan.tasks.final.primary_scores(final).items()},
        name=config.name,
        mlflow_run_id=tracker.run_id,
        tracking_uri=str(plan.store),
        # A reranker is no MLflow model (``log_final_model``)
        mlflow_model_uri=model_uri(tracker.run_id, tracking.registered_model_name, tracking.alias)
        if config.model.type == "bi_encoder"
        else None,
        registered_model_name=tracking.registered_model_name,
    )


def _stage_info(stage: StageConfig, examples: int, steps: int) -> StageInfo:
    return StageInfo(
        objective=stage.objective,
        dataset=stage.dataset,
        split=stage.split,
        n_examples=examples,
        loss=stage.loss,
        batch_size=stage.batch_size,
        learning_rate=stage.learning_rate,
        epochs=stage.epochs,
        steps=steps,
        hyperparameters={
            "warmup_ratio": stage.warmup_ratio,
            "weight_decay": stage.weight_decay,
            "adam_eps": stage.adam_eps,
            "max_grad_norm": stage.max_grad_norm,
            "grad_accum_steps": stage.grad_accum_steps,
        },
    )
