"""The training loop in one process, no Ray: gradient accumulation, clipping, the schedule, the NaN stop, the
cadence of loss reads and report points, and resume from a checkpoint onto the uninterrupted run.

Claims of exact arithmetic (accumulation, clipping) run the tiny BERT in float64 with plain SGD at lr 1, so that a
parameter's change is minus its gradient: float64 rounds at ~1e-16 relative, so two orders of summation differ by
~1e-13 of the largest gradient, far inside the 1e-9 allowed, while the errors these tests catch (a missing
division by the accumulation steps, a clip skipped) are of order 1.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import pytest
import torch

from sbert_ray.config import EvalConfig, ModelConfig, ScalingConfig, StageConfig, TrainConfig
from sbert_ray.losses import CosineSimilarityLoss, MultipleNegativesRankingLoss
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.loop import (
    LOG_EVERY,
    Diverged,
    LocalReporter,
    MicroBatch,
    StepSettings,
    Stopped,
    Telemetry,
    Trainee,
    train_stage,
)
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.optimization import Optimization, linear_warmup_then_decay, prepare_optimization
from sbert_ray.training.stage_plan import stage_plans
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.state import MODEL_DIR, TRAINING_FILE, TrainState, is_full_state
from sbert_ray.training.stream import local_sources

CPU = torch.device("cpu")
PAIRS = [
    ("A man plays a guitar.", "Someone makes music on a guitar.", 0.9),
    ("A dog runs in the park.", "Cats sleep all day long.", 0.1),
    ("A woman slices an onion.", "An onion is being cut by a woman.", 1.0),
    ("The sky is blue.", "Stock markets fell sharply today in early trading.", 0.0),
]
EXACT = 1e-9  # relative to the largest change: float64 reordering errors are ~1e-13 of it (module docstring)


def float64_objective(model_dir: Path) -> CosineSimilarityLoss:
    """The tiny BERT in float64 without dropout: the same inputs give the same gradients however batched."""
    encoder = SentenceEncoder.load(str(model_dir)).double()
    for module in encoder.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return CosineSimilarityLoss(encoder)


def micro_batch(encoder: SentenceEncoder, pairs, epoch: int = 0, position: int = 1) -> MicroBatch:
    features = [encoder.tokenize([pair[0] for pair in pairs]), encoder.tokenize([pair[1] for pair in pairs])]
    labels = torch.tensor([pair[2] for pair in pairs], dtype=torch.float64)
    return MicroBatch(features, labels, len(pairs), epoch, position)


def sgd(objective: torch.nn.Module, lr: float = 1.0) -> Optimization:
    optimizer = torch.optim.SGD(objective.parameters(), lr=lr)
    return Optimization(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)


def run(objective, batches, optimization, reporter=None, **settings) -> TrainState:
    """``batches`` are full: a step's global batch is the rows of its micro-batches."""
    global_batch = sum(batch.size for batch in batches[: settings.get("grad_accum_steps", 1)])
    settings = StepSettings(
        **{"batches_per_epoch": len(batches), "device": CPU, "global_batch": global_batch, **settings}
    )
    meter = StepMeter(time.time(), CPU)
    telemetry = Telemetry(reporter or LocalReporter(), meter)
    return train_stage(Trainee(objective, optimization), batches, settings, TrainState(), telemetry)


def update(objective, batches, **settings) -> torch.Tensor:
    """All parameters' change over the run with SGD at lr 1, flattened."""
    before = torch.cat([p.detach().flatten().clone() for p in objective.parameters()])
    run(objective, batches, sgd(objective), **settings)
    return torch.cat([p.detach().flatten() for p in objective.parameters()]) - before


def test_accumulated_micro_batches_step_as_one_big_batch(tiny_model_dir):
    """Two micro-batches of 2 with grad_accum_steps 2 change the weights as one batch of 4 (each micro-batch's
    mean loss is divided by the accumulation steps, so the sum is the big batch's mean)."""
    big = float64_objective(tiny_model_dir)
    big_update = update(big, [micro_batch(big.encoder, PAIRS)], total_steps=1, max_grad_norm=1e9)
    accumulated = float64_objective(tiny_model_dir)
    halves = [micro_batch(accumulated.encoder, PAIRS[:2]), micro_batch(accumulated.encoder, PAIRS[2:])]
    accumulated_update = update(accumulated, halves, total_steps=1, grad_accum_steps=2, max_grad_norm=1e9)
    scale = big_update.abs().max()
    assert scale > 0
    torch.testing.assert_close(accumulated_update, big_update, rtol=0, atol=EXACT * scale)


