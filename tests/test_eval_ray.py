"""The Ray parts of evaluation, on a local cluster of their own: encoding over workers gives the single-process
embeddings and metrics (reranking's first stage too); cross-topic fine-tuning trains a fold through the project's
Ray Train loop."""

from __future__ import annotations

import numpy as np
import pytest

from sbert_ray.data.readers import load_records
from sbert_ray.data.retrieval_sets import stsb_retrieval
from sbert_ray.evaluation import argsim, triplets
from sbert_ray.evaluation.encoder_pool import RayEncoder
from sbert_ray.evaluation.reranking import evaluate_reranking
from sbert_ray.evaluation.retrieval import evaluate_retrieval
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.teachers import BiEncoderTeacher
from sbert_ray.runs.argsim_folds import finetune_config, finetune_folds


def test_ray_workers_reproduce_single_process_encoding(local_ray, tiny_model_dir, data_dir):
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    sample = load_records("nli-triplets", "test", data_dir)[:150]
    sentences = list(dict.fromkeys(s for t in sample for s in (t.anchor, t.positive, t.negative)))
    single = encoder.encode(sentences, batch_size=16)
    with RayEncoder(encoder, num_workers=2) as spread:
        np.testing.assert_array_equal(spread.encode(sentences, batch_size=16), single)
        assert triplets.evaluate_triplets(spread, sample, batch_size=16) == triplets.evaluate_triplets(
            encoder, sample, batch_size=16
        )
        # Retrieval: 5 corpus chunks encoded and searched on the 2 workers, their top k merged here as they come
        retrieval = stsb_retrieval(load_records("stsb", "dev", data_dir)[:400])
        assert len(retrieval.corpus) > 4 * 80
        spread_metrics = evaluate_retrieval(spread, retrieval, batch_size=16, query_chunk=32, corpus_chunk=80)
        assert spread_metrics == evaluate_retrieval(encoder, retrieval, batch_size=16, query_chunk=32, corpus_chunk=80)
        # Reranking (eval --workers N with rerank: tasks): the first stage on the workers, the reranker here
        reranker = BiEncoderTeacher(encoder)
        spread_reranked = evaluate_reranking(spread, reranker, retrieval, top_k=12, batch_size=16)
        assert spread_reranked == evaluate_reranking(encoder, reranker, retrieval, top_k=12, batch_size=16)


def test_finetune_one_fold_through_ray_train(local_ray, tmp_path, tiny_model_dir, data_dir):
    """A fresh copy per fold, trained by the project's Ray Train loop on the fold's topics, then scored."""
    pairs = [r for r in argsim.load_argsim("bws", data_dir) if r.topic in ("Cloning", "Abortion")]
    fold = argsim.Fold(
        "Cloning", [r for r in pairs if r.topic == "Abortion"][:64], [r for r in pairs if r.topic == "Cloning"][:50]
    )
    config = finetune_config(
        str(tiny_model_dir),
        data_dir,
        overrides=[
            "stages.0.max_steps=2",
            "evaluation.dev_limit=20",
            f"checkpoint.storage_path={tmp_path / 'runs'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
    )
    scored = finetune_folds("bws", [fold], config)["Cloning"]
    assert scored["train_pairs"] == 64 and scored["n"] == 50
    untrained = argsim.score_pairs(SentenceEncoder.load(str(tiny_model_dir)), fold.test)
    assert scored["spearman_cosine"] != pytest.approx(untrained["spearman_cosine"], abs=1e-6)  # it was trained
    assert list((tmp_path / "runs").iterdir()) == []  # the throw-away fold run is cleaned up
