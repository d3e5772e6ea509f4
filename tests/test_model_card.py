"""Model cards: written into a saved model folder, saying everything that is known about the model, and harmless to
sentence-transformers and the Hugging Face Hub tooling that read README.md."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from huggingface_hub import ModelCard
from sentence_transformers import SentenceTransformer

from sbert_ray.models import SentenceEncoder
from sbert_ray.models.model_card import ModelCardInfo, StageInfo, write_model_card

INFO = ModelCardInfo(
    base_model="sentence-transformers/all-MiniLM-L6-v2",
    stages=[
        StageInfo(
            "softmax", "nli-offline", "train", 15830, {"concat": ["u", "v", "|u-v|"]}, 16, 2e-5, 1, 990,
            {"warmup_ratio": 0.1, "weight_decay": 0.01},
        ),
        StageInfo("regression", "stsb", "train", 5749, {"score_max": 5.0}, 32, 3e-5, 4, 719),
    ],
    hardware="NVIDIA H100 80GB HBM3",
    num_workers=4,
    train_seconds=3725.4,
    results={
        "stsb/spearman_cosine": 85.08, "stsb/pearson_cosine": 85.51, "stsb/n": 1379,
        "nli-triplets/accuracy_euclidean": 0.9409, "nli-triplets/accuracy_cosine": 0.9398,
        "sts12/spearman_cosine": 72.37, "sts12/subsets/MSRpar/spearman_cosine": 42.01,
        "sts12/subsets/MSRpar/n": 750,
    },
    primary_metrics={"stsb": "spearman_cosine", "nli-triplets": "accuracy_euclidean", "sts12": "spearman_cosine"},
    name="nli-then-stsb",
    mlflow_run_id="0123456789abcdef",
    tracking_uri="http://mlflow.internal:5000",
    mlflow_model_uri="models:/minilm-nli-stsb@champion",
    registered_model_name="minilm-nli-stsb",
)  # fmt: skip


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "final-model")


def test_card_says_what_is_known(model_dir):
    text = write_model_card(model_dir, INFO).read_text()
    card = ModelCard(text)  # the Hub's parser: YAML metadata, then Markdown
    assert card.data.library_name == "sentence-transformers"
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert "sentence-transformers" in card.data.tags
    for fact in (
        "# nli-then-stsb",
        "**Pooling:** mean",  # read from the folder, as are length and size
        "**Maximum Sequence Length:** 128 tokens",
        "**Output Dimensionality:** 32 dimensions",
        "| 1 | softmax | nli-offline | train | 15,830 | concat=u, v, \\|u-v\\| | 16 | 2e-05 | 1 | 990 |",
        "| 2 | regression | stsb | train | 5,749 | score_max=5.0 | 32 | 3e-05 | 4 | 719 |",
        "Stage 1: warmup_ratio=0.1; weight_decay=0.01",
        "4 data-parallel Ray Train workers, each on NVIDIA H100 80GB HBM3",
        "**Training time:** 1 h 2 min 5 s",
        "| stsb | spearman_cosine | **85.08** | pearson_cosine 85.51, n 1379 |",
        "| nli-triplets | accuracy_euclidean | **0.9409** | accuracy_cosine 0.9398 |",
        "| sts12/subsets/MSRpar | spearman_cosine | **42.01** | n 750 |",  # STS sub-sets: the quickstart's sts suite
        "`0123456789abcdef` at `http://mlflow.internal:5000`",
        'mlflow.pyfunc.load_model("models:/minilm-nli-stsb@champion")',
        'mlflow models serve -m "models:/minilm-nli-stsb@champion"',
        "**MLflow registered model:** minilm-nli-stsb",
        f'SentenceTransformer("{model_dir}")',
    ):
        assert fact in text, fact


def test_folder_still_loads_and_sentence_transformers_keeps_the_card(model_dir, tmp_path):
    before = SentenceEncoder.load(model_dir).encode(["a card changes nothing"])
    path = write_model_card(model_dir, INFO)
    np.testing.assert_array_equal(SentenceEncoder.load(model_dir).encode(["a card changes nothing"]), before)
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    np.testing.assert_allclose(model.encode(["a card changes nothing"]), before, atol=1e-5)
    model.save(str(tmp_path / "copy"))  # what MLflow's flavor does with it: an untrained model keeps its card
    assert (tmp_path / "copy" / "README.md").read_text() == path.read_text()


def test_local_base_model_and_no_mlflow(model_dir):
    """A base model that is a folder or random:* is not Hub metadata; without a run there is no MLflow section."""
    bare = ModelCardInfo(
        base_model="random:tiny", stages=INFO.stages, hardware="CPU (x86_64)", num_workers=1, train_seconds=42,
        results={}, primary_metrics={},
    )  # fmt: skip
    text = write_model_card(model_dir, bare).read_text()
    assert ModelCard(text).data.base_model is None
    assert "**Base model:** random:tiny" in text and "**Hardware:** 1 Ray Train worker on CPU (x86_64)" in text
    assert "mlflow" not in text.split("### Framework Versions")[0].lower()
    assert "The final model was not evaluated." in text


@pytest.mark.parametrize(
    "results, primary, message",
    [
        ({"spearman": 80.0}, {}, "'spearman' is not of the form <entry>/<metric>"),
        ({"stsb/pearson_cosine": 80.0}, {"stsb": "spearman_cosine"}, "'stsb' has no primary metric"),
    ],
)
def test_bad_results_are_errors(model_dir, results, primary, message):
    info = ModelCardInfo(
        base_model="random:tiny", stages=[], hardware="CPU", num_workers=1, train_seconds=1,
        results=results, primary_metrics=primary,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        write_model_card(model_dir, info)
    assert not (model_dir / "README.md").exists()


def test_a_folder_that_is_not_a_sentence_transformers_model_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not a sentence-transformers folder"):
        write_model_card(tmp_path, INFO)
