"""Decoder embedders (Qwen3-shaped, built offline): last-token and position-weighted pooling, left and right
padding and instruction prompts give sentence-transformers' embeddings; such a model trains and its saved folder
reloads in sentence-transformers with the same embeddings."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling as StPooling

from sbert_ray.config import EvalConfig, ModelConfig, ScalingConfig, StageConfig, TrainConfig
from sbert_ray.models import SentenceEncoder, build_random_qwen3
from sbert_ray.models.pooling import Pooling
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.state import MODEL_DIR
from sbert_ray.training.stream import local_sources

INSTRUCTION = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "}
SENTENCES = [
    "A man is playing a guitar.",
    "fox",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods behind the farm.",
    "Two dogs run in the park.",
    "A child reads a book under a tree while the weather is sunny and warm.",
]
CLOSE = 1e-5  # float32 kernels summing in another order (sentence-transformers batches by characters, we by tokens)


@pytest.mark.parametrize("mode", ["lasttoken", "weightedmean"])
@pytest.mark.parametrize("include_prompt", [True, False])
def test_pooling_equals_sentence_transformers_on_left_right_and_mixed_padding(mode, include_prompt):
    """On masks padded left, right and neither, with a prompt of 2 tokens left in or out: the same vectors as
    sentence-transformers' Pooling (last token: each row's last attended one; weights from each row's first)."""
    tokens = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    for rows in (slice(0, 3), slice(2, 4)):  # left-padded rows, right-padded rows (sentence-transformers' cases)
        theirs = StPooling(8, pooling_mode=mode, include_prompt=include_prompt)(
            {"token_embeddings": tokens[rows], "attention_mask": mask[rows], "prompt_length": 2}
        )["sentence_embedding"]
        ours = Pooling(mode, include_prompt)(tokens[rows], mask[rows], prompt_length=2)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("pooling", ["lasttoken", "weightedmean"])
def test_a_decoder_folder_encodes_as_sentence_transformers_does(tmp_path, padding_side, pooling):
    """A Qwen3 with an instruction prompt for queries, saved by us: its queries (with the instruction) and
    documents (without) encode as sentence-transformers encodes them, and so does the folder sentence-transformers
    saves again (its newer pooling config: one ``pooling_mode`` key)."""
    path = build_random_qwen3(tmp_path / "ours", pooling=pooling, padding_side=padding_side, prompts=INSTRUCTION)
    theirs = SentenceTransformer(str(path), device="cpu")
    assert theirs.tokenizer.padding_side == padding_side
    theirs.save(str(tmp_path / "theirs"))
    for folder in (path, tmp_path / "theirs"):
        ours = SentenceEncoder.load(str(folder))
        assert (ours.pooling.mode, ours.tokenizer.padding_side, ours.causal) == (pooling, padding_side, True)
        for prompt_name in ("query", None):
            expected = theirs.encode(SENTENCES, batch_size=3, prompt_name=prompt_name)
            got = ours.encode(SENTENCES, batch_size=3, prompt_name=prompt_name)
            np.testing.assert_allclose(got, expected, rtol=0, atol=CLOSE)
    with_instruction, without = (ours.encode(SENTENCES[:1], prompt_name=name) for name in ("query", None))
    assert np.abs(with_instruction - without).max() > 1e-3  # the instruction is in the input, not dropped


def test_a_left_padded_decoder_trains_and_reloads_in_sentence_transformers(tmp_path, data_dir):
    """Regression on 24 STSb pairs, 4 epochs, the anchors after the instruction: the loss falls, and the saved
    model (left padding, last-token pooling, the prompt) encodes in sentence-transformers as in sbert-ray."""
    path = build_random_qwen3(tmp_path / "start", prompts=INSTRUCTION)
    config = TrainConfig(
        seed=3,
        data_dir=str(data_dir),
        model=ModelConfig(name=str(path)),
        stages=[StageConfig(limit=24, batch_size=8, epochs=4, learning_rate=3e-3, warmup_ratio=0.0)],
        evaluation=EvalConfig(eval_every=3, final_tasks=[]),
        scaling=ScalingConfig(torch_threads=torch.get_num_threads()),
    )
    reporter = LocalReporter(tmp_path / "run")
    worker = Worker(torch.device("cpu"))
    encoder, state = start_worker(config, worker, None)
    data = functools.partial(local_sources, config, encoder=encoder)
    train_stages(config, encoder, state, None, data, worker, reporter, StepMeter(time.time(), torch.device("cpu")))

    losses = [report["train_loss"] for report in reporter.reports]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    saved = tmp_path / "run" / "step-12" / MODEL_DIR
    theirs = SentenceTransformer(str(saved), device="cpu")
    assert (theirs.tokenizer.padding_side, theirs.prompts["query"]) == ("left", INSTRUCTION["query"])
    ours = SentenceEncoder.load(str(saved))
    for prompt_name in ("query", None):
        expected = theirs.encode(SENTENCES, batch_size=2, prompt_name=prompt_name)
        np.testing.assert_allclose(ours.encode(SENTENCES, prompt_name=prompt_name), expected, rtol=0, atol=CLOSE)