def test_clipping_scales_the_step_to_max_grad_norm(tiny_model_dir):
    """A gradient longer than max_grad_norm is scaled down to that length, its direction kept."""
    free = float64_objective(tiny_model_dir)
    unclipped = update(free, [micro_batch(free.encoder, PAIRS)], total_steps=1, max_grad_norm=1e9)
    max_norm = float(unclipped.norm()) / 10
    clipped_objective = float64_objective(tiny_model_dir)
    clipped = update(
        clipped_objective, [micro_batch(clipped_objective.encoder, PAIRS)], total_steps=1, max_grad_norm=max_norm
    )
    # torch divides by (norm + 1e-6): the clipped length falls short of max_norm by that 1e-6 relative to the norm.
    assert math.isclose(float(clipped.norm()), max_norm, rel_tol=1e-6 / max_norm + EXACT)
    torch.testing.assert_close(clipped * 10, unclipped, rtol=0, atol=EXACT * unclipped.abs().max() + 1e-6)


def test_the_schedule_advances_once_per_optimizer_step(tiny_model_dir):
    """Warm-up over half of 4 steps, then linear decay: the logged learning rate after steps 1..4 is 1/2, 1, 1/2
    and 0 of the configured one, with 2 micro-batches per step (a schedule stepped per micro-batch would be at
    1/2 of the warm-up after the first micro-batch and reach 0 at step 2)."""
    objective = CosineSimilarityLoss(SentenceEncoder.load(str(tiny_model_dir)))
    stage = StageConfig(learning_rate=1e-3, warmup_ratio=0.5)
    optimization = prepare_optimization(objective, stage, 4, CPU, "fp32", None)
    batches = [micro_batch(objective.encoder, PAIRS[i % 4 : i % 4 + 1]) for i in range(8)]
    for batch in batches:
        batch.labels.data = batch.labels.float()
    reporter = LocalReporter()
    run(objective, batches, optimization, reporter, total_steps=4, grad_accum_steps=2, eval_every=1)
    rates = [metrics["train/learning_rate"] for _, metrics in reporter.logged if "train/learning_rate" in metrics]
    assert rates == pytest.approx([5e-4, 1e-3, 5e-4, 0.0], abs=1e-12)


@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 7), (3, 10), (10, 10), (1, 1000)])
def test_the_schedule_is_transformers_linear_warmup_factor_for_factor(warmup, total):
    """Ours is written out (transformers' imports peft, seconds per Train worker); its factors are the same floats,
    so a run's learning rates, and a resumed scheduler, do not change."""
    from transformers import get_linear_schedule_with_warmup

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = make(optimizer, warmup, total)
        return [scheduler.lr_lambdas[0](step) for step in range(total + 2)]

    assert rates(linear_warmup_then_decay) == rates(get_linear_schedule_with_warmup)


def float32_batches(encoder: SentenceEncoder, count: int, poisoned: int | None = None) -> list[MicroBatch]:
    """``count`` one-pair micro-batches cycling over PAIRS; micro-batch ``poisoned`` has a NaN label."""
    batches = []
    for index in range(count):
        batch = micro_batch(encoder, PAIRS[index % len(PAIRS) : index % len(PAIRS) + 1], position=index + 1)
        labels = torch.full_like(batch.labels, math.nan) if index == poisoned else batch.labels
        batches.append(MicroBatch(batch.features, labels.float(), 1, 0, index + 1))
    return batches


def test_a_nan_loss_stops_training_at_the_next_read_naming_its_step(tiny_model_dir):
    """The loss of step 3 is NaN: the read at the report point of step 5 raises Diverged naming step 3, and no
    report (so no checkpoint) comes from the broken weights."""
    objective = CosineSimilarityLoss(SentenceEncoder.load(str(tiny_model_dir)))
    reporter = LocalReporter()
    with pytest.raises(Diverged) as stopped:
        run(objective, float32_batches(objective.encoder, 8, poisoned=2), sgd(objective, 1e-3), reporter,
            total_steps=8, eval_every=5)  # fmt: skip
    assert (stopped.value.stage, stopped.value.global_step) == (0, 3) and math.isnan(stopped.value.loss)
    assert reporter.reports == []
    assert [step for step, metrics in reporter.logged if "train/loss" in metrics] == []


