"""Host-device syncs in a steady training step: the loop reads its losses once per ``LOG_EVERY`` steps, and the
objectives read nothing back (cached MNRL's mini-batch widths come with the collated batch, from the host). On the
CPU a sync cannot stall anything, but what would wait for a GPU still runs and is counted: operators seen by a
``TorchDispatchMode`` (below autograd) that read a value to the host (``_local_scalar_dense``: ``.item()``,
``bool(tensor)``) or whose output size depends on the data (``nonzero``, ``masked_select``), and ``Tensor.tolist``
/ ``Tensor.numpy``, which copy a GPU tensor to the host without dispatching an operator on a CPU one. With CUDA,
``torch.cuda.set_sync_debug_mode("error")`` makes any sync raise."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sbert_ray.config import StageConfig
from sbert_ray.losses import CachedMultipleNegativesRankingLoss, CosineSimilarityLoss, MultipleNegativesRankingLoss
from sbert_ray.losses.cached_multiple_negatives_ranking import _used_widths
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.batches import tokenize_texts
from sbert_ray.training.loop import LOG_EVERY, LocalReporter, MicroBatch, StepSettings, Telemetry, Trainee, train_stage
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.optimization import prepare_optimization
from sbert_ray.training.state import TrainState

SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
# Of different lengths, so every batch has padding (the case transformers' mask check looks for).
PAIRS = [
    ("A man plays a guitar.", "Someone makes music on a guitar in the street tonight."),
    ("A dog runs.", "An animal is running through a green park."),
    ("A woman slices an onion on a board.", "Cooking."),
    ("The sky is blue.", "Stock markets fell sharply today in early trading."),
]


OBJECTIVES = ["regression", "mnrl", "cached_mnrl"]


class SyncCounter(TorchDispatchMode):
    """Counts the operators in ``SYNCING`` that run while it is active, and (with ``watch_reads``) host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))

    def watch_reads(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name: str, read: Callable) -> Callable:
        def counted(tensor, *args, **kwargs):
            self.syncs.append(f"Tensor.{name}")
            return read(tensor, *args, **kwargs)

        return counted


def objectives(encoder: SentenceEncoder) -> dict[str, torch.nn.Module]:
    return {
        "regression": CosineSimilarityLoss(encoder),
        "mnrl": MultipleNegativesRankingLoss(encoder),
        "cached_mnrl": CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=2),
    }


def collated(encoder: SentenceEncoder, device: torch.device) -> tuple:
    """PAIRS (scored) through the training data path: tokenised as a worker without Ray does, collated as a
    worker collates its micro-batches (features, labels, hashes on ``device``; used widths on the host)."""
    texts = [[pair[0] for pair in PAIRS], [pair[1] for pair in PAIRS]]
    rows = tokenize_texts(texts, np.linspace(0, 1, len(PAIRS), dtype=np.float32), encoder)
    pad_left = encoder.tokenizer.padding_side == "left"
    return rows.collate(range(len(PAIRS)), encoder.tokenizer.pad_token_id, pad_left, device)


def batches(encoder: SentenceEncoder, count: int, device: torch.device) -> list[MicroBatch]:
    features, labels, hashes, used_widths = collated(encoder, device)
    return [MicroBatch(features, labels, len(PAIRS), 0, index + 1, hashes, used_widths) for index in range(count)]


def train_without_reads(objective: torch.nn.Module, device: torch.device, before_step: Callable[[int], None]) -> None:
    """Train LOG_EVERY - 1 steps of a LOG_EVERY-step stage: none of them reads the losses (the first read is at
    step LOG_EVERY). ``before_step(i)`` runs before micro-batch i (0-based) goes to the loop."""
    steps = LOG_EVERY - 1
    optimization = prepare_optimization(objective, StageConfig(), LOG_EVERY, device, "fp32", None)
    settings = StepSettings(total_steps=LOG_EVERY, batches_per_epoch=LOG_EVERY, device=device, global_batch=len(PAIRS))

    def announced(micro_batches: list[MicroBatch]) -> Iterator[MicroBatch]:
        for index, batch in enumerate(micro_batches):
            before_step(index)
            yield batch

    telemetry = Telemetry(LocalReporter(), StepMeter(time.time(), device))
    train_stage(Trainee(objective, optimization), announced(batches(objective.encoder, steps, device)), settings,
                TrainState(), telemetry)  # fmt: skip


