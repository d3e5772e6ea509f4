"""What a stage trains on: a user file's scores checked against score_max at their line, and every example the
limit, the tokeniser or the step arithmetic leaves out counted and logged (nothing dropped silently)."""

from __future__ import annotations

import logging

import pytest

from sbert_ray.config import StageConfig
from sbert_ray.data import DataError
from sbert_ray.data.sampler import SmartBatchSampler
from sbert_ray.models.random_bert import random_bert
from sbert_ray.training.batches import (
    TokenizedColumns,
    count_truncated,
    load_training_records,
    log_coverage,
)

LOGGER = "sbert_ray.training.batches"


@pytest.fixture(scope="module")
def tokenizer():
    return random_bert("tiny").tokenizer


def test_user_file_scores_must_lie_in_zero_to_score_max(tmp_path) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text("sentence1\tsentence2\tscore\na\tb\t3\nc\td\t100\n")
    stage = StageConfig(dataset=str(path), objective="regression", score_max=5.0)
    with pytest.raises(DataError, match=rf"^{path}, line 3: score 100 is outside this data's scale \[0, 5\]$"):
        load_training_records(stage, None)


def test_limit_is_logged(data_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        records = load_training_records(StageConfig(limit=100), data_dir)
    assert len(records) == 100
    assert "stsb: training on the first 100 of 5749 examples (limit)" in caplog.text


def test_truncated_texts_are_counted(tokenizer) -> None:
    # 3 word pieces + [CLS] + [SEP]: "a b c" is 5 tokens, so max_length 5 keeps it whole and 4 cuts it.
    texts = ["a b c", "a b", "a b c d e f", "a"]
    for max_length, expected in ((5, 1), (4, 2), (8, 0)):
        ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        assert count_truncated(tokenizer, texts, ids, max_length) == expected
    data = TokenizedColumns.tokenize([texts, ["x " * 10] * 4], None, tokenizer, max_seq_length=5)
    assert (data.texts, data.truncated) == (8, 1 + 4)


def test_leftover_micro_batches_are_counted_from_the_sampler() -> None:
    # 10 examples, micro-batches of 2: 5 batches. With 2 accumulation steps only 2 whole steps fit (4 batches),
    # so the 5th batch is never trained on in an epoch.
    sampler = SmartBatchSampler([5] * 10, batch_size=2)
    assert sampler.unseen(batches_per_rank=4) == 2
    assert sampler.unseen(batches_per_rank=5) == 0
    # Two ranks: 5 batches padded to 3 each (one repeated); one step of 2 micro-batches each leaves 2 unseen.
    ranks = [SmartBatchSampler([5] * 10, batch_size=2, num_replicas=2, rank=r) for r in range(2)]
    used = {i for sampler in ranks for batch in list(sampler)[:2] for i in batch}
    assert ranks[0].unseen(batches_per_rank=2) == 10 - len(used) == 2


def test_coverage_is_logged_once_per_stage(tokenizer, caplog) -> None:
    data = TokenizedColumns.tokenize([["a b c d e f"] * 10, ["a"] * 10], None, tokenizer, max_seq_length=5)
    sampler = SmartBatchSampler(data.lengths, batch_size=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log_coverage(0, data, sampler, batches_per_epoch=4)
    assert (
        "stage 0: 10 of 20 texts truncated to max_seq_length; 2 of 10 examples of epoch 0 fall in micro-batches "
        "left over after the last whole optimizer step" in caplog.text
    )
