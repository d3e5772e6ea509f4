"""Decoder embedders (Qwen3, Qwen2, Llama, Mistral, Gemma 2 shapes, built offline): last-token and
position-weighted pooling, left and right padding and instruction prompts give sentence-transformers' embeddings;
such a model trains and its saved folder reloads in sentence-transformers with the same embeddings. RoBERTa and
ModernBERT encoders load too; the attention kernels and gradient checkpointing leave the arithmetic as it was."""

from __future__ import annotations

import functools
import importlib.util
import time

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling as StPooling
from transformers import AutoModel

from sbert_ray.config import ConfigError, EvalConfig, ModelConfig, ScalingConfig, StageConfig, TrainConfig, load_config
from sbert_ray.models import ModelError, SentenceEncoder, build_random_decoder, load_encoder
from sbert_ray.models.pooling import Pooling
from sbert_ray.models.random_bert import bert_tokenizer
from sbert_ray.models.random_decoder import tiny_config
from sbert_ray.runs.train_run import run_training
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.stage_plan import stage_plans
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


@pytest.mark.parametrize(
    "model_type, pooling, padding_side",
    [
        ("qwen3", "lasttoken", "left"),
        ("qwen3", "lasttoken", "right"),
        ("qwen3", "weightedmean", "left"),
        ("qwen2", "weightedmean", "right"),
        ("llama", "lasttoken", "left"),
        ("mistral", "lasttoken", "left"),
        ("gemma2", "lasttoken", "left"),  # no sdpa in transformers: loads with eager attention
    ],
)
def test_a_decoder_folder_encodes_as_sentence_transformers_does(tmp_path, model_type, pooling, padding_side):
    """A decoder with an instruction prompt for queries, saved by us: its queries (with the instruction) and
    documents (without) encode as sentence-transformers encodes them, and so does the folder sentence-transformers
    saves again (its newer pooling config: one ``pooling_mode`` key)."""
    path = build_random_decoder(
        tmp_path / "ours", model_type=model_type, pooling=pooling, padding_side=padding_side, prompts=INSTRUCTION
    )
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


@pytest.mark.parametrize(
    "model_type, shape",
    [("xlm-roberta", {"max_position_embeddings": 514, "type_vocab_size": 1}), ("modernbert", {})],
)
def test_roberta_and_modernbert_encoders_encode_as_sentence_transformers_does(tmp_path, model_type, shape):
    """Encoders of other families than BERT (random, with the BERT vocabulary), saved by us and loaded offline:
    bidirectional (the 4-D padding mask stays theirs), mean-pooled as in sentence-transformers."""
    tokenizer = bert_tokenizer()
    config = tiny_config(model_type, tokenizer, num_attention_heads=2, **shape)
    torch.manual_seed(0)
    SentenceEncoder(AutoModel.from_config(config), tokenizer, max_seq_length=64).save(tmp_path)
    ours = SentenceEncoder.load(str(tmp_path))
    assert not ours.causal
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(SENTENCES, batch_size=3)
    np.testing.assert_allclose(ours.encode(SENTENCES, batch_size=3), expected, rtol=0, atol=CLOSE)


def test_eager_attention_and_gradient_checkpointing_leave_the_arithmetic_alone(tmp_path):
    """``model.attn_implementation: eager`` encodes as sdpa does, and ``model.gradient_checkpointing`` gives the
    gradients of the run that keeps its activations (left padding, last-token pooling)."""
    path = str(build_random_decoder(tmp_path, prompts=INSTRUCTION))
    sdpa, eager = (load_encoder(path, attn_implementation=kernel) for kernel in ("sdpa", "eager"))
    assert eager.transformer.config._attn_implementation == "eager"
    np.testing.assert_allclose(eager.encode(SENTENCES), sdpa.encode(SENTENCES), rtol=0, atol=CLOSE)

    def gradients(encoder: SentenceEncoder) -> list[torch.Tensor]:
        encoder.train()
        encoder(encoder.tokenize(SENTENCES)).square().sum().backward()
        return [parameter.grad for parameter in encoder.parameters()]

    checkpointed = load_encoder(path, gradient_checkpointing=True)
    assert checkpointed.transformer.is_activation_checkpointing and not sdpa.transformer.is_activation_checkpointing
    for kept, recomputed in zip(gradients(sdpa), gradients(checkpointed), strict=True):
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=1e-6)


def test_flash_attention_without_flash_attn_is_refused_before_training(tiny_train_config, tmp_path):
    """On a machine without the flash-attn package: one line naming the key, before MLflow or Ray; and a model
    loaded with it where it cannot run is refused in the same words, not transformers' ImportError."""
    if importlib.util.find_spec("flash_attn"):
        pytest.skip("flash-attn is installed here")
    config = load_config(tiny_train_config(), ["model.attn_implementation=flash_attention_2"])
    with pytest.raises(ModelError, match="^model.attn_implementation: flash_attention_2 needs the flash-attn"):
        run_training(config)
    assert not (tmp_path / "mlflow.db").exists()
    with pytest.raises(ModelError, match="^model.attn_implementation: flash_attention_2 needs the flash-attn"):
        load_encoder("random:tiny", attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        load_config(tiny_train_config(), ["model.attn_implementation=flash"])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")), reason="needs a CUDA GPU and flash-attn"
)
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_flash_attention_2_embeds_as_sdpa_does_on_a_gpu(tmp_path, padding_side):
    """flash-attn runs the rows unpadded (varlen), sdpa masks the padding: in bf16 both round to 8 significant
    bits, so each embedding keeps its direction (cosine > 0.999; a padding token attended or the wrong last token
    pooled turns it by far more)."""
    path = str(build_random_decoder(tmp_path, padding_side=padding_side, prompts=INSTRUCTION))
    embeddings = [
        SentenceEncoder.load(path, attn_implementation=kernel).to("cuda").encode(SENTENCES, precision="bf16")
        for kernel in ("sdpa", "flash_attention_2")
    ]
    cosines = torch.nn.functional.cosine_similarity(*(torch.as_tensor(e) for e in embeddings))
    assert cosines.min() > 0.999, cosines


def test_a_left_padded_decoder_trains_and_reloads_in_sentence_transformers(tmp_path, data_dir):
    """Regression on 24 STSb pairs, 4 epochs, the anchors after the instruction: the loss falls, and the saved
    model (left padding, last-token pooling, the prompt) encodes in sentence-transformers as in sbert-ray."""
    path = build_random_decoder(tmp_path / "start", prompts=INSTRUCTION)
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
    started = start_worker(config, worker, None)
    data = functools.partial(local_sources, config, encoder=started.encoder)
    train_stages(stage_plans(config), started, data, worker, reporter, StepMeter(time.time(), torch.device("cpu")))

    losses = [report["train_loss"] for report in reporter.reports]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    saved = tmp_path / "run" / "step-12" / MODEL_DIR
    theirs = SentenceTransformer(str(saved), device="cpu")
    assert (theirs.tokenizer.padding_side, theirs.prompts["query"]) == ("left", INSTRUCTION["query"])
    ours = SentenceEncoder.load(str(saved))
    for prompt_name in ("query", None):
        expected = theirs.encode(SENTENCES, batch_size=2, prompt_name=prompt_name)
        np.testing.assert_allclose(ours.encode(SENTENCES, prompt_name=prompt_name), expected, rtol=0, atol=CLOSE)
