"""Padded widths of training batches (``models.padded_widths``): on CUDA a few buckets, so a compiled forward meets
a bounded number of shapes; exact widths on CPUs; which batches carry no padding; and the padding a generated corpus
costs through the real batching path (windowed length sorting, per-column padding, buckets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sbert_ray.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
from sbert_ray.losses.cached_multiple_negatives_ranking import _MiniBatches
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.encoder import compiles
from sbert_ray.models.padded_widths import SMALL_BUCKETS, bucketed_width, buckets_for, unpadded, width_buckets
from sbert_ray.training.batches import TokenizedColumn, TokenizedRows
from sbert_ray.training.stream import BatchPlan, SourceCounts, cut_window

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU: only the decisions are tested


def test_buckets_are_the_small_ones_then_powers_of_two_up_to_max_seq_length():
    assert width_buckets(128) == SMALL_BUCKETS
    assert width_buckets(512) == (*SMALL_BUCKETS, 256, 512)
    assert width_buckets(384) == (*SMALL_BUCKETS, 256, 384)
    assert width_buckets(40) == (8, 16, 24, 32, 40)


def test_a_width_is_the_smallest_bucket_that_holds_the_longest_text():
    buckets = width_buckets(512)
    assert [bucketed_width(n, buckets) for n in (1, 8, 9, 64, 65, 97, 129, 300, 512)] == [
        8, 8, 16, 64, 96, 128, 256, 512, 512,
    ]  # fmt: skip
    assert bucketed_width(37, None) == 37


def test_cuda_or_a_compiled_forward_buckets_and_only_cuda_compiles_by_default():
    assert buckets_for(CPU, False, 128) is None and buckets_for(CUDA, False, 128) == width_buckets(128)
    assert buckets_for(CPU, True, 128) == width_buckets(128)  # scaling.compile: true on CPUs: shapes bounded too
    assert compiles("auto", CUDA) and not compiles("auto", CPU)
    assert compiles(True, CPU) and not compiles(False, CUDA)


def test_a_batch_is_unpadded_only_when_every_row_fills_the_width():
    full = np.array([24, 24, 24])
    assert unpadded(full, 24, pad_left=False)
    assert not unpadded(np.array([24, 23, 24]), 24, pad_left=False)
    assert not unpadded(full, 32, pad_left=False)  # a bucket wider than every row is padding
    assert not unpadded(full, 24, pad_left=True)  # left padding reports the full width for every row
    assert not unpadded(None, 24, pad_left=False)


def generated_rows(rows: int, medians: tuple[int, ...], max_seq_length: int, seed: int = 0) -> TokenizedRows:
    """Texts of ``len(medians)`` columns with log-normal token counts (sigma 0.6: a long tail, as sentence lengths
    have), a row's columns correlated (each the first's length times log-normal noise, sigma 0.25, as an answer's
    length follows its question's), truncated to ``max_seq_length``."""
    rng = np.random.default_rng(seed)
    first = rng.lognormal(np.log(medians[0]), 0.6, rows)
    columns, lengths = [], []
    for index, median in enumerate(medians):
        noise = rng.lognormal(0.0, 0.25, rows) if index else 1.0
        length = np.clip(np.round(first * noise * median / medians[0]), 3, max_seq_length).astype(np.int32)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(length, out=offsets[1:])
        columns.append(TokenizedColumn(rng.integers(5, 30000, offsets[-1], dtype=np.int32), offsets))
        lengths.append(length)
    hashes = [rng.integers(0, 2**62, rows) for _ in medians]
    return TokenizedRows(columns, hashes, np.max(lengths, 0), None, np.zeros(rows, dtype=np.int8))


def padded_batches(rows: TokenizedRows, plan: BatchPlan, buckets: tuple[int, ...] | None):
    """Every batch of one pass, cut window by window as a worker cuts them, each column padded as collation pads
    it: per batch and column the attention mask and the rows' used widths."""
    window = plan.window_batches * plan.batch_size
    for number, start in enumerate(range(0, len(rows), window)):
        part = rows.take(np.arange(start, min(len(rows), start + window)))
        batches, _ = cut_window(part, plan, (plan.seed, 0, number), whole_only=False, counts=SourceCounts())
        for batch in batches:
            yield [column.pad(batch, 0, False, False, buckets) for column in part.columns]


