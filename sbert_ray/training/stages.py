"""Every stage of a run on one worker, without Ray: the encoder from its start or a checkpoint, and per stage the
batches, the objective, the optimizer (restored when the checkpoint stopped inside the stage) and ``train_stage``.

The Ray Train worker (``training.worker``) runs this as one DDP rank; the training benchmark runs it in one
process. Stages a checkpoint finished are skipped; a checkpoint taken mid-stage resumes at its micro-batch.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from sbert_ray.config import TrainConfig
from sbert_ray.losses.registry import build_loss
from sbert_ray.models import SentenceEncoder, load_encoder
from sbert_ray.models.cross_encoder import CrossEncoderModel
from sbert_ray.models.padded_widths import buckets_for
from sbert_ray.training.loop import Reporter, Telemetry, Trainee, never, train_stage
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.optimization import prepare_optimization
from sbert_ray.training.sharding import shard_encoder
from sbert_ray.training.sparse_embeddings import sparse_embedding_gradients
from sbert_ray.training.stage_plan import StagePlan
from sbert_ray.training.state import MODEL_DIR, TrainState, is_full_state, load_rng_states, set_rng_state
from sbert_ray.training.stream import SourceStream, StageBatches

log = logging.getLogger(__name__)


def alone(objective: torch.nn.Module) -> torch.nn.Module:
    return objective


@dataclasses.dataclass(frozen=True)
class Worker:
    """This training process: its device and arithmetic (a resolved precision), its rank among ``world_size``
    workers, how its objective joins theirs (``distribute``: DDP from the Ray adapter; as it is alone), whether the
    encoder is sharded across them instead (``shard``: FSDP, ``training.sharding``; ``distribute`` leaves the
    objective as it is), and whether it was asked to stop (``stop_requested``: a preemption notice,
    ``training.preemption``)."""

    device: torch.device
    precision: str = "fp32"
    rank: int = 0
    world_size: int = 1
    distribute: Callable[[torch.nn.Module], torch.nn.Module] = alone
    shard: bool = False
    stop_requested: Callable[[], bool] = never


class Started(NamedTuple):
    """Where this worker starts: its encoder on its device, the state training resumes from, and the checkpoint
    folder it was restored from (None: a new run)."""

    encoder: SentenceEncoder
    state: TrainState
    restored: Path | None


def seed_everything(seed: int) -> None:
    """torch (CPU and every GPU), numpy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def start_worker(config: TrainConfig, worker: Worker, restored: Path | None) -> Started:
    """Threads and seeds set, the encoder on its device (from the checkpoint folder ``restored``, else built from
    the config and seed) and the state training resumes from; a restored run's random streams continue where the
    checkpoint left them."""
    torch.set_num_threads(config.scaling.threads_per_worker())
    seed_everything(config.seed)
    if restored is None:
        encoder, state = load_encoder(**dataclasses.asdict(config.model), seed=config.seed), TrainState()
    elif not is_full_state(restored):
        raise ValueError(f"{restored} is a weights-only checkpoint: a run resumes from a full-state one")
    else:
        encoder, state = _restored_encoder(config, restored / MODEL_DIR), TrainState.load(restored)
    # On its device before any optimizer is built or restored: optimizer state follows its parameters' device.
    encoder.to(worker.device)
    if worker.shard:  # from whole weights (a new or a restored model): any world size shards them
        shard_encoder(encoder, keep_meta_copy=worker.rank == 0, precision=worker.precision)
    if restored is not None:
        rng_states = load_rng_states(restored)
        if len(rng_states) == worker.world_size:
            set_rng_state(rng_states[worker.rank], worker.device)
        else:
            log.warning(  # an elastic run resized, or a checkpoint older than saved random states
                "checkpoint holds random states of %d workers, not %d: reseeded", len(rng_states), worker.world_size
            )
    return Started(encoder, state, restored)


