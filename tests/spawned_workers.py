"""Functions that ``torch.multiprocessing.spawn`` runs in fresh processes. A spawned process imports the module of
the function it runs, so they live here, beside nothing but torch and the package's model and loss code: from a
test module that imports sentence-transformers or Ray each process spent ~15 s importing before its first step on
2 busy cores. The tests pass their sentences in."""

from __future__ import annotations

import faulthandler
import gc
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from sync_counter import SyncCounter
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sbert_ray.losses import (
    CachedMultipleNegativesRankingLoss,
    CosineSimilarityLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from sbert_ray.losses.cached_multiple_negatives_ranking import _used_widths
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.sharding import gradients_kept_local, shard_encoder
from sbert_ray.training.sparse_embeddings import densify, sparse_embedding_gradients, sparse_gradient_weight

CPU = torch.device("cpu")
# A spawned process that dies of a signal (a SIGABRT once took a worker of test_fsdp.py's runs in CI, not seen again
# in 11 runs here; likely the gloo race that sharding.AllReduceThenSlice now avoids) leaves no traceback; pytest's
# own handler covers only its process. Every spawned process imports this module first, so each prints its
# threads' stacks if it dies so.
faulthandler.enable()


def leave_group() -> None:
    """Leave the process group once every rank is done with it. A rank that exits while a peer's gloo group still
    holds work with it can hang the peer in the group's destructor (CI of 95fb033: a DDP rank of test_cached_mnrl
    waited for ever in ~ProcessGroupGloo, freed with its DDP reducer after the other rank had gone) or abort it.
    Callers first drop what holds the group (DDP models, sharded encoders), so that it is freed while all are here."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def trainable_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient, whole (a collective under FSDP: each rank holds a shard of it)."""
    return {name: _whole(p.grad).clone() for name, p in module.named_parameters() if p.requires_grad}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class SplitBatches:
    """What each worker of an exact-math data-parallel MNRL test is given: the batch's texts by column, dealt over
    ``world_size`` workers once per entry of ``splits`` (rows per worker, in rank order), the model, and a folder to
    meet in and leave results."""

    world_size: int
    model_dir: str
    tmp: str
    splits: list[tuple[int, ...]]
    columns: list[list[str]]

    def join(self, rank: int) -> SentenceEncoder:
        """This worker's process group, and the encoder in float64 (exact math, compared so in the tests)."""
        torch.set_num_threads(1)
        init = f"file://{self.tmp}/rendezvous"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=self.world_size)
        return SentenceEncoder.load(self.model_dir).double()

    @staticmethod
    def shard(rank: int, sizes: tuple[int, ...], columns: list[list]) -> list[list]:
        """This worker's rows of each column: ``sizes[rank]`` of them, after the lower ranks' rows."""
        start = sum(sizes[:rank])
        return [column[start : start + sizes[rank]] for column in columns]


def gathered_mnrl(rank: int, batches: SplitBatches, symmetric: bool = False, dims: list[int] | None = None) -> None:
    """One data-parallel worker: its shard of each batch, gathered loss (under Matryoshka at ``dims``), DDP-style
    gradient reduction. Each worker pads its rows to one more than the largest shard: every worker's real rows are
    fewer than the gather's bound, as a short batch's are in training."""
    encoder = batches.join(rank)
    loss_fn = MultipleNegativesRankingLoss(encoder, symmetric=symmetric)
    if dims:
        loss_fn = MatryoshkaLoss(loss_fn, dims)
    for index, sizes in enumerate(batches.splits):
        shard = batches.shard(rank, sizes, batches.columns)
        loss_fn.expect_rows_per_worker(max(sizes) + 1)
        encoder.zero_grad()
        # Weighting by the shard's share makes the sum over workers the global mean; for equal shards
        # this is exactly DDP's gradient averaging.
        loss = loss_fn([encoder.tokenize(column) for column in shard]) * sizes[rank] / sum(sizes)
        loss.backward()
        dist.all_reduce(loss.detach())
        for param in encoder.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
        if rank == 0:
            torch.save({"loss": loss.detach(), "grads": trainable_grads(encoder)}, f"{batches.tmp}/result{index}.pt")
    leave_group()


