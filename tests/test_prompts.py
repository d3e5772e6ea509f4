"""Prompts: saved so that sentence-transformers' encode_query / encode_document give our vectors, pooling that
leaves prompt tokens out exactly where sentence-transformers does, and the training path's features."""

import json

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from sentence_transformers.util import cos_sim

from sbert_ray.config import ConfigError, load_config
from sbert_ray.data import load_records
from sbert_ray.data.retrieval_sets import stsb_retrieval
from sbert_ray.evaluation.retrieval import evaluate_retrieval
from sbert_ray.models import load_encoder
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.prompts import prompt_for_column
from sbert_ray.models.st_layout import ModelError

PROMPTS = {"query": "query: ", "document": "passage: ", "classify": "Represent the topic: "}
TEXTS = ["where did the cat sit?", "dogs bark at night when the moon is full", "markets"]
# Embeddings of a tiny random BERT are O(1) per dimension; the same float32 operations in two libraries agree to
# ~1e-7, so 1e-5 (the bound) holds on any CPU.
ATOL = 1e-5


@pytest.fixture(params=[("mean", True), ("mean", False), ("cls", False), ("max", False)], ids=str)
def saved(request, tiny_model_dir, tmp_path):
    return save_prompted(tiny_model_dir, tmp_path / "ours", *request.param)


def save_prompted(tiny_model_dir, folder, pooling: str, include_prompt: bool) -> tuple[SentenceEncoder, str]:
    encoder = SentenceEncoder.load(str(tiny_model_dir), pooling=pooling, prompts=PROMPTS, default_prompt_name="query")
    encoder.pooling.include_prompt = include_prompt
    encoder.save(folder)
    return encoder, folder


def test_sentence_transformers_encode_query_and_document_give_our_vectors(saved):
    encoder, folder = saved
    theirs = SentenceTransformer(str(folder), device="cpu")
    assert theirs.prompts == PROMPTS and theirs.default_prompt_name == "query"
    assert theirs[1].include_prompt == encoder.pooling.include_prompt
    for ours, reference in [
        (encoder.encode(TEXTS, prompt_name="query"), theirs.encode_query(TEXTS)),
        (encoder.encode(TEXTS, prompt_name="document"), theirs.encode_document(TEXTS)),
        (encoder.encode(TEXTS), theirs.encode(TEXTS)),  # the default prompt
        (encoder.encode(TEXTS, prompt="Q "), theirs.encode(TEXTS, prompt="Q ")),
    ]:
        np.testing.assert_allclose(ours, reference, atol=ATOL, rtol=0)
    reloaded = SentenceEncoder.load(str(folder))
    assert (reloaded.prompts, reloaded.default_prompt_name) == (PROMPTS, "query")
    assert reloaded.pooling.include_prompt == encoder.pooling.include_prompt


def test_leaving_the_prompt_out_of_pooling_changes_the_vector(tiny_model_dir):
    encoder = SentenceEncoder.load(str(tiny_model_dir), prompts=PROMPTS)
    included = encoder.encode(TEXTS, prompt_name="classify")
    encoder.pooling.include_prompt = False
    excluded = encoder.encode(TEXTS, prompt_name="classify")
    assert np.abs(included - excluded).min(axis=1).max() > 1e-3
    # The prompt's own tokens: [CLS] + its word pieces, without the [SEP] that follows it when tokenised alone.
    assert encoder.prompt_length("query: ") == 1 + len(encoder.tokenizer.tokenize("query: "))
    assert encoder.prompt_length("") == 0


def test_a_model_without_prompts_saves_no_prompt_keys(tiny_model_dir, tmp_path):
    SentenceEncoder.load(str(tiny_model_dir)).save(tmp_path / "plain")
    assert "prompts" not in json.loads((tmp_path / "plain" / "config_sentence_transformers.json").read_text())
    assert "include_prompt" not in json.loads((tmp_path / "plain" / "1_Pooling" / "config.json").read_text())


