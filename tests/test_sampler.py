"""SmartBatchSampler: length grouping, the ranks' batches of one step alike in length, equal shards covering all
data, per-epoch determinism, mid-epoch resume."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from sbert_ray.data.sampler import SmartBatchSampler


def random_lengths(size: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 200, size=size).tolist()


def shards(lengths, batch_size, replicas, **kwargs) -> list[list[list[int]]]:
    return [list(SmartBatchSampler(lengths, batch_size, replicas, rank, **kwargs)) for rank in range(replicas)]


def test_batches_hold_neighbouring_lengths() -> None:
    # One mega-batch (400 <= 8 * 1 * 50): sorted batches must not overlap in length.
    lengths = random_lengths(400)
    batches = list(SmartBatchSampler(lengths, batch_size=8))
    spans = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches)
    assert all(high <= next_low for (_, high), (next_low, _) in zip(spans, spans[1:], strict=False))
    assert all([lengths[i] for i in batch] == sorted(lengths[i] for i in batch) for batch in batches)


def test_grouping_pads_far_less_than_random_batches() -> None:
    lengths = np.array(random_lengths(4992))  # 312 batches of 16
    grouped = list(SmartBatchSampler(lengths, batch_size=16, num_replicas=2))
    grouped_padding = sum(len(b) * lengths[b].max() - lengths[b].sum() for b in grouped)
    random_batches = np.random.default_rng(1).permutation(len(lengths)).reshape(-1, 16)
    random_padding = sum(16 * lengths[b].max() - lengths[b].sum() for b in random_batches) / 2  # one rank's half
    assert grouped_padding < random_padding / 5


def test_the_ranks_batches_of_one_step_are_alike_in_length() -> None:
    """DDP's all-reduce waits for the slowest rank: dealing random batches made each step as slow as the longer of
    two random batches (here the ranks' longest sentences differed by ~69 tokens on average; ~2 now)."""
    lengths = np.array(random_lengths(4992))
    per_rank = shards(lengths, 8, 2, seed=3)
    gaps = [abs(lengths[a].max() - lengths[b].max()) for a, b in zip(*per_rank, strict=True)]
    assert np.mean(gaps) < 5


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("size", [37, 250, 1001])
def test_padded_shards_cover_everything_with_equal_counts(replicas: int, size: int) -> None:
    batch_size = 4
    per_rank = shards(random_lengths(size), batch_size, replicas, seed=3)
    total_batches = math.ceil(size / batch_size)
    assert [len(batches) for batches in per_rank] == [math.ceil(total_batches / replicas)] * replicas
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert set(seen) == set(range(size))
    # Repeats come only from the padding batches, which are whole earlier batches.
    padding_batches = len(per_rank[0]) * replicas - total_batches
    assert sum(seen.values()) - size <= padding_batches * batch_size
    if padding_batches == 0:
        assert max(seen.values()) == 1


def test_divisible_data_is_an_exact_partition() -> None:
    per_rank = shards(random_lengths(960), 8, 4, seed=5)
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert seen == list(range(960))
    assert [len(batches) for batches in per_rank] == [30, 30, 30, 30]


def test_order_is_deterministic_per_seed_and_epoch() -> None:
    lengths = random_lengths(500)

    def epoch(seed: int, number: int) -> list[list[int]]:
        sampler = SmartBatchSampler(lengths, 8, num_replicas=2, rank=1, seed=seed)
        sampler.set_epoch(number)
        return list(sampler)

    assert epoch(0, 3) == epoch(0, 3)
    assert epoch(0, 3) != epoch(0, 4)
    assert epoch(0, 3) != epoch(1, 3)
    # A new epoch reshuffles which examples share a batch, not only the batch order.
    first, second = ({frozenset(batch) for batch in epoch(0, n)} for n in (0, 1))
    assert len(first & second) < len(first) / 2


def test_resume_skips_the_first_batches_of_one_epoch() -> None:
    sampler = SmartBatchSampler(random_lengths(300), 8, num_replicas=3, rank=2, seed=9)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4, start_batch=5)
    assert len(sampler) == len(full) - 5
    assert list(sampler) == full[5:]
    sampler.set_epoch(5)
    assert len(sampler) == len(full)
    with pytest.raises(ValueError, match="start_batch"):
        sampler.set_epoch(5, start_batch=len(full) + 1)


def test_invalid_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="no batch"):
        SmartBatchSampler([], batch_size=2, num_replicas=4)
    with pytest.raises(ValueError, match="rank must be in"):
        SmartBatchSampler([3, 4, 5], batch_size=2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="batch_size"):
        SmartBatchSampler([3, 4, 5], batch_size=0)


def test_works_as_a_dataloader_batch_sampler() -> None:
    lengths = random_lengths(50)
    sampler = SmartBatchSampler(lengths, batch_size=6, num_replicas=2, rank=0)
    loader = DataLoader(torch.arange(50), batch_sampler=sampler)
    batches = [batch.tolist() for batch in loader]
    assert len(loader) == len(batches) == len(sampler)
    assert batches == list(sampler)