@pytest.mark.parametrize("name", OBJECTIVES)
def test_a_steady_training_step_reads_nothing_else_back_to_the_host(tiny_model_dir, name, monkeypatch):
    """Before the encoder passed a 4-D mask, transformers' SDPA mask check (``padding_mask.all()``) read one
    value per forward: one sync per step for regression and MNRL, more for cached MNRL (one per mini-batch
    forward), which also read its mini-batches' widths from the attention masks (one ``tolist`` per step) before
    the collated batch carried them from the host. The first step is left out: its first calls may set things
    up once."""
    objective = objectives(SentenceEncoder.load(str(tiny_model_dir)))[name]
    counter, per_step = SyncCounter(), []
    counter.watch_reads(monkeypatch)

    def close_step(index: int) -> None:
        per_step.append(list(counter.syncs))
        counter.syncs.clear()

    with counter:
        train_without_reads(objective, torch.device("cpu"), close_step)
    per_step.append(list(counter.syncs))  # the last step's
    steady = per_step[2:]  # per_step[0]: before the first batch; per_step[1]: the first step
    assert len(steady) == LOG_EVERY - 2 and steady == [[]] * (LOG_EVERY - 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("name", OBJECTIVES)
def test_a_steady_training_step_does_not_sync_a_gpu(tiny_model_dir, name):
    """From the second step on, any sync raises (``set_sync_debug_mode("error")``)."""
    device = torch.device("cuda")
    objective = objectives(SentenceEncoder.load(str(tiny_model_dir)).to(device))[name]

    def strict_after_first(index: int) -> None:
        if index == 1:
            torch.cuda.set_sync_debug_mode("error")

    try:
        train_without_reads(objective, device, strict_after_first)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_the_collated_used_widths_are_the_attention_masks(tiny_model_dir, padding_side):
    """The widths cached MNRL cuts its mini-batches to, known on the host at collation, are what it would read
    from the attention masks: each row's last attended column plus one (with left padding, the whole width)."""
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    encoder.tokenizer.padding_side = padding_side
    features, _, _, used_widths = collated(encoder, torch.device("cpu"))
    for column, widths in zip(features, used_widths, strict=True):
        mask = column["attention_mask"]
        assert widths.tolist() == _used_widths([mask])[0].tolist()
        assert (widths == mask.shape[1]).all() == (padding_side == "left")


def test_the_4d_mask_gives_the_2d_masks_embeddings(tiny_model_dir):
    """The encoder hands SDPA a 4-D boolean mask; transformers, given the 2-D one, builds the same mask (or none
    when nothing is padding), so the hidden states are the same: equal up to a reordering of the softmax's few
    sums (float32 defaults: 1.3e-6 relative), with and without padding."""
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    for texts in ([PAIRS[0][0], PAIRS[0][1]], ["A dog runs.", "A cat naps."]):
        features = encoder.tokenize(texts)
        with torch.no_grad():
            two_d = encoder.pooling(encoder.transformer(**features).last_hidden_state, features["attention_mask"])
            torch.testing.assert_close(encoder(features), two_d)
    assert encoder._attention_mask(features["attention_mask"]).shape == (2, 1, 1, features["input_ids"].shape[1])


@pytest.mark.slow  # inductor compiles the tiny BERT's forward and backward in ~40 s on 2 cores
def test_compiled_training_forward_matches_eager_and_keeps_the_weights(tiny_model_dir):
    """scaling.compile: the training-mode forward runs compiled with the gradients of the eager one (no dropout,
    so both compute the same function; inductor fuses and reorders float32 sums: ~1e-6 relative of values of
    order 1, within float32's default tolerance), evaluation stays eager, and ``state_dict`` keeps its keys."""
    eager, compiled = (SentenceEncoder.load(str(tiny_model_dir)) for _ in range(2))
    keys = list(compiled.state_dict())
    compiled.compile_for_training()
    assert list(compiled.state_dict()) == keys
    features = eager.tokenize([PAIRS[0][0], PAIRS[1][1]])
    for encoder in (eager, compiled):
        encoder.train()
        for module in encoder.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        encoder(features).pow(2).sum().backward()
    assert compiled._compiled_forward is not None
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if p_eager.grad is not None:
            torch.testing.assert_close(p_compiled.grad, p_eager.grad, msg=name)