def _restored_encoder(config: TrainConfig, model_dir: Path) -> SentenceEncoder | CrossEncoderModel:
    """The model of a checkpoint; with ``model.lora``, its frozen base built from the config again (a LoRA
    checkpoint's weights are merged) and the checkpoint's adapter in it, to train on apart."""
    if config.model.type == "cross_encoder":
        return CrossEncoderModel.load(model_dir)
    if config.model.lora is None:
        return SentenceEncoder.load(str(model_dir))
    from sbert_ray.models.lora import restore_adapter  # peft: only for runs that use it

    encoder = load_encoder(**dataclasses.asdict(config.model), seed=config.seed)
    restore_adapter(encoder.transformer, model_dir)
    return encoder


def train_stages(
    plans: Sequence[StagePlan],
    start: Started,
    stage_data: Callable[[int], list[SourceStream]],
    worker: Worker,
    reporter: Reporter,
    meter: StepMeter,
) -> TrainState:
    """Train every stage not finished in ``start.state`` (``stage_data(i)``: stage i's sources as this worker
    streams them, opened when the stage starts); raises ``Diverged`` on a NaN or infinite loss."""
    state = start.state
    for plan in plans:
        index = plan.index
        if index < state.stage or (index == state.stage and state.stage_done):
            continue
        if index > state.stage:
            state = TrainState(stage=index, global_step=state.global_step)
        resume_from = start.restored if (start.restored is not None and state.step) else None
        at = Started(start.encoder, state, resume_from)
        state = _train_stage(plan, at, stage_data(index), worker, reporter, meter)
    return state


def _train_stage(
    plan: StagePlan,
    start: Started,
    sources: list[SourceStream],
    worker: Worker,
    reporter: Reporter,
    meter: StepMeter,
) -> TrainState:
    """One stage's batches, objective and optimizer (restored from ``start.restored``), then its steps."""
    stage, encoder, state, resume_from = plan.stage, start.encoder, start.state, start.restored
    device, world_size = worker.device, worker.world_size
    if encoder.prompts and not encoder.pooling.include_prompt:
        raise ValueError(
            "training a model whose pooling leaves prompt tokens out (include_prompt: false) is not supported: "
            "the columns of a batch carry different prompts, which one forward cannot leave out"
        )
    batching = plan.batch_plan(world_size, worker.rank)
    steps = plan.steps_for([s.rows for s in sources])  # the driver's count (> 0), or the local streams'
    settings = plan.step_settings(steps, device, worker.precision, batching.chunks)
    settings = dataclasses.replace(settings, stop_requested=worker.stop_requested)
    meter.data_ready()
    # A head restored from the checkpoint must not advance the random stream restored with it.
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(rng_devices) if resume_from is not None else nullcontext():
        objective = build_loss(stage.objective, encoder, stage.loss, stage.matryoshka_dims, stage.matryoshka_weights)
    objective.expect_rows_per_worker(batching.largest_micro_batch)  # the gather's padding: no count to read
    optimization = prepare_optimization(objective, stage, settings.total_steps, device, worker.precision, resume_from)
    if resume_from is not None:
        reporter.log({"train/resumed_from_step": state.step}, step=state.global_step)
    if not worker.shard:  # (FSDP: the config refused objectives with a head; embedding gradients stay dense)
        sparse_embedding_gradients(objective, device, world_size)  # before DDP wraps the objective: it decides then
    model = worker.distribute(objective)
    tokenizer = encoder.tokenizer
    pad_left = tokenizer.padding_side == "left"
    buckets = buckets_for(device, encoder.compiled, encoder.max_seq_length)
    batches = StageBatches(
        sources, batching, settings.batches_per_epoch, state.epoch, state.batch,
        collate=lambda batch: batch[0].collate(batch[1], tokenizer.pad_token_id, pad_left, device, buckets),
    )  # fmt: skip
    return train_stage(
        Trainee(model, optimization), batches, settings, state, Telemetry(reporter, meter), batches.metrics
    )
