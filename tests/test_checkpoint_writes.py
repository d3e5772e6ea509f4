"""Report points off the critical path (issue 28): the training thread copies the checkpoint to host memory and goes
on, the checkpoint is serialised and written in the background (``training.checkpoint_writes``), and what lands is
the state of the report point, not of the steps trained while it was written. In one process, no Ray; Ray Train's
side (its upload waits for the write) runs in every cluster training test, e.g. the killed run resumed from its
resume points in ``test_training.py``."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from test_training_loop import CPU, float32_batches

from sbert_ray.config import StageConfig
from sbert_ray.losses import CosineSimilarityLoss
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.checkpoint_writes import CheckpointWrites
from sbert_ray.training.loop import LocalReporter, StepSettings, Telemetry, Trainee, train_stage
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.optimization import prepare_optimization
from sbert_ray.training.resume_points import ResumePoints
from sbert_ray.training.state import MODEL_DIR, RNG_FILE, STATE_FILE, TRAINING_FILE, Snapshot, TrainState

SLOW_WRITE_S = 3.0  # the artificially slow save
# What a report point may add to its step: the bound. A report that waited for the write would take at least
# SLOW_WRITE_S, ten times this; one that only copies the tiny model's ~100k weights and queues the write takes
# milliseconds, so even on 2 loaded cores the bound is far from both.
REPORT_BOUND_S = 0.3


class SlowWrites:
    """``Snapshot.write`` made SLOW_WRITE_S slower for the checkpoint of ``global_step``, except the reference
    written ``unslowed``; records which thread wrote it and how long the write took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, global_step: int):
        self.global_step, self.threads, self.seconds = global_step, [], []
        self.write = Snapshot.write

        def slow_write(snapshot: Snapshot, directory: Path) -> None:
            started = time.perf_counter()
            if snapshot.state.global_step == self.global_step:
                time.sleep(SLOW_WRITE_S)
                self.threads.append(threading.get_ident())
            self.write(snapshot, directory)
            if snapshot.state.global_step == self.global_step:
                self.seconds.append(time.perf_counter() - started)

        monkeypatch.setattr(Snapshot, "write", slow_write)

    def unslowed(self, save, folder: Path) -> None:
        """``save(folder)`` in this thread at the original speed."""
        self.write(save.snapshot(), folder)


class TimedReporter(LocalReporter):
    """A background-writing ``LocalReporter`` whose report points are timed (``blocked``: seconds each report call
    held the loop); after each, the same moment's checkpoint written in the report, as before issue 28, into
    ``<checkpoints>-in-report`` to compare with."""

    def __init__(self, checkpoints: Path, slow: SlowWrites):
        super().__init__(checkpoints, background=True)
        self.blocked: dict[int, float] = {}
        self.slow = slow

    def report(self, state, save, window) -> None:
        started = time.perf_counter()
        super().report(state, save, window)
        self.blocked[state.global_step] = time.perf_counter() - started
        reference = self.checkpoints.with_name(f"{self.checkpoints.name}-in-report") / f"step-{state.global_step}"
        reference.mkdir(parents=True)
        self.slow.unslowed(save, reference)


def adamw_objective(model_dir: Path) -> tuple[CosineSimilarityLoss, tuple]:
    objective = CosineSimilarityLoss(SentenceEncoder.load(str(model_dir)))
    return objective, prepare_optimization(objective, StageConfig(learning_rate=1e-3), 12, CPU, "fp32", None)


