"""Progress output: the driver's line per training report and the --quiet switch."""

from sbert_ray.cli import build_parser
from sbert_ray.progress import QUIET_ENV, progress_bar, quiet
from sbert_ray.runs.progress_lines import TrainingProgress, duration


def report(stage: int, step: int, global_step: int, **metrics) -> dict:
    return {"stage": stage, "step": step, "global_step": global_step, **metrics}


def test_training_line_has_step_of_total_loss_dev_rate_and_eta():
    progress = TrainingProgress([100, 50])  # two stages: 150 steps in all
    first = progress.line(report(0, 10, 10, train_loss=0.5, dev_score=71.234, pairs_per_s=30.0), now=1000.0)
    assert first == "stage 1/2  step 10/100  loss 0.5000  dev 71.23  30.0 pairs/s"  # no rate yet: no ETA
    # 40 more steps in 80 s: 2 s a step, 100 steps left (50 of stage 1, 50 of stage 2).
    second = progress.line(report(0, 50, 50, train_loss=0.25), now=1080.0)
    assert second == "stage 1/2  step 50/100  loss 0.2500  elapsed 1m20s  ETA 3m20s"
    third = progress.line(report(1, 25, 125), now=1230.0)
    assert third.startswith("stage 2/2  step 25/50") and third.endswith("ETA 0m50s")


def test_durations_read_as_hours_and_minutes():
    assert (duration(59), duration(61), duration(3 * 3600 + 5 * 60 + 9)) == ("0m59s", "1m01s", "3h05m")


def test_quiet_turns_bars_off(monkeypatch):
    monkeypatch.setenv(QUIET_ENV, "1")
    assert quiet() and progress_bar(range(3)).disable
    monkeypatch.setenv(QUIET_ENV, "0")
    assert not quiet()


def test_quiet_flag_reaches_every_subcommand():
    parser = build_parser()
    for argv in (
        ["eval", "--model", "m"],
        ["train", "c.yaml"],
        ["tune", "s.yaml"],
        ["report", "r.json"],
        ["bench", "train", "--model", "m"],
    ):
        assert parser.parse_args([*argv, "--quiet"]).quiet and not parser.parse_args(argv).quiet