def test_prompt_for_column_gives_the_anchor_the_query_prompt():
    assert [prompt_for_column(PROMPTS, i) for i in range(3)] == ["query: ", "passage: ", "passage: "]
    assert prompt_for_column({"query": "q: ", "passage": "p: "}, 1) == "p: "  # encode_document's fallbacks
    assert prompt_for_column({}, 0) == prompt_for_column({"query": "q: "}, 1) == ""


@pytest.mark.parametrize("include_prompt", [True, False])
def test_training_features_with_prompt_length_pool_as_encode(tiny_model_dir, include_prompt):
    """The training side, Ray-free: the tokenisation stage puts prompt_for_column before each text and the prompt's
    length in the features (a tensor per batch, as a collated batch carries it); forward then pools as encode."""
    encoder = load_encoder("random:tiny", prompts=PROMPTS)
    encoder.pooling.include_prompt = include_prompt
    for column in (0, 1):
        prompt = prompt_for_column(encoder.prompts, column)
        features = encoder.tokenize([prompt + text for text in TEXTS])
        features["prompt_length"] = torch.full((len(TEXTS),), encoder.prompt_length(prompt))
        trained = encoder.train()(features)
        expected = encoder.encode(TEXTS, prompt=prompt, smart_batching=False, batch_size=len(TEXTS))
        # dropout is on in train mode: compare in eval mode, where forward is what training's forward computes
        torch.testing.assert_close(encoder.eval()(features), torch.as_tensor(expected), atol=ATOL, rtol=0)
        assert trained.shape == (len(TEXTS), encoder.embedding_dim)


def test_prompt_settings_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.default_prompt_name: 'passage' is not a key of model.prompts"):
        load_config(None, ["model.prompts={query: 'q: '}", "model.default_prompt_name=passage"])
    with pytest.raises(ConfigError, match="unknown key model.'prompt'"):
        load_config(None, ["model.prompt=x"])
    with pytest.raises(ModelError, match="default_prompt_name 'query' is not one of the prompts"):
        load_encoder(str(tiny_model_dir), default_prompt_name="query")
    encoder = SentenceEncoder.load(str(tiny_model_dir), prompts=PROMPTS)
    with pytest.raises(ValueError, match="unknown prompt name 'passage'"):
        encoder.encode(TEXTS, prompt_name="passage")
    with pytest.raises(ValueError, match="not both"):
        encoder.encode(TEXTS, prompt_name="query", prompt="q: ")


def test_retrieval_applies_the_query_and_document_prompts_as_sentence_transformers(tiny_model_dir, tmp_path, data_dir):
    """Queries get the query prompt and the corpus the document prompt: the numbers equal sentence-transformers'
    InformationRetrievalEvaluator on the same saved model (it encodes through encode_query / encode_document)."""
    encoder, folder = save_prompted(tiny_model_dir, tmp_path / "ours", "mean", include_prompt=False)
    data = stsb_retrieval(load_records("stsb", "dev", data_dir)[:300])
    evaluator = InformationRetrievalEvaluator(
        data.queries, data.corpus, data.relevant, batch_size=32, score_functions={"cosine": cos_sim}, write_csv=False
    )
    theirs = evaluator(SentenceTransformer(str(folder), device="cpu"))
    ours = evaluate_retrieval(encoder, data, batch_size=32)
    # means of per-query values in [0, 1] over ~50 queries: float64 rounding only (see test_retrieval.TOLERANCE)
    assert ours["ndcg_at_10_cosine"] == pytest.approx(theirs["cosine_ndcg@10"], abs=1e-9)
    assert ours["map_at_100_cosine"] == pytest.approx(theirs["cosine_map@100"], abs=1e-9)
    unprompted = evaluate_retrieval(SentenceEncoder.load(str(folder), prompts={}), data, batch_size=32)
    assert unprompted["ndcg_at_10_cosine"] != ours["ndcg_at_10_cosine"]  # the prompts were applied