@pytest.mark.slow  # the 3 s write, and a tiny model trained and written 6 times: 8-17 s on 2 shared cores
def test_a_slow_checkpoint_write_does_not_hold_the_report_point_and_lands_whole(tiny_model_dir, tmp_path, monkeypatch):
    """12 steps, a full-state report point every 4. The write of step 8's checkpoint takes 3 s longer: the report
    call at step 8 returns within REPORT_BOUND_S while the write runs on in another thread and training goes on
    (steps 9-12 change the weights). Once the writes are closed, step 8's checkpoint holds what a write inside the
    report held at that moment, file for file and tensor for tensor: the model, the AdamW state, the schedule,
    the random state and the position. (Step 4's report also makes the encoder's skeleton, once per run.)"""
    slow = SlowWrites(monkeypatch, global_step=8)
    objective, optimization = adamw_objective(tiny_model_dir)
    reporter, meter = TimedReporter(tmp_path / "background", slow), StepMeter(time.time(), CPU)
    settings = StepSettings(total_steps=12, batches_per_epoch=12, device=CPU, global_batch=1, eval_every=4)
    batches = float32_batches(objective.encoder, 12)
    train_stage(Trainee(objective, optimization), batches, settings, TrainState(), Telemetry(reporter, meter))
    reporter.close()

    assert len(slow.seconds) == 1 and slow.seconds[0] >= SLOW_WRITE_S and slow.threads[0] != threading.get_ident()
    assert reporter.blocked[8] < REPORT_BOUND_S, reporter.blocked
    background, in_report = tmp_path / "background" / "step-8", tmp_path / "background-in-report" / "step-8"
    assert sorted(p.relative_to(background) for p in background.rglob("*")) == sorted(
        p.relative_to(in_report) for p in in_report.rglob("*")
    )
    assert TrainState.load(background) == TrainState.load(in_report) == TrainState(epoch=0, batch=8, step=8,
                                                                                   global_step=8)  # fmt: skip
    weights = [SentenceEncoder.load(str(folder / MODEL_DIR)).state_dict() for folder in (background, in_report)]
    assert_equal_trees(*weights)
    final = SentenceEncoder.load(str(tmp_path / "background" / "step-12" / MODEL_DIR)).state_dict()
    assert any(not torch.equal(final[name], weights[0][name]) for name in final)  # trained on while it was written
    for name in (TRAINING_FILE, RNG_FILE):
        assert_equal_trees(*(torch.load(folder / name, weights_only=True) for folder in (background, in_report)))
    moments = torch.load(background / TRAINING_FILE, weights_only=True)["optimizer"]["state"]
    assert len(moments) == len(optimization.optimizer.state) > 30  # AdamW's moments of every trained parameter


def assert_equal_trees(a, b) -> None:
    """Equal nested dicts / lists / tuples of tensors and plain values: tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal_trees(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_equal_trees(x, y)
    else:
        assert a == b


def snapshot_taker(tiny_model_dir: Path, global_step: int):
    """``CheckpointWriter.snapshot`` of a full-state report point of an untrained tiny objective."""
    from sbert_ray.training.loop import checkpoint_writer

    objective, optimization = adamw_objective(tiny_model_dir)
    return checkpoint_writer(TrainState(step=global_step, global_step=global_step), objective, optimization, CPU, 1)


def test_a_full_state_becomes_a_resume_point_and_the_report_gets_its_model_and_position(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The folder handed to Ray Train holds the model and position only (hard links to the resume point's files, no
    copy); the full state is uploaded as a complete resume point and its local copy deleted."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the full state is written first
    points = ResumePoints(pafs.LocalFileSystem(), str(tmp_path / "run" / "resume_points"))
    writes = CheckpointWrites(points, background=True)
    folder = tmp_path / "for-ray"
    folder.mkdir()
    writes.save(snapshot_taker(tiny_model_dir, 30).snapshot, folder, 30).result()
    writes.close()
    assert {p.relative_to(folder).parts[0] for p in folder.rglob("*")} == {MODEL_DIR, STATE_FILE}
    point = points.latest()
    assert point.global_step == 30
    assert (Path(point.path) / TRAINING_FILE).is_file() and (Path(point.path) / RNG_FILE).is_file()
    assert not list(tmp_path.glob("sbert-ray-full-*"))


def test_a_failed_write_fails_ray_trains_upload_and_is_raised_at_close_with_nothing_uploaded(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The report's future carries the write's error (Ray Train's upload waits on it and fails the run); ``close``
    raises it too, no resume point is marked complete, and the full state written first is removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    points = ResumePoints(pafs.LocalFileSystem(), str(tmp_path / "run" / "resume_points"))
    writes = CheckpointWrites(points, background=True)
    not_a_folder = tmp_path / "a file"
    not_a_folder.write_text("")
    written = writes.save(snapshot_taker(tiny_model_dir, 30).snapshot, not_a_folder, 30)
    with pytest.raises(NotADirectoryError):
        written.result()
    with pytest.raises(NotADirectoryError):
        writes.close()
    assert points.latest() is None
    assert not list(tmp_path.glob("sbert-ray-full-*"))