def steady_step_syncs(rank: int, batches: SplitBatches, hashes: list[list[int]]) -> None:
    """One worker of an uneven split (``batches.splits[0]``): forward and backward of MNRL, cached MNRL and
    Matryoshka over MNRL on its rows and their texts' hashes, the gather padded to the largest shard as in training
    (cached MNRL's widths from the host, as the collated batch carries them). The host syncs of the second and
    third step (the first may set things up once) go to ``syncs<rank>.pt``."""
    encoder = batches.join(rank)
    sizes = batches.splits[0]
    features = [encoder.tokenize(column) for column in batches.shard(rank, sizes, batches.columns)]
    text_hashes = [torch.tensor(column) for column in batches.shard(rank, sizes, hashes)]
    used_widths = _used_widths([column["attention_mask"] for column in features])
    objectives = {
        "mnrl": MultipleNegativesRankingLoss(encoder),
        "cached_mnrl": CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=2),
        "matryoshka_mnrl": MatryoshkaLoss(MultipleNegativesRankingLoss(encoder), [32, 16]),
    }
    syncs = {}
    for name, objective in objectives.items():
        objective.expect_rows_per_worker(max(sizes))
        counter = SyncCounter()
        for step in range(3):
            with counter if step else nullcontext():
                objective(features, text_hashes=text_hashes, used_widths=used_widths).backward()
        syncs[name] = counter.syncs
    torch.save(syncs, f"{batches.tmp}/syncs{rank}.pt")
    leave_group()


def word_embedding_gradients_both_ways(rank: int, model_dir: str, port: int, out: str, pairs: list[list[str]]) -> None:
    """One DDP backward per way on this rank's pair: word-embedding gradient sparse, then dense."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    grads = {}
    for way in ("sparse", "dense"):
        torch.manual_seed(0)  # the same weights and dropout both ways
        encoder = SentenceEncoder.load(model_dir)
        objective = CosineSimilarityLoss(encoder)
        sparse_embedding_gradients(objective, CPU, world_size=2 if way == "sparse" else 1)
        weight = sparse_gradient_weight(encoder)
        assert (weight is not None) == (way == "sparse")
        model = DistributedDataParallel(objective)
        features = [encoder.tokenize([sentence]) for sentence in pairs[rank]]
        model(features, torch.tensor([0.5 + rank / 4])).backward()
        embeddings = encoder.transformer.get_input_embeddings().weight
        if weight is not None:
            # DDP left it alone: this rank's own rows, not yet the other's
            assert embeddings.grad.is_sparse
            used = {int(token) for feature in features for token in feature["input_ids"].flatten()}
            assert set(embeddings.grad.coalesce().indices()[0].tolist()) == used
            densify(weight)
        grads[way] = embeddings.grad.clone()
    torch.save(grads, f"{out}.{rank}")
    del model, objective, encoder, embeddings
    leave_group()


def ddp_plain_and_cached_mnrl(
    rank: int, world_size: int, model_dir: str, tmp: str, column_sets: dict[bool, list[list[str]]], fsdp: bool = False
) -> None:
    """One DDP worker (``fsdp``: one FSDP worker, its encoder sharded), as the training loop runs it: its shard of
    the batch in two micro-batches, the first without gradient sync (accumulation), each loss divided by the number
    of micro-batches; plain and cached MNRL, without and with hard negatives."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    results = {}
    for with_hard_negatives, columns in column_sets.items():
        shard = [column[rank * 4 : rank * 4 + 4] for column in columns]
        for name in ("plain", "cached"):
            encoder = SentenceEncoder.load(model_dir).double()  # exact math: see test_cached_mnrl.GRAD_TOLERANCE
            if name == "plain":
                objective = MultipleNegativesRankingLoss(encoder)
            else:
                objective = CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=1)
            if fsdp:
                shard_encoder(encoder, keep_meta_copy=False)
            model = objective if fsdp else DistributedDataParallel(objective)
            for micro in range(2):
                features = [encoder.tokenize(column[micro * 2 : micro * 2 + 2]) for column in shard]
                unsynced = gradients_kept_local(encoder) if fsdp else model.no_sync()
                with unsynced if micro == 0 else nullcontext():
                    (model(features) / 2).backward()
            results[(name, with_hard_negatives)] = trainable_grads(encoder)
    if rank == 0:
        torch.save(results, f"{tmp}/grads.pt")
    del model, objective, encoder
    leave_group()


