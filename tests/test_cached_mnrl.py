"""CachedMultipleNegativesRankingLoss: the same loss and gradients as MultipleNegativesRankingLoss on one process and
under DDP with two workers (with and without hard negatives), dropout and autocast replayed in the re-forward, and
one mini-batch's activations alive at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from spawned_workers import ddp_plain_and_cached_mnrl
from torch.utils._python_dispatch import TorchDispatchMode

from sbert_ray.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
from sbert_ray.losses.cached_multiple_negatives_ranking import (
    CPU_MINI_BATCH_SIZE,
    MEMORY_SHARE,
    OPTIMIZER_BYTES_PER_PARAMETER,
    ModelShape,
    auto_mini_batch_size,
)
from sbert_ray.models import SentenceEncoder

ANCHORS = [
    "A man plays a guitar on the stage tonight.",
    "Two dogs run in a field.",
    "A woman is cooking.",
    "Kids play football in the park after school.",
    "The train leaves at noon.",
    "An old man reads a newspaper on a bench.",
    "Birds sing.",
    "She paints a portrait of her grandmother.",
]
POSITIVES = [
    "Someone plays music.",
    "Animals are running outside in the grass.",
    "A person prepares food in a kitchen.",
    "Children play a sport.",
    "A train departs at midday.",
    "A man is reading.",
    "Some birds are singing in the trees this morning.",
    "A woman makes a painting.",
]
NEGATIVES = [
    "The stock market fell.",
    "It is raining in Paris.",
    "A car is parked.",
    "The cat sleeps all day long on the warm windowsill.",
    "Nobody is cooking.",
    "The bench is empty.",
    "A fish swims.",
    "The wall is blank.",
]
# The cached loss sums the same terms into each gradient as the uncached one, in another order (mini-batch by
# mini-batch), so the claim is exact math and the comparisons run the encoder (and with it pooling and the loss) in
# float64. Reordering a sum of n terms moves it by at most about n * 1.1e-16 * (sum of their absolute values):
# with n < 1e4 (tokens x features) and absolute sums < 10 that is < 1e-11 (measured: 4e-16), so 1e-9 has a margin
# of 100 and is still 1e5 times smaller than what one dropped term does. (In float32 the same reordering moved a
# gradient by 2.7e-6 on one CPU: no fixed float32 tolerance holds on every machine.)
GRAD_TOLERANCE = {"atol": 1e-9, "rtol": 1e-7}
FLOAT32_EPS = torch.finfo(torch.float32).eps


def _columns(with_hard_negatives: bool) -> list[list[str]]:
    return [ANCHORS, POSITIVES, NEGATIVES] if with_hard_negatives else [ANCHORS, POSITIVES]


def _loss_and_grads(loss_fn: torch.nn.Module, encoder: SentenceEncoder, features, scale: float = 1.0):
    encoder.zero_grad()
    loss = loss_fn(features) * scale
    loss.backward()
    grads = {name: p.grad.clone() for name, p in encoder.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.fixture
def encoder(tiny_model_dir: Path) -> SentenceEncoder:
    return SentenceEncoder.load(tiny_model_dir).double()  # eval mode: no dropout


@pytest.mark.parametrize(
    ("with_hard_negatives", "mini_batch_size", "symmetric"), [(False, 1, False), (True, 3, False), (True, 3, True)]
)  # 3: a short last one
def test_gradients_equal_uncached_loss(
    encoder: SentenceEncoder, with_hard_negatives: bool, mini_batch_size: int, symmetric: bool
):
    features = [encoder.tokenize(column) for column in _columns(with_hard_negatives)]
    loss, grads = _loss_and_grads(MultipleNegativesRankingLoss(encoder, symmetric=symmetric), encoder, features)
    cached = CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=mini_batch_size, symmetric=symmetric)
    # Scaled like the worker's gradient accumulation: the scale must reach every re-forwarded mini-batch.
    cached_loss, cached_grads = _loss_and_grads(cached, encoder, features, scale=0.5)
    torch.testing.assert_close(cached_loss, loss * 0.5, **GRAD_TOLERANCE)  # float64 too
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    torch.testing.assert_close(cached_grads, {k: g * 0.5 for k, g in grads.items()}, **GRAD_TOLERANCE)


@pytest.mark.parametrize("autocast", [False, True])
def test_re_forward_replays_dropout_and_autocast(encoder: SentenceEncoder, autocast: bool):
    """With dropout on, the re-forward must draw the masks of the first pass (and under autocast compute in
    bf16 again), or the cached gradients belong to other embeddings. Reference: the same mini-batches embedded
    in the same order with the same seed, without checkpointing."""
    encoder.float().train()  # float32: autocast leaves float64 alone
    mini_batch_size = 3
    columns = _columns(with_hard_negatives=True)

    def reference_embeddings() -> list[list[torch.Tensor]]:
        return [
            [encoder(encoder.tokenize(column[i : i + mini_batch_size])) for i in range(0, 8, mini_batch_size)]
            for column in columns
        ]

    def reference_loss(features):
        embeddings = [torch.cat(mini_batches) for mini_batches in reference_embeddings()]
        return MultipleNegativesRankingLoss(encoder).compute_loss_from_embeddings(embeddings)

    features = [encoder.tokenize(column) for column in columns]
    results = {}
    for name, loss_fn in [
        ("reference", reference_loss),
        ("cached", CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=mini_batch_size)),
    ]:
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            results[name] = _loss_and_grads(loss_fn, encoder, features)
    # The same float32 loss of the same embeddings (ops and dropout masks replayed); 1e-6 is ~4 ulps of a loss ~2.
    torch.testing.assert_close(results["cached"][0], results["reference"][0], atol=1e-6, rtol=1e-6)
    # Both sides add up the same k = 9 per-mini-batch contributions c_j to each gradient (bf16 under autocast, so
    # float64 is no option here), in different orders: float32 reordering moves a sum by at most
    # (k - 1) * eps * sum_j |c_j| each, twice that between the two; compared against four times that bound.
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        embeddings = [e for mini_batches in reference_embeddings() for e in mini_batches]
        loss = MultipleNegativesRankingLoss(encoder).compute_loss_from_embeddings(
            [torch.cat(embeddings[i : i + 3]) for i in range(0, len(embeddings), 3)]
        )
    params = {name: p for name, p in encoder.named_parameters() if p.requires_grad}
    spread = {name: torch.zeros_like(p) for name, p in params.items()}
    cached_gradients = torch.autograd.grad(loss, embeddings, retain_graph=True)
    for embedding, cached_gradient in zip(embeddings, cached_gradients, strict=True):
        contribution = torch.autograd.grad(
            embedding, list(params.values()), cached_gradient, retain_graph=True, allow_unused=True
        )
        for name, c in zip(params, contribution, strict=True):
            spread[name] += 0 if c is None else c.abs()
    for name, reference in results["reference"][1].items():
        bound = 4 * 2 * (len(embeddings) - 1) * FLOAT32_EPS * spread[name]
        assert ((results["cached"][1][name] - reference).abs() <= bound).all(), name
    # The comparison has teeth only if dropout changed the gradients.
    encoder.eval()
    without_dropout = _loss_and_grads(MultipleNegativesRankingLoss(encoder), encoder, features)[1]
    assert not all(torch.allclose(without_dropout[k], g, atol=1e-4) for k, g in results["cached"][1].items())


def test_one_mini_batch_is_re_embedded_at_a_time(encoder: SentenceEncoder):
    """During backward, the encoder re-runs a mini-batch only after the previous one's gradient has reached the
    embedding layer: the previous one's activations are spent, so memory holds one mini-batch's at a time."""
    events: list[str] = []
    in_backward = False

    def on_embedding_layer(module, inputs, output):
        if in_backward:
            events.append("re-forward")
        else:  # the backward pass runs through the first pass's graph; the re-forward only refills its tensors
            output.register_hook(lambda grad: events.append("backward done"))

    encoder.transformer.embeddings.register_forward_hook(on_embedding_layer)
    cached = CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=2)
    loss = cached([encoder.tokenize(column) for column in (ANCHORS, POSITIVES)])
    in_backward = True
    loss.backward()
    assert events == ["re-forward", "backward done"] * 8  # 2 columns x 4 mini-batches


class HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's values on the host (on a GPU each waits for the queued work):
    scalar reads (int(), .item(), a tensor in an ``if``), nonzero (its size depends on the values) and
    ``.tolist()`` (which reads a CPU tensor without dispatching an operation, so it is counted by wrapping)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}
    TOLIST = torch.Tensor.tolist  # the unwrapped one: a second counter replaces the first's wrapper, not wraps it

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        super().__init__()
        self.count = 0

        def counted_tolist(tensor):
            self.count += 1
            return HostReads.TOLIST(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_hashes", [False, True])
def test_the_cached_loss_reads_the_device_once_per_step_beyond_its_encoder(
    encoder: SentenceEncoder, monkeypatch: pytest.MonkeyPatch, with_hashes: bool
):
    """Given the rows' used widths from the host (as the collated batch carries them), the loss reads nothing
    back; without them it reads the mini-batches' widths from the attention masks in one go for all columns, not
    one read per mini-batch. Masking duplicates by the texts' hashes reads nothing. The encoder's own reads per
    forward (transformers' check of the attention mask, where the encoder passes it one) are counted apart."""
    columns = _columns(with_hard_negatives=True)
    features = [encoder.tokenize(column) for column in columns]
    hashes = [torch.tensor([hash(text) for text in column]) for column in columns] if with_hashes else None
    host_widths = [column["attention_mask"].sum(dim=1).numpy() for column in features]  # right-padded: lengths
    with HostReads(monkeypatch) as encoder_reads:
        encoder(features[0])
    forwards = []
    encoder.register_forward_hook(lambda module, inputs, output: forwards.append(1))
    loss = CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=3)
    with HostReads(monkeypatch) as cached_reads:
        loss(features, text_hashes=hashes)
    assert len(forwards) == 3 * 3  # 3 columns of 8 rows: mini-batches of 3, 3 and 2
    assert cached_reads.count == len(forwards) * encoder_reads.count + 1
    with HostReads(monkeypatch) as given_widths_reads:
        loss(features, text_hashes=hashes, used_widths=host_widths)
    assert given_widths_reads.count == len(forwards) * encoder_reads.count