def test_a_stop_request_checkpoints_the_full_state_at_the_next_loss_read_then_stops(tiny_model_dir, tmp_path):
    """Asked to stop between the loss reads of steps 10 and 20 (a SIGTERM; no report point before the end): the
    read of step 20 reports a full-state checkpoint of step 20 and training stops there (``Stopped``)."""
    objective = CosineSimilarityLoss(SentenceEncoder.load(str(tiny_model_dir)))
    reporter, asked = LocalReporter(tmp_path), iter([False, True])
    with pytest.raises(Stopped) as stopped:
        run(objective, float32_batches(objective.encoder, 30), sgd(objective, 1e-3), reporter,
            total_steps=30, stop_requested=lambda: next(asked))  # fmt: skip
    assert stopped.value.global_step == 20
    assert [report["global_step"] for report in reporter.reports] == [20]
    assert is_full_state(tmp_path / "step-20")


def test_losses_are_read_every_log_every_steps_and_at_report_points(tiny_model_dir):
    """25 steps, a report every 12: the loss is read (and logged) at 10, 12, 22, 24 and 25, the report points are
    12, 24 and 25 (the stage's last, which alone is marked done), each with the window's loss."""
    objective = CosineSimilarityLoss(SentenceEncoder.load(str(tiny_model_dir)))
    reporter = LocalReporter()
    state = run(objective, float32_batches(objective.encoder, 30), sgd(objective, 1e-3), reporter,
                total_steps=25, eval_every=12)  # fmt: skip
    assert LOG_EVERY == 10
    assert (state.step, state.global_step, state.batch, state.stage_done) == (25, 25, 25, True)
    assert [step for step, metrics in reporter.logged if "train/loss" in metrics] == [10, 12, 22, 24, 25]
    assert [report["global_step"] for report in reporter.reports] == [12, 24, 25]
    logged_losses = {step: metrics["train/loss"] for step, metrics in reporter.logged if "train/loss" in metrics}
    assert [report["train_loss"] for report in reporter.reports] == [logged_losses[s] for s in (12, 24, 25)]
    assert reporter.logged[0][0] == 1 and "train/time_to_first_step_s" in reporter.logged[0][1]


class SlowReporter(LocalReporter):
    """Each report point takes at least ``REPORT_S`` (as scoring and writing a checkpoint would)."""

    REPORT_S = 0.05

    def report(self, state, save, window) -> None:
        time.sleep(self.REPORT_S)
        super().report(state, save, window)


def test_the_logged_report_time_is_the_one_the_meter_counts(tiny_model_dir):
    """One timer per report point: the ``train/report_s`` logged at each is what ``StepMeter`` adds to the report
    time behind ``report_share`` (equal sums, not two clocks read microseconds apart)."""
    objective = CosineSimilarityLoss(SentenceEncoder.load(str(tiny_model_dir)))
    reporter, meter = SlowReporter(), StepMeter(time.time(), CPU)
    settings = StepSettings(total_steps=4, batches_per_epoch=4, device=CPU, global_batch=1, eval_every=2)
    trainee = Trainee(objective, sgd(objective, 1e-3))
    train_stage(trainee, float32_batches(objective.encoder, 4), settings, TrainState(), Telemetry(reporter, meter))
    logged = [(step, metrics["train/report_s"]) for step, metrics in reporter.logged if "train/report_s" in metrics]
    assert [step for step, _ in logged] == [2, 4]
    assert all(seconds >= SlowReporter.REPORT_S for _, seconds in logged)
    assert logged[0][1] + logged[1][1] == meter.report_seconds == meter.summary()["report_s"]


def test_masked_duplicates_are_logged_per_step_at_log_points(tiny_model_dir):
    """MNRL given the texts' hashes: a micro-batch whose rows 0 and 2 share a positive masks 2 candidates (each
    anchor's copy of its positive in the other row). Steps of 2 micro-batches, with 1 and 2 such micro-batches:
    the read at the stage's last step logs the mean per step, 3; without hashes the metric is not logged."""
    objective = MultipleNegativesRankingLoss(SentenceEncoder.load(str(tiny_model_dir)))
    anchors = [pair[0] for pair in PAIRS[:3]]
    clean, duplicated = [pair[1] for pair in PAIRS[:3]], [PAIRS[0][1], PAIRS[1][1], PAIRS[0][1]]

    def batches(with_hashes: bool) -> list[MicroBatch]:
        columns = [[anchors, positives] for positives in (duplicated, clean, duplicated, duplicated)]
        return [
            MicroBatch(
                [objective.encoder.tokenize(column) for column in pair],
                None,
                3,
                0,
                position,
                [torch.tensor([hash(text) for text in column]) for column in pair] if with_hashes else None,
            )
            for position, pair in enumerate(columns, start=1)
        ]

    logged = {}
    for with_hashes in (True, False):
        reporter = LocalReporter()
        run(objective, batches(with_hashes), sgd(objective, 1e-3), reporter, total_steps=2, grad_accum_steps=2)
        logged[with_hashes] = [
            (step, metrics.get("train/masked_duplicates"))
            for step, metrics in reporter.logged
            if "train/loss" in metrics
        ]
    assert logged[True][-1] == (2, 3.0)
    assert logged[False][-1] == (2, None)