def masked_mnrl(rank: int, batches: SplitBatches, hashes: list[list[int]]) -> None:
    """One data-parallel worker: its shard of the batch with its texts' hashes, plain and cached MNRL with duplicate
    masking on and off; losses (weighted to the global mean), gradients and masked counts summed over workers."""
    encoder = batches.join(rank)
    results = {}
    for split, sizes in enumerate(batches.splits):
        features = [encoder.tokenize(column) for column in batches.shard(rank, sizes, batches.columns)]
        text_hashes = [torch.tensor(column) for column in batches.shard(rank, sizes, hashes)]
        for name, loss_class, settings in [
            ("plain", MultipleNegativesRankingLoss, {}),
            ("cached", CachedMultipleNegativesRankingLoss, {"mini_batch_size": 2}),
        ]:
            for mask in (True, False):
                loss_fn = loss_class(encoder, mask_duplicates=mask, **settings)
                loss_fn.expect_rows_per_worker(max(sizes))  # (4, 2) pads worker 1's rows and hashes
                encoder.zero_grad()
                loss = loss_fn(features, text_hashes=text_hashes) * sizes[rank] / sum(sizes)  # see gathered_mnrl
                loss.backward()
                masked = loss_fn.masked_duplicates if mask else torch.tensor(0)
                for summed in (loss.detach(), masked, *(p.grad for p in encoder.parameters() if p.grad is not None)):
                    dist.all_reduce(summed)
                results[(split, name, mask)] = {
                    "loss": loss.detach(),
                    "masked": masked,
                    "grads": trainable_grads(encoder),
                }
    if rank == 0:
        torch.save(results, f"{batches.tmp}/results.pt")
    leave_group()


# The objectives the uneven-split step is compared on: (objective, its settings, Matryoshka sizes of the tiny BERT).
ELASTIC_OBJECTIVES = {
    "regression": ("regression", {}, None),
    "mnrl": ("mnrl", {}, None),
    "cached_mnrl": ("cached_mnrl", {"mini_batch_size": 2}, None),
    "matryoshka_mnrl": ("mnrl", {}, [32, 16]),
}


def loop_step(
    name: str, model_dir: str, columns: list[list[str]], scores: list[float], batch_size: int, accumulation: int
) -> dict[str, torch.Tensor]:
    """One optimizer step of the training loop (``train_stage``: SGD at lr 1, no clipping, so the update is minus
    the gradient) with objective ``ELASTIC_OBJECTIVES[name]`` on this rank's share of the global batch (the rows of
    ``columns``), dealt as ``training.batches.split_batch`` deals it for an elastic run of up to 4 workers and
    trained as the stream trains it (each share in ``chunks`` micro-batches, ``np.array_split``'s). In float64
    without dropout: the same sums as one process, in another order. Returns the update and the logged loss."""
    # Here, not at the top: the other spawned functions' processes need not import the loop (transformers).
    import time

    import numpy as np

    from sbert_ray.config import StageConfig
    from sbert_ray.losses.registry import OBJECTIVES, build_loss
    from sbert_ray.training.batches import split_batch
    from sbert_ray.training.loop import LocalReporter, MicroBatch, StepSettings, Telemetry, Trainee, train_stage
    from sbert_ray.training.meter import StepMeter
    from sbert_ray.training.optimization import Optimization
    from sbert_ray.training.state import TrainState

    objective_name, settings, dims = ELASTIC_OBJECTIVES[name]
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    encoder = SentenceEncoder.load(model_dir).double()
    for module in encoder.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    objective = build_loss(objective_name, encoder, settings, dims)
    stage = StageConfig(objective=objective_name, batch_size=batch_size, grad_accum_steps=accumulation)
    split = split_batch(stage, 4, world_size, OBJECTIVES[objective_name].in_batch_negatives)
    objective.expect_rows_per_worker(split.largest_micro_batch)  # as training.stages does
    unit, start = batch_size // accumulation, sum(split.shares[:rank])
    batches = []
    for step_unit in range(accumulation):
        share = np.arange(step_unit * unit + start, step_unit * unit + start + split.shares[rank])
        for part in np.array_split(share, split.chunks):
            features = [encoder.tokenize([column[i] for i in part]) for column in columns]
            labels = torch.tensor([scores[i] for i in part], dtype=torch.float64)
            batches.append(MicroBatch(features, labels, len(part), 0, step_unit + 1))
    before = torch.cat([p.detach().flatten().clone() for p in objective.parameters()])
    optimizer = torch.optim.SGD(objective.parameters(), lr=1.0)
    optimization = Optimization(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)
    step = StepSettings(1, accumulation, CPU, batch_size, grad_accum_steps=split.accumulation, max_grad_norm=1e9)
    model = DistributedDataParallel(objective) if world_size > 1 else objective
    reporter = LocalReporter()
    train_stage(
        Trainee(model, optimization), batches, step, TrainState(), Telemetry(reporter, StepMeter(time.time(), CPU))
    )
    update = torch.cat([p.detach().flatten() for p in objective.parameters()]) - before
    return {"update": update, "loss": torch.tensor(reporter.reports[0]["train_loss"]), "shares": split.shares}


