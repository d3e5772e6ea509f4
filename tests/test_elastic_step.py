"""An elastic run's step at any worker count is the one-process step on the same global batch: the global batch
dealt unevenly over 3 and 4 workers (``training.batches.split_batch``), each micro-batch's loss weighed by its rows
in the training loop, against one process training the whole batch; per-pair and in-batch-negative objectives,
MNRL and cached MNRL with the cross-worker gather, and Matryoshka."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from spawned_workers import ELASTIC_OBJECTIVES, loop_step, uneven_split_steps

SUBJECTS = ["A man", "Two dogs", "A woman", "The kids", "An old man", "The birds", "She"]
ACTIONS = ["plays a guitar", "runs in a field", "is cooking dinner", "reads a newspaper", "paints the wall"]
# 14 anchors and positives (global batch 14 in 2 global micro-batches of 7), every text distinct.
ANCHORS = [f"{SUBJECTS[i % 7]} {ACTIONS[i % 5]} at {i} o'clock." for i in range(14)]
POSITIVES = [f"{SUBJECTS[i % 7].lower()} {ACTIONS[(i + 2) % 5]} near house {i}." for i in range(14)]
SCORES = [(i % 6) / 5 for i in range(14)]
# The workers sum the same per-row terms as one process, in another order (per rank, then DDP's all-reduce and the
# gather's concatenation): in float64 a reordered sum of n terms moves by at most about n * 1.1e-16 * (sum of
# their absolute values), < 1e-11 for these gradients (n < 1e4, absolute sums < 10), so 1e-9 leaves a margin of 100
# and is far below what a wrong weight does. The logged loss is read from the loop's float32 window: 2 float32 ulps.
TOLERANCE = {"atol": 1e-9, "rtol": 1e-7}
LOSS_TOLERANCE = {"atol": 0.0, "rtol": 2 * torch.finfo(torch.float32).eps}


@pytest.mark.slow  # spawns a three- and a four-process group
@pytest.mark.parametrize("world_size, shares", [(3, (3, 2, 2)), (4, (2, 2, 2, 1))])
def test_the_step_at_any_worker_count_is_the_one_process_step(tiny_model_dir: Path, tmp_path: Path, world_size, shares):
    columns = [ANCHORS, POSITIVES]
    args = (world_size, str(tiny_model_dir), str(tmp_path), columns, SCORES)
    mp.spawn(uneven_split_steps, args=args, nprocs=world_size, join=True)
    results = torch.load(tmp_path / "results.pt")
    for name in ELASTIC_OBJECTIVES:
        alone = loop_step(name, str(tiny_model_dir), columns, SCORES, 14, 2)
        assert results[name]["shares"] == shares and alone["shares"] == (7,)  # uneven: 7 examples per micro-batch
        assert alone["update"].abs().max() > 1e-4  # a step that moves the weights
        torch.testing.assert_close(results[name]["update"], alone["update"], **TOLERANCE, msg=name)
        torch.testing.assert_close(results[name]["loss"], alone["loss"], **LOSS_TOLERANCE, msg=name)