class Interrupted(Exception):
    pass


class StopAfter(LocalReporter):
    """Saves each report point's checkpoint, then stops the run after the one at ``global_step`` (a killed
    worker)."""

    def __init__(self, checkpoints: Path, global_step: int):
        super().__init__(checkpoints)
        self.stop = global_step

    def report(self, state, save, window):
        super().report(state, save, window)
        if state.global_step == self.stop:
            raise Interrupted


def two_stage_config(model_dir: Path, data_dir: Path) -> TrainConfig:
    """Regression on 24 STSb pairs (batch 8 in micro-batches of 4: 3 steps an epoch, 2 epochs), then softmax
    on 32 NLI pairs (a classifier head the checkpoint must carry); a report every 2 steps."""
    return TrainConfig(
        seed=3,
        data_dir=str(data_dir),
        model=ModelConfig(name=str(model_dir)),
        stages=[
            StageConfig(limit=24, batch_size=8, grad_accum_steps=2, epochs=2, learning_rate=1e-4),
            StageConfig(
                dataset="nli-offline",
                objective="softmax",
                limit=32,
                batch_size=8,
                learning_rate=1e-4,
                loss={"concat": ["u", "v", "|u-v|"]},
            ),  # fmt: skip
        ],
        evaluation=EvalConfig(eval_every=2, final_tasks=[]),
        scaling=ScalingConfig(torch_threads=torch.get_num_threads()),  # leaves this process's threads as they are
    )


def train(config: TrainConfig, reporter: LocalReporter, restored: Path | None = None) -> TrainState:
    worker = Worker(CPU)
    started = start_worker(config, worker, restored)
    meter = StepMeter(time.time(), CPU)
    data = functools.partial(local_sources, config, encoder=started.encoder)
    return train_stages(stage_plans(config), started, data, worker, reporter, meter)


def test_a_run_resumed_from_a_mid_epoch_checkpoint_ends_where_the_uninterrupted_one_does(
    tiny_model_dir, data_dir, tmp_path
):
    """Stopped after the checkpoint of step 2 (mid-epoch: 4 of 6 micro-batches), restored and continued across
    the epoch boundary and into the second stage: the same losses at every later report point and the same final
    weights, head and optimizer state, bit for bit (one process, the same kernels on the same inputs)."""
    config = two_stage_config(tiny_model_dir, data_dir)

    whole = LocalReporter(tmp_path / "whole")
    train(config, whole)
    assert [r["global_step"] for r in whole.reports] == [2, 4, 6, 8, 10]  # stage 0: 2, 4, 6; stage 1: 8, 10

    with pytest.raises(Interrupted):
        train(config, StopAfter(tmp_path / "first", global_step=2))
    checkpoint = tmp_path / "first" / "step-2"
    assert TrainState.load(checkpoint) == TrainState(stage=0, epoch=0, batch=4, step=2, global_step=2)
    resumed = LocalReporter(tmp_path / "resumed")
    final = train(config, resumed, restored=checkpoint)

    assert (final.stage, final.global_step, final.stage_done) == (1, 10, True)
    # the resumed process times its own start to its first step (step 3), never as the run's first step
    starts = [(step, name) for step, metrics in resumed.logged for name in metrics if name.startswith("train/time_to")]
    assert starts == [(3, "train/time_to_resumed_step_s")], starts
    positions_and_losses = [
        [{k: v for k, v in r.items() if k != "pairs_per_s"} for r in run.reports] for run in (whole, resumed)
    ]
    assert positions_and_losses[1] == positions_and_losses[0][1:]  # steps 4..10
    ends = [tmp_path / run / "step-10" for run in ("whole", "resumed")]
    weights = [SentenceEncoder.load(str(end / MODEL_DIR)).state_dict() for end in ends]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    training = [torch.load(end / TRAINING_FILE, weights_only=True) for end in ends]
    assert training[0]["head"].keys() == training[1]["head"].keys() != set()
    assert all(torch.equal(training[0]["head"][k], training[1]["head"][k]) for k in training[0]["head"])
    moments = [[t for s in run["optimizer"]["state"].values() for t in s.values()] for run in training]
    assert all(torch.equal(a, b) for a, b in zip(*moments, strict=True))