def uneven_split_steps(
    rank: int, world_size: int, model_dir: str, tmp: str, columns: list[list[str]], scores: list[float]
) -> None:
    """One data-parallel worker of ``loop_step`` for every objective of ELASTIC_OBJECTIVES (global batch 14 in 2
    micro-batches); rank 0 saves the results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    results = {name: loop_step(name, model_dir, columns, scores, 14, 2) for name in ELASTIC_OBJECTIVES}
    if rank == 0:
        torch.save(results, f"{tmp}/results.pt")
    leave_group()


@dataclass(frozen=True)
class StrategyRun:
    """One run of ``strategy_runs``: its folder's name, whether the encoder is sharded (FSDP) rather than in DDP, the
    checkpoint folder it resumes from, relative to the runs' folder ("": a new run), its resolved precision,
    whether it trains LoRA adapters and its model folder ("": the one ``strategy_runs`` is given)."""

    name: str
    fsdp: bool
    resume: str = ""
    precision: str = "fp32"
    lora: bool = False
    model_dir: str = ""


def strategy_runs(rank: int, world_size: int, tmp: str, model_dir: str, data_dir: str, runs: list[StrategyRun]) -> None:
    """One worker of each 2-stage run (``strategy_config``) in turn, as the Ray Train worker runs it, without Ray:
    encoder and stages from ``training.stages``; rank r streams every world_size-th row of each source (as a Ray
    Data shard would hold its share). Rank 0 writes each report point's checkpoint under ``tmp/<run>/checkpoints``
    and the run's reports to ``tmp/<run>/reports.pt``. One process group for all: each process start costs seconds
    of imports. No run may reduce-scatter on gloo (``sharding.AllReduceThenSlice`` says why): one that does fails."""
    import functools
    import time
    from pathlib import Path

    from sbert_ray.training.loop import LocalReporter
    from sbert_ray.training.meter import StepMeter
    from sbert_ray.training.stage_plan import stage_plans
    from sbert_ray.training.stages import Worker, alone, start_worker, train_stages
    from sbert_ray.training.stream import SourceStream, local_sources

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    dist.reduce_scatter_single = dist.reduce_scatter_tensor = _no_reduce_scatter_on_gloo
    for run in runs:
        config = strategy_config(run.model_dir or model_dir, data_dir, run.lora)
        distribute = alone if run.fsdp else DistributedDataParallel
        worker = Worker(CPU, run.precision, rank, world_size, distribute, shard=run.fsdp)
        started = start_worker(config, worker, Path(tmp, run.resume) if run.resume else None)

        def rank_share(index: int, encoder=started.encoder, config=config) -> list[SourceStream]:
            return [
                SourceStream(source.name, source.rows, source.weight, functools.partial(_every_nth, source, rank))
                for source in local_sources(config, index, encoder)
            ]

        reporter = LocalReporter(Path(tmp, run.name, "checkpoints") if rank == 0 else None)
        train_stages(stage_plans(config), started, rank_share, worker, reporter, StepMeter(time.time(), CPU))
        if rank == 0:
            torch.save(reporter.reports, Path(tmp, run.name, "reports.pt"))
    del started, worker, rank_share, reporter
    leave_group()


def _no_reduce_scatter_on_gloo(*args, **kwargs):
    raise AssertionError("a reduce-scatter on gloo: its name, freed and written by two threads, can crash the process")


def _every_nth(source, rank: int, key: tuple[int, int, int]):
    world_size = dist.get_world_size()
    return (table.take(list(range(rank, table.num_rows, world_size))) for table in source.open_pass(key))


def strategy_config(model_dir: str, data_dir: str, lora: bool = False):
    """Regression on 32 STSb pairs (batch 8 in 2 micro-batches: accumulation), then MNRL on 32 NLI triplets (the
    cross-worker gather), a report every 2 steps (each a full-state checkpoint); planned for 2 workers. ``lora``:
    adapters on peft's default targets for the model (the attention's query and value projections)."""
    from sbert_ray.config import EvalConfig, ModelConfig, ScalingConfig, StageConfig, TrainConfig
    from sbert_ray.models.lora_settings import LoraSettings

    return TrainConfig(
        seed=3,
        data_dir=data_dir,
        model=ModelConfig(name=model_dir, lora=LoraSettings(r=4, alpha=8.0) if lora else None),
        stages=[
            StageConfig(limit=32, batch_size=8, grad_accum_steps=2, learning_rate=1e-3, warmup_ratio=0.0),
            StageConfig(
                dataset="nli-triplets", split="dev", objective="mnrl", limit=32, batch_size=8, learning_rate=1e-3
            ),
        ],
        evaluation=EvalConfig(eval_every=2, final_tasks=[]),
        scaling=ScalingConfig(num_workers=2, torch_threads=1),
    )
