"""SentenceEncoder, pooling, model resolution and the random BERT builder, checked against sentence-transformers."""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoTokenizer

from sbert_ray.models import BERT_SHAPES, Pooling, SentenceEncoder, build_random_bert, resolve_model_ref
from sbert_ray.models.encoder import MIN_BATCHES, smart_batches
from sbert_ray.models.resolve import packaged_model_dir
from sbert_ray.models.st_layout import ModelError

SENTENCES = [
    "A man is playing a guitar.",
    "Hi",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Two dogs run.",
    "Sentence embeddings map text to vectors",
]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> SentenceEncoder:
    return SentenceEncoder.load(tiny_model_dir)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# --- pooling -------------------------------------------------------------------------------------------


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Sentence 2 has one padding position holding large values that would dominate mean and max if counted.
    tokens = torch.tensor(
        [
            [[1.0, -2.0], [3.0, 0.0], [-1.0, 4.0]],
            [[2.0, -6.0], [0.0, -2.0], [100.0, 100.0]],
        ]
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return tokens, mask


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("mean", [[1.0, 2.0 / 3.0], [1.0, -4.0]]),
        ("max", [[3.0, 4.0], [2.0, -2.0]]),
        ("cls", [[1.0, -2.0], [2.0, -6.0]]),
    ],
)
def test_pooling_excludes_padding(mode: str, expected: list[list[float]]) -> None:
    tokens, mask = _padded_batch()
    torch.testing.assert_close(Pooling(mode)(tokens, mask), torch.tensor(expected))


def test_unknown_pooling_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="mean_sqrt"):
        Pooling("mean_sqrt")


# --- encode --------------------------------------------------------------------------------------------


def test_encode_restores_caller_order(encoder: SentenceEncoder) -> None:
    batched = encoder.encode(SENTENCES, batch_size=2)
    one_by_one = np.concatenate([encoder.encode([sentence]) for sentence in SENTENCES])
    # The same float32 math at other padded widths (other kernel blocking): a few ulps of values below ~4 (~1e-6).
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5, rtol=1e-5)
    assert not np.allclose(batched[0], batched[1])  # the rows really are different sentences


def test_token_budget_batches_hold_many_short_sentences_and_few_long_ones() -> None:
    lengths = [3, 40, 5, 40, 3, 12, 3, 5]
    batches = smart_batches(lengths, batch_size=2, max_tokens=80)
    assert batches == [[1, 3], [5, 2, 7, 0, 4, 6]]  # 2 x 40 tokens; then 6 x 12 (padded to the batch's longest)
    assert all(len(b) * max(lengths[i] for i in b) <= 80 for b in batches)
    assert smart_batches([200, 3], batch_size=2, max_tokens=80) == [[0], [1]]  # one sentence over the budget alone
    assert smart_batches(lengths, batch_size=3) == [[1, 3, 5], [2, 7, 0], [4, 6]]  # no budget: batch_size each


def test_default_token_budget_cuts_a_small_input_into_several_batches(encoder: SentenceEncoder) -> None:
    full = 32 * encoder.max_seq_length
    assert encoder.token_budget(32, [100] * 10_000) == full  # a large input: batch_size full-length sentences
    budget = encoder.token_budget(32, [10] * 1_000)  # 10,000 tokens: 8 batches (MIN_BATCHES) for threads to share
    assert budget < full and len(smart_batches([10] * 1_000, 32, budget)) == MIN_BATCHES
    assert encoder.token_budget(32, [10] * 10) == encoder.max_seq_length  # never below one full-length sentence