@pytest.mark.slow  # spawns a two-process group
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_workers_give_the_global_batch_gradients(tiny_model_dir: Path, tmp_path: Path, strategy: str):
    """Two workers, each 2 micro-batches of 2: DDP averages the 4 per-micro-batch losses, each of which ranks
    its anchors against the candidates of both workers' micro-batch. Under FSDP (the encoder sharded, gradients
    reduce-scattered, cached MNRL's second forward gathering each layer again) the same: the embeddings the
    losses gather are whole whatever holds the weights."""
    column_sets = {with_hard_negatives: _columns(with_hard_negatives) for with_hard_negatives in (False, True)}
    args = (2, str(tiny_model_dir), str(tmp_path), column_sets, strategy == "fsdp")
    mp.spawn(ddp_plain_and_cached_mnrl, args=args, nprocs=2, join=True)
    results = torch.load(tmp_path / "grads.pt")
    encoder = SentenceEncoder.load(tiny_model_dir).double()
    for with_hard_negatives in (False, True):
        columns = _columns(with_hard_negatives)
        # Single process: micro-batch m is the rows both workers hold at step m (worker 0's, then worker 1's).
        encoder.zero_grad()
        for micro in range(2):
            rows = [*range(micro * 2, micro * 2 + 2), *range(4 + micro * 2, 4 + micro * 2 + 2)]
            features = [encoder.tokenize([column[i] for i in rows]) for column in columns]
            # Each worker's loss is the mean over its 2 anchors; DDP averages the 2 workers: the mean over all 4.
            (MultipleNegativesRankingLoss(encoder)(features) / 2).backward()
        expected = {k: p.grad for k, p in encoder.named_parameters() if p.requires_grad}
        torch.testing.assert_close(results[("plain", with_hard_negatives)], expected, **GRAD_TOLERANCE)
        torch.testing.assert_close(results[("cached", with_hard_negatives)], expected, **GRAD_TOLERANCE)