def test_a_run_meets_at_most_the_predicted_number_of_shapes_on_cuda():
    """Over a generated corpus of many batches (a short last batch per window included), the collated columns
    and cached MNRL's mini-batches (cut to bucketed widths) come in at most len(buckets) widths for each row
    count: the micro-batch, the short batches, the mini-batch and its remainder."""
    max_seq_length, mini_batch = 256, 12
    buckets = buckets_for(CUDA, False, max_seq_length)
    plan = BatchPlan(batch_size=32, world_size=1, rank=0, seed=3, window_batches=20)
    rows = generated_rows(6000, (14, 40), max_seq_length)
    cut = _MiniBatches(mini_batch, buckets, pad_left=False)
    column_shapes, mini_batch_shapes = set(), set()
    for columns in padded_batches(rows, plan, buckets):
        for padded, used in columns:
            column_shapes.add(tuple(padded.shape[1:]))
            mask = {"attention_mask": padded[1], "input_ids": padded[0]}
            mini_batch_shapes |= {tuple(part["input_ids"].shape) for part, _ in cut(mask, used)}
    widths = {width for _, width in column_shapes | mini_batch_shapes}
    assert widths <= set(buckets) and len(widths) > 4  # the corpus spans many buckets
    row_counts = {count for count, _ in column_shapes}
    assert len(column_shapes) <= len(buckets) * len(row_counts)
    mini_row_counts = {mini_batch} | {count % mini_batch for count in row_counts} - {0}
    assert {count for count, _ in mini_batch_shapes} <= mini_row_counts
    assert len(mini_batch_shapes) <= len(buckets) * len(mini_row_counts)


def padding_ratio(rows: TokenizedRows, plan: BatchPlan, buckets: tuple[int, ...] | None) -> float:
    """Padded tokens over real tokens of every column of every batch of one pass."""
    padded = real = 0
    for columns in padded_batches(rows, plan, buckets):
        for tensor, _ in columns:
            padded, real = padded + tensor[1].numel(), real + int(tensor[1].sum())
    return padded / real


@pytest.mark.parametrize("medians", [(24, 30), (12, 16)])
def test_padded_over_real_tokens_of_a_generated_corpus(medians):
    """Pairs of log-normal lengths through window sorting (the default 200 batches of 32) and per-column padding.
    Exact widths (CPUs) stay within 1.15 for texts of ~24-30 tokens; sentence-length ones of ~12-16 pad more,
    and GPU buckets (every multiple of 8 below 64) add to both: docs/performance.md has the numbers."""
    plan = BatchPlan(batch_size=32, world_size=1, rank=0, seed=0)
    rows = generated_rows(32000, medians, 128)
    exact, bucketed = padding_ratio(rows, plan, None), padding_ratio(rows, plan, buckets_for(CUDA, False, 128))
    print(f"padded/real tokens, medians {medians}: exact widths {exact:.3f}, GPU buckets {bucketed:.3f}")
    assert 1.0 < exact < bucketed
    if medians == (24, 30):
        assert exact <= 1.15


def transformer_masks(encoder: SentenceEncoder) -> list[torch.Tensor | None]:
    """The attention mask each transformer forward of ``encoder`` receives from now on (None: none)."""
    masks = []
    encoder.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    return masks


def test_an_unpadded_batch_is_embedded_without_a_mask_and_as_with_one(tiny_model_dir):
    """A batch whose rows all fill the width (known on the host) reaches the transformer without an attention
    mask, which lets SDPA pick its flash kernel on a GPU; the embeddings are the masked ones': equal up to a
    reordering of the softmax's few sums (float32 defaults: 1.3e-6 relative). A batch with one padded row keeps
    its mask."""
    encoder = SentenceEncoder.load(str(tiny_model_dir))  # eval mode: no dropout, so both compute one function
    masks = transformer_masks(encoder)
    texts = [["a b c d", "e f g h"], ["one two three four", "five six seven eight"]]
    features = [encoder.tokenize(column) for column in texts]
    assert all(column["attention_mask"].all() for column in features)  # equal lengths: no padding
    used = [column["attention_mask"].sum(1).numpy() for column in features]
    objective = MultipleNegativesRankingLoss(encoder)
    with torch.no_grad():
        without_mask = objective.embed(features, used)
        with_mask = objective.embed(features, None)  # widths unknown: the mask is kept
    assert masks[0] is None and masks[1] is not None
    for unmasked, masked in zip(without_mask, with_mask, strict=True):
        torch.testing.assert_close(unmasked, masked)
    used[1][0] -= 1  # one row one token short of the width: padding
    with torch.no_grad():
        objective.embed(features, used)
    assert masks[2] is not None


def test_cached_mnrl_leaves_the_mask_out_of_its_unpadded_mini_batches_only(tiny_model_dir):
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    masks = transformer_masks(encoder)
    column = encoder.tokenize(["a b c d", "e f g h", "a b", "c"])  # two full rows, then two short ones
    used = column["attention_mask"].sum(1).numpy()
    objective = CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=2)
    with torch.no_grad():
        (cached,) = objective.embed([column], [used])
        plain = encoder(column)
    assert masks[0] is None and masks[1] is not None
    torch.testing.assert_close(cached, plain)
