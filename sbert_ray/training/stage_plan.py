"""What the training core reads of a run: per stage a ``StagePlan`` (its settings, its batch plan's inputs, its
optimizer steps), and for a Train worker the ``WorkerPlan`` (the config, the stage plans, the dev score's task and
metric) as the driver resolved it (``runs.plan``).

The driver counts each stage's examples and so its steps once; the workers take those counts from the plan rather
than derive them again (they are the same at every world size: ``stream.stage_steps``). ``WorkerPlan.to_wire()`` is
primitives only: Ray Train's controller unpickles the loop config too, and a dataclass of this package would make it
import this package and torch while the workers start beside it (``tests/test_architecture.py`` checks it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sbert_ray.config import StageConfig, TrainConfig, from_dict, to_dict
from sbert_ray.evaluation.dev_score import DevSpec, dev_spec
from sbert_ray.training.loop import StepSettings
from sbert_ray.training.stream import BatchPlan, batch_plan, stage_steps


@dataclass(frozen=True)
class StagePlan:
    """One stage as the training core reads it."""

    index: int
    stage: StageConfig
    seed: int  # the run's: the stage's batch plan draws from seed + index
    max_workers: int  # the world size the stage's global batch is planned at
    eval_every: int  # optimizer steps between report points; 0: only at the stage's last
    full_every: int  # report points between full-state checkpoints
    # (optimizer steps per epoch, steps of the stage) as the driver counted them; None: counted from the streams
    # when the stage opens (a run in one process, without a driver: the benchmark's --local, tests).
    steps: tuple[int, int] | None = None

    @property
    def total_steps(self) -> int:
        return self.steps[1]

    def batch_plan(self, world_size: int, rank: int) -> BatchPlan:
        """How rank ``rank`` of ``world_size`` live workers cuts its streams into batches."""
        return batch_plan(self.stage, self.index, self.seed, world_size, rank, self.max_workers)

    def steps_for(self, rows: Sequence[int]) -> tuple[int, int]:
        """(optimizer steps per epoch, steps of the stage): the planned ones, else those of sources of ``rows``
        examples (in the order of the stage's ``datasets``)."""
        if self.steps is not None:
            return self.steps
        weights = [d.weight for d in self.stage.datasets] if self.stage.datasets else [1.0]
        return stage_steps(list(rows), weights, self.stage, self.batch_plan(self.max_workers, 0))

    def step_settings(self, steps: tuple[int, int], device, precision: str, chunks: int = 1) -> StepSettings:
        """What the stage's steps need on this worker: ``steps`` as ``steps_for`` gives them, ``device``, the
        resolved ``precision``, ``chunks`` micro-batches per global micro-batch here (``batches.BatchSplit``)."""
        per_epoch, total = steps
        stage = self.stage
        return StepSettings(
            total_steps=total,
            batches_per_epoch=per_epoch * stage.grad_accum_steps,
            device=device,
            global_batch=stage.batch_size,
            precision=precision,
            grad_accum_steps=stage.grad_accum_steps * chunks,
            max_grad_norm=stage.max_grad_norm,
            eval_every=self.eval_every,
            full_every=self.full_every,
        )


def stage_plans(config: TrainConfig, rows: Sequence[Sequence[int]] | None = None) -> tuple[StagePlan, ...]:
    """Each stage's plan; with ``rows`` (examples per stage and source, counted by the driver) its step counts."""
    plans = []
    for index, stage in enumerate(config.stages):
        plan = StagePlan(
            index,
            stage,
            config.seed,
            config.scaling.max_workers,
            config.evaluation.eval_every,
            config.checkpoint.full_every,
        )
        if rows is not None:
            plan = dataclasses.replace(plan, steps=plan.steps_for(rows[index]))
        plans.append(plan)
    return tuple(plans)


@dataclass(frozen=True)
class WorkerPlan:
    """What a Train worker trains by: the run's config, each stage's plan, the dev score's task and metric."""

    config: TrainConfig
    stages: tuple[StagePlan, ...]
    dev: DevSpec

    def to_wire(self) -> dict:
        """Primitives: the config as a dict, each stage's step counts, the dev task's (absolute) spec and metric."""
        return {
            "config": to_dict(self.config),
            "steps": [stage.steps and list(stage.steps) for stage in self.stages],
            "dev": self.dev.to_wire(),
        }

    @classmethod
    def from_wire(cls, wire: dict) -> WorkerPlan:
        config = from_dict(TrainConfig, wire["config"])
        stages = tuple(
            dataclasses.replace(plan, steps=steps and tuple(steps))
            for plan, steps in zip(stage_plans(config), wire["steps"], strict=True)
        )
        return cls(config, stages, DevSpec.from_wire(wire["dev"]))

    @classmethod
    def of(cls, config: TrainConfig, rows: Sequence[Sequence[int]] | None = None) -> WorkerPlan:
        """The plan of ``config`` with sources of ``rows`` examples per stage (None: counted from the streams as
        each stage opens, for a run in one process without a driver)."""
        return cls(config, stage_plans(config, rows), dev_spec(config.evaluation, model_type=config.model.type))