def test_token_budget_batching_gives_the_vectors_of_fixed_batches(encoder: SentenceEncoder) -> None:
    sentences = SENTENCES * 7  # short and long ones: the budget puts ~10x more short ones in a batch
    lengths = [len(ids) for ids in encoder.token_ids(sentences)["input_ids"]]
    budget = 2 * encoder.max_seq_length
    assert max(len(b) for b in smart_batches(lengths, 2, budget)) > 2  # the default budget really regroups
    fixed = np.concatenate([encoder.encode([sentence]) for sentence in sentences])  # no padding at all
    # The same float32 math at other padded widths (other kernel blocking): a few ulps of values below ~4 (~1e-6).
    np.testing.assert_allclose(encoder.encode(sentences, batch_size=2), fixed, atol=1e-5, rtol=1e-5)
    ids = encoder.token_ids(sentences)
    np.testing.assert_array_equal(encoder.encode_token_ids(ids, batch_size=2), encoder.encode(sentences, batch_size=2))


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights"])
def test_encode_threads_give_the_one_thread_vectors_in_order(encoder: SentenceEncoder, precision: str) -> None:
    model = copy.deepcopy(encoder).to_precision("bf16") if precision == "bf16-weights" else encoder
    sentences = SENTENCES * 7
    lengths = [len(ids) for ids in model.token_ids(sentences)["input_ids"]]
    batches = smart_batches(lengths, 2, max_tokens=40)
    assert len(batches) >= 6  # enough for 3 threads to share
    threads_seen: list[tuple[int, int]] = []  # (thread, its intra-op threads) of every forward
    hook = model.register_forward_pre_hook(
        lambda *_: threads_seen.append((threading.get_ident(), torch.get_num_threads()))
    )
    encode = functools.partial(model.encode, sentences, batch_size=2, precision=precision[:4], max_tokens=40)
    caller_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what each batch thread runs on: the same kernels, so the same bits
        one_thread = encode(threads=1)
        torch.set_num_threads(caller_threads)
        threads_seen.clear()
        in_threads, again = encode(threads=3), encode(threads=3)
    finally:
        hook.remove()
        torch.set_num_threads(caller_threads)
    # Batches ran off the caller's thread on one intra-op thread each (autocast entered there: the bits say so).
    assert all(thread != threading.get_ident() and intra_op == 1 for thread, intra_op in threads_seen)
    assert len(threads_seen) == 2 * len(batches)
    np.testing.assert_array_equal(in_threads, one_thread)  # the caller's order, the same values
    np.testing.assert_array_equal(in_threads, again)  # deterministic
    # The caller's intra-op threads are as they were, and so is the count a thread started afterwards begins with.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        later = pool.submit(torch.get_num_threads).result()
    assert torch.get_num_threads() == later == caller_threads


def test_encode_threads_default_to_torchs_and_agree_across_counts(encoder: SentenceEncoder) -> None:
    sentences = SENTENCES * 7
    caller_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        default, serial = encoder.encode(sentences, batch_size=2), encoder.encode(sentences, batch_size=2, threads=1)
        np.testing.assert_array_equal(default, encoder.encode(sentences, batch_size=2, threads=2))
    finally:
        torch.set_num_threads(caller_threads)
    # Serial forwards split each operation over 2 intra-op threads, which may sum in another order: float32
    # rounding of values below ~4 (~1e-6).
    np.testing.assert_allclose(default, serial, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        encoder.encode(sentences, threads=0)


def test_encode_outputs_and_no_autograd(encoder: SentenceEncoder) -> None:
    as_numpy = encoder.encode(SENTENCES, batch_size=3)
    as_torch = encoder.encode(SENTENCES, batch_size=3, convert_to="torch")
    assert isinstance(as_numpy, np.ndarray) and as_numpy.shape == (len(SENTENCES), encoder.embedding_dim)
    assert as_numpy.dtype == np.float32
    assert isinstance(as_torch, torch.Tensor) and not as_torch.requires_grad
    np.testing.assert_array_equal(as_torch.numpy(), as_numpy)
    assert encoder.encode([]).shape == (0, encoder.embedding_dim)
    with pytest.raises(TypeError):
        encoder.encode("a single string")


def test_encode_runs_in_eval_mode_and_restores_training(encoder: SentenceEncoder) -> None:
    encoder.train()
    try:
        first, second = encoder.encode(SENTENCES), encoder.encode(SENTENCES)
        assert encoder.training and encoder.transformer.training
    finally:
        encoder.eval()
    np.testing.assert_array_equal(first, second)  # dropout would make these differ
    encoder.encode(SENTENCES)
    assert not encoder.training


def test_tokenize_truncates_to_max_seq_length(tiny_model_dir: Path) -> None:
    short = SentenceEncoder.load(tiny_model_dir, max_seq_length=6)
    features = short.tokenize([SENTENCES[2], SENTENCES[1]])
    assert features["input_ids"].shape == (2, 6)
    assert features["attention_mask"].sum(dim=1).tolist() == [6, 3]  # [CLS] hi [SEP]


# --- sentence-transformers interoperability ------------------------------------------------------------


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", False), ("max", True), ("cls", False)])
def test_sentence_transformers_loads_our_models(
    tiny_model_dir: Path, tmp_path: Path, pooling: str, normalize: bool
) -> None:
    ours = SentenceEncoder.load(tiny_model_dir, pooling=pooling, normalize=normalize, max_seq_length=64)
    ours.save(tmp_path)
    theirs = SentenceTransformer(str(tmp_path), device="cpu")
    assert theirs.max_seq_length == 64
    # Two implementations of one float32 computation (pooling sums in their own order): ulps of values < ~4.
    np.testing.assert_allclose(ours.encode(SENTENCES), theirs.encode(SENTENCES), atol=1e-5, rtol=1e-5)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(ours.encode(SENTENCES), axis=1), 1.0, rtol=1e-5)


