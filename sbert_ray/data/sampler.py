"""Length-grouped ("smart") batching, sharded across data-parallel workers.

Each epoch, from (seed, epoch): shuffle all indices, cut them into mega-batches of
batch_size * num_replicas * MEGA_BATCH_FACTOR, sort each mega-batch by length and cut it into batches (so a
batch holds examples of similar length and pads little), group neighbouring batches into rounds of num_replicas,
shuffle the rounds, then deal each round's batches to the ranks: the batches of one step have similar lengths, so
no worker idles at the gradient all-reduce while another finishes a long batch. Every rank gets the same number
of batches, so no DDP worker waits for a missing step: the last short batch is kept and the batch list is padded
by repeating batches from its start, so a few examples are seen twice per epoch (like DistributedSampler's
padding).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

MEGA_BATCH_FACTOR = 50  # batches per rank sorted together: large enough to group lengths, small enough to shuffle


class SmartBatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
    ) -> None:
        if batch_size < 1 or num_replicas < 1:
            raise ValueError(f"batch_size and num_replicas must be >= 1, got {batch_size}, {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed = seed
        self.num_batches = self.batches_per_rank(len(self.lengths), batch_size, num_replicas)  # per full epoch
        if self.num_batches == 0:
            raise ValueError(f"{len(self.lengths)} examples make no batch of {batch_size}")
        self.epoch, self.start_batch = 0, 0

    @staticmethod
    def batches_per_rank(size: int, batch_size: int, num_replicas: int) -> int:
        """Batches each rank gets per epoch: all batches (the last one may be short), padded to whole rounds."""
        return math.ceil(math.ceil(size / batch_size) / num_replicas)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's order; start_batch > 0 skips this rank's first batches (resume mid-epoch)."""
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch must be in [0, {self.num_batches}], got {start_batch}")
        self.epoch, self.start_batch = epoch, start_batch

    def _epoch_batches(self) -> list[np.ndarray]:
        """All ranks' batches of the current epoch, padded to num_batches * num_replicas."""
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.lengths))
        mega = self.batch_size * self.num_replicas * MEGA_BATCH_FACTOR
        batches = []
        for start in range(0, len(order), mega):
            chunk = order[start : start + mega]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches.extend(chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        # The ranks' batches of one step are neighbours in length order, shuffled as a unit, so no rank's
        # all-reduce waits long for another's longer batch. The last, short round (if any) stays at the end.
        whole = len(batches) // self.num_replicas * self.num_replicas
        rounds = [batches[i : i + self.num_replicas] for i in range(0, whole, self.num_replicas)]
        batches = [batch for i in rng.permutation(len(rounds)) for batch in rounds[i]] + batches[whole:]
        needed = self.num_batches * self.num_replicas
        return [batches[i % len(batches)] for i in range(needed)]

    def __iter__(self) -> Iterator[list[int]]:
        mine = self._epoch_batches()[self.rank :: self.num_replicas]
        for batch in mine[self.start_batch :]:
            yield batch.tolist()

    def unseen(self, batches_per_rank: int) -> int:
        """Examples of the current epoch in none of the first ``batches_per_rank`` batches of any rank: what a loop
        that stops there (at its last whole optimizer step under gradient accumulation) never sees this epoch."""
        batches = self._epoch_batches()
        used = [b for rank in range(self.num_replicas) for b in batches[rank :: self.num_replicas][:batches_per_rank]]
        return len(self.lengths) - (len(np.unique(np.concatenate(used))) if used else 0)

    def __len__(self) -> int:
        """Batches this rank yields in the current pass (num_batches - start_batch), equal on all ranks."""
        return self.num_batches - self.start_batch
