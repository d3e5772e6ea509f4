"""Host-device syncs in a steady training step: the loop reads its losses once per ``LOG_EVERY`` steps, and the
objectives read nothing back (cached MNRL's mini-batch widths come with the collated batch, from the host; the
cross-worker gather pads to the largest share, known on every rank). Counted as ``sync_counter`` counts them; with
CUDA, ``torch.cuda.set_sync_debug_mode("error")`` makes any sync raise."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from spawned_workers import SplitBatches, steady_step_syncs
from sync_counter import SyncCounter

from sbert_ray.config import StageConfig
from sbert_ray.losses import CachedMultipleNegativesRankingLoss, CosineSimilarityLoss, MultipleNegativesRankingLoss
from sbert_ray.losses.cached_multiple_negatives_ranking import _used_widths
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.padded_widths import buckets_for
from sbert_ray.training.batches import text_hashes, tokenize_texts
from sbert_ray.training.loop import LOG_EVERY, LocalReporter, MicroBatch, StepSettings, Telemetry, Trainee, train_stage
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.optimization import prepare_optimization
from sbert_ray.training.state import TrainState

# Of different lengths, so every batch has padding (the case transformers' mask check looks for).
PAIRS = [
    ("A man plays a guitar.", "Someone makes music on a guitar in the street tonight."),
    ("A dog runs.", "An animal is running through a green park."),
    ("A woman slices an onion on a board.", "Cooking."),
    ("The sky is blue.", "Stock markets fell sharply today in early trading."),
]


OBJECTIVES = ["regression", "mnrl", "cached_mnrl"]


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
    buckets = buckets_for(device, encoder.compiled, encoder.max_seq_length)
    return rows.collate(range(len(PAIRS)), encoder.tokenizer.pad_token_id, pad_left, device, buckets)


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
def test_a_steady_training_step_reads_nothing_else_back_to_the_host(tiny_model_dir, name):
    """Before the encoder passed a 4-D mask, transformers' SDPA mask check (``padding_mask.all()``) read one
    value per forward: one sync per step for regression and MNRL, more for cached MNRL (one per mini-batch
    forward), which also read its mini-batches' widths from the attention masks (one ``tolist`` per step) before
    the collated batch carried them from the host. The first step is left out: its first calls may set things
    up once."""
    objective = objectives(SentenceEncoder.load(str(tiny_model_dir)))[name]
    counter, per_step = SyncCounter(), []

    def close_step(index: int) -> None:
        per_step.append(list(counter.syncs))
        counter.syncs.clear()

    with counter:
        train_without_reads(objective, torch.device("cpu"), close_step)
    per_step.append(list(counter.syncs))  # the last step's
    steady = per_step[2:]  # per_step[0]: before the first batch; per_step[1]: the first step
    assert len(steady) == LOG_EVERY - 2 and steady == [[]] * (LOG_EVERY - 2)


@pytest.mark.slow  # spawns a two-process group
def test_a_steady_step_on_two_workers_reads_nothing_back(tiny_model_dir, tmp_path):
    """The cross-worker gather pads every worker's rows to the largest share and carries the counts on the device,
    so MNRL, cached MNRL and Matryoshka over MNRL (one gather for every size) read nothing back on either worker,
    at an uneven split too (worker 1's one row padded to 3). Before, each gather read every worker's count: one
    ``tolist`` per forward, one per size under Matryoshka."""
    texts = [[pair[0] for pair in PAIRS], [pair[1] for pair in PAIRS]]
    batches = SplitBatches(2, str(tiny_model_dir), str(tmp_path), [(3, 1)], texts)
    mp.spawn(steady_step_syncs, args=(batches, [text_hashes(column).tolist() for column in texts]), nprocs=2)
    for rank in range(2):
        syncs = torch.load(tmp_path / f"syncs{rank}.pt")
        assert syncs == {"mnrl": [], "cached_mnrl": [], "matryoshka_mnrl": []}, rank


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