def test_we_load_models_saved_by_sentence_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    SentenceEncoder.load(tiny_model_dir, pooling="max", normalize=True, max_seq_length=48).save(tmp_path / "ours")
    theirs = SentenceTransformer(str(tmp_path / "ours"), device="cpu")
    theirs.save(str(tmp_path / "theirs"))  # written in sentence-transformers' own (current) format

    loaded = SentenceEncoder.load(tmp_path / "theirs")
    assert (loaded.pooling.mode, loaded.normalize, loaded.max_seq_length) == ("max", True, 48)
    np.testing.assert_allclose(loaded.encode(SENTENCES), theirs.encode(SENTENCES), atol=1e-5, rtol=1e-5)  # as above


def test_packaged_minilm_matches_sentence_transformers(minilm_ref: str, offline: None) -> None:
    ours = SentenceEncoder.load(minilm_ref)
    theirs = SentenceTransformer(str(packaged_model_dir(minilm_ref)), device="cpu")
    assert ours.normalize and ours.max_seq_length == theirs.max_seq_length == 256
    sentences = [*SENTENCES, " ".join(["embedding"] * 300)]  # the last is truncated at 256 tokens
    # 6 float32 layers at other batch shapes; unit vectors (entries < 1): errors ~1e-6, 1e-5 leaves a margin of ~10.
    np.testing.assert_allclose(ours.encode(sentences, batch_size=4), theirs.encode(sentences), atol=1e-5)


def test_plain_hugging_face_folder_loads_with_mean_pooling(encoder: SentenceEncoder, tmp_path: Path) -> None:
    encoder.transformer.save_pretrained(tmp_path)
    encoder.tokenizer.save_pretrained(tmp_path)
    loaded = SentenceEncoder.load(tmp_path)
    assert (loaded.pooling.mode, loaded.normalize, loaded.max_seq_length) == ("mean", False, 128)
    theirs = SentenceTransformer(str(tmp_path), device="cpu")  # also defaults to mean pooling
    np.testing.assert_allclose(loaded.encode(SENTENCES), theirs.encode(SENTENCES), atol=1e-5, rtol=1e-5)  # as above


# --- model references ----------------------------------------------------------------------------------


def test_resolve_local_folder(tiny_model_dir: Path) -> None:
    assert resolve_model_ref(tiny_model_dir) == str(tiny_model_dir.resolve())


@pytest.mark.parametrize("ref", ["sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"])
def test_resolve_offline_uses_packaged_minilm(ref: str, offline: None) -> None:
    resolved = Path(resolve_model_ref(ref))
    assert (resolved / "modules.json").is_file() and (resolved / "model.safetensors").is_file()


def test_resolve_unknown_offline_names_the_reference(offline: None) -> None:
    with pytest.raises(ModelError, match="someone/unknown-model"):
        resolve_model_ref("someone/unknown-model")


def test_resolve_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a folder"):
        resolve_model_ref(tmp_path / "missing")


# --- random BERT ---------------------------------------------------------------------------------------


def test_random_bert_has_the_named_shape_and_bert_vocab(encoder: SentenceEncoder, minilm_ref: str) -> None:
    config = encoder.transformer.config
    layers, hidden, heads, intermediate = BERT_SHAPES["tiny"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (layers, hidden, heads)
    assert config.intermediate_size == intermediate and encoder.embedding_dim == hidden
    assert config.vocab_size == len(encoder.tokenizer) == 30522
    minilm_tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir(minilm_ref))
    assert encoder.tokenizer(SENTENCES)["input_ids"] == minilm_tokenizer(SENTENCES)["input_ids"]


def test_random_bert_is_seeded(tmp_path: Path, encoder: SentenceEncoder) -> None:
    same = SentenceEncoder.load(build_random_bert(tmp_path / "same", seed=0))
    other = SentenceEncoder.load(build_random_bert(tmp_path / "other", seed=1))
    np.testing.assert_array_equal(same.encode(SENTENCES), encoder.encode(SENTENCES))
    assert not np.allclose(other.encode(SENTENCES), encoder.encode(SENTENCES))


def test_random_bert_with_own_vocab_file(tmp_path: Path) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    built = SentenceEncoder.load(build_random_bert(tmp_path / "model", vocab_file=tmp_path / "vocab.txt"))
    assert built.transformer.config.vocab_size == len(vocab)
    assert built.tokenize(["Hello worlds"])["input_ids"].tolist() == [[2, 5, 6, 7, 3]]


def test_random_bert_rejects_unknown_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="huge"):
        build_random_bert(tmp_path, shape="huge")


def test_to_device_moves_encode(encoder: SentenceEncoder) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    moved = encoder.to(device)
    assert moved.device.type == device.type
    assert moved.encode(SENTENCES[:2], convert_to="torch").device.type == device.type