MINILM = ModelShape(layers=6, hidden=384, heads=12)  # all-MiniLM-L6-v2's shape, 22.7 M parameters


def activation_bytes(rows: int, shape: ModelShape, width: int, bytes_per_value: int) -> float:
    """Korthikanti et al. 2022's activations of ``rows`` rows (bytes per layer and row in 16-bit:
    width * hidden * (34 + 5 * heads * width / hidden)), spelled out per layer."""
    per_layer = width * shape.hidden * 34 + 5 * shape.heads * width * width
    return rows * shape.layers * per_layer * bytes_per_value / 2


@pytest.mark.parametrize("free_gib", [1, 16, 80])
@pytest.mark.parametrize("bytes_per_value", [2, 4])
def test_the_auto_mini_batch_is_the_most_rows_whose_activations_fit(free_gib: int, bytes_per_value: int):
    """On a GPU ``mini_batch_size: auto`` takes the most whole tiles of 8 rows whose activations fit 80 % of the
    free memory left after the optimizer's state (12 bytes per parameter)."""
    free, parameters = free_gib * 2**30, 22_700_000
    rows = auto_mini_batch_size(free, parameters, MINILM, 128, bytes_per_value)
    budget = MEMORY_SHARE * (free - OPTIMIZER_BYTES_PER_PARAMETER * parameters)
    assert rows % 8 == 0 and rows >= 8
    assert activation_bytes(rows, MINILM, 128, bytes_per_value) <= budget
    assert activation_bytes(rows + 8, MINILM, 128, bytes_per_value) > budget


def test_the_auto_mini_batch_shrinks_with_width_and_precision_and_is_at_least_one_row():
    free, parameters = 16 * 2**30, 22_700_000
    bf16 = auto_mini_batch_size(free, parameters, MINILM, 128, 2)
    assert auto_mini_batch_size(free, parameters, MINILM, 128, 4) in range(bf16 // 2 - 8, bf16 // 2 + 1)
    assert auto_mini_batch_size(free, parameters, MINILM, 512, 2) < bf16 // 4  # the attention term grows as width²
    assert auto_mini_batch_size(13 * parameters, parameters, MINILM, 128, 2) == 1  # almost nothing free


def test_auto_keeps_the_cpu_default(encoder: SentenceEncoder):
    """Off CUDA ``auto`` is CPU_MINI_BATCH_SIZE, resolved at the first embed (on CUDA, free memory is read then,
    with the model on the device)."""
    loss = CachedMultipleNegativesRankingLoss(encoder)
    assert loss.mini_batch_size == "auto"
    loss.embed([encoder.tokenize(ANCHORS)])
    assert loss.mini_batch_size == CPU_MINI_BATCH_SIZE == 32