def test_weights_only_report_points_between_full_states_and_the_resume_from_a_full_one(
    tiny_model_dir, data_dir, tmp_path
):
    """checkpoint.full_every 2: report points alternate weights-only and full state, every stage's end is full; a
    weights-only checkpoint is refused as a resume point, and the run resumed from the full one of step 4 ends
    on the uninterrupted run's weights, bit for bit."""
    config = two_stage_config(tiny_model_dir, data_dir)
    config.checkpoint.full_every = 2
    whole = LocalReporter(tmp_path / "whole")
    train(config, whole)
    folders = {r["global_step"]: tmp_path / "whole" / f"step-{r['global_step']}" for r in whole.reports}
    # stage 0: steps 2, 4, 6 (its last); stage 1: its steps 2 (global 8) and 4 (its last, global 10)
    assert {step: is_full_state(folder) for step, folder in folders.items()} == {
        2: False, 4: True, 6: True, 8: False, 10: True
    }  # fmt: skip
    assert TrainState.load(folders[8]).global_step == 8  # a weights-only checkpoint still says where it stands
    with pytest.raises(ValueError, match="weights-only"):
        start_worker(config, Worker(CPU), folders[8])

    resumed = LocalReporter(tmp_path / "resumed")
    train(config, resumed, restored=folders[4])
    assert [r["train_loss"] for r in resumed.reports] == [r["train_loss"] for r in whole.reports[2:]]
    ends = [tmp_path / run / "step-10" / MODEL_DIR for run in ("whole", "resumed")]
    weights = [SentenceEncoder.load(str(end)).state_dict() for end in ends]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


SCORED_ROWS = {
    "sentence1": [p[0] for p in PAIRS] * 2,
    "sentence2": [p[1] for p in PAIRS] + [p[1] for p in reversed(PAIRS)],
    "score": [5 * p[2] for p in PAIRS] + [0.5, 1.0, 1.5, 2.0],
}
TEACHER_ROWS = {
    "anchor": [f"{p[0]} ({i})" for i, p in enumerate(PAIRS * 2)],
    "positive": [f"{p[1]} ({i})" for i, p in enumerate(PAIRS * 2)],
    "negative_1": [f"{p[1]} ({i})" for i, p in enumerate(reversed(PAIRS * 2))],
    "negative_2": [f"The weather report, number {i}." for i in range(8)],
    "score_positive": [9.0, 8.5, 7.0, 9.5, 6.0, 8.0, 7.5, 9.0],
    "score_negative_1": [1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 0.0, 1.5],
    "score_negative_2": [-4.0, -3.0, -5.0, -2.5, -3.5, -4.5, -2.0, -3.0],
}
TEACHER_VECTOR_ROWS = {  # a teacher's 32-value vector (the tiny model's size) of each text, as encode writes them
    "text": [f"{p[0]} ({i})" for i, p in enumerate(PAIRS * 2)],
    "translation": [f"{p[1]} ({i})" for i, p in enumerate(PAIRS * 2)],
    "vector": torch.randn(8, 32, generator=torch.Generator().manual_seed(0)).tolist(),
}


@pytest.mark.parametrize(
    ("objective", "settings", "rows"),
    [
        ("cosent", {}, SCORED_ROWS),
        ("angle", {}, SCORED_ROWS),
        ("margin_mse", {}, TEACHER_ROWS),
        ("distill_kl", {"temperature": 2.0}, TEACHER_ROWS),
        ("mnrl", {"symmetric": True}, TEACHER_ROWS),  # the scores are simply not read
        ("mse", {}, TEACHER_VECTOR_ROWS),
    ],
)
def test_each_new_objective_trains_on_a_parquet_file_with_its_columns(
    tiny_model_dir, data_dir, tmp_path, objective, settings, rows
):
    """The data path end to end in one process: a parquet file read, tokenised and batched for the objective (a
    teacher's scores as each row's label), the loss finite and lower after 4 steps on the same 8 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table(rows), path)
    stage = StageConfig(
        dataset=str(path), objective=objective, loss=settings, batch_size=8, epochs=4, learning_rate=1e-3,
        warmup_ratio=0.0,
    )  # fmt: skip
    config = TrainConfig(
        seed=0,
        data_dir=str(data_dir),
        model=ModelConfig(name=str(tiny_model_dir)),
        stages=[stage],
        evaluation=EvalConfig(eval_every=1, final_tasks=[], dev_limit=8),
        scaling=ScalingConfig(torch_threads=torch.get_num_threads()),
    )
    reporter = LocalReporter()
    train(config, reporter)
    losses = [report["train_loss"] for report in reporter.reports]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0], losses
