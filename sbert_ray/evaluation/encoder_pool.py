"""Encoding for evaluation spread over Ray actors (CPU cores, GPUs or cluster nodes): ``--workers N``.

``RayEncoder`` has the encoder's ``encode`` signature, so every evaluator uses it unchanged; ``map_unordered`` runs
work that encodes and then reduces on the workers (a retrieval corpus chunk searched for each query's top k, whose
embeddings never leave the worker); ``score`` runs a teacher (a reranker) that the actors hold beside the encoder
(``sbert-ray mine --rescore-with``: on the same CPUs or GPU, which the two models take in turn). Embeddings are the
same as a single process computes: the sentences are ordered exactly as ``SentenceEncoder.encode`` orders them
(token count, longest first, stable), cut into the same batches, and whole batches are dealt round-robin to the
workers. Each worker's share is then already in encode's order, so it forms the very same padded batches.

Batch embedding of a corpus (``sbert-ray encode``, ``sbert_ray.runs.encode_corpus``) runs the same
``EncoderReplica`` in a Ray Data actor pool. Evaluation keeps actors of its own: its numbers must equal one
process's bit for bit, which needs batches cut from one global length order (Ray Data orders sentences within each
block), and an evaluation encodes many small sets in turn, which long-lived actors serve without loading the model
again for each set.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group

from sbert_ray.models.encoder import SentenceEncoder, smart_batches
from sbert_ray.models.load import one_tokenizer_thread
from sbert_ray.ray_compat import connect_ray
from sbert_ray.reservations import in_bundle, reserve, resources_text

if TYPE_CHECKING:
    from sbert_ray.models.teachers import Teacher

T = TypeVar("T")
IN_FLIGHT = 2  # items queued per worker in map_unordered: one running, one ready to start
BATCHES_PER_PIECE = 16  # a teacher scores pairs in pieces of this many batches, spread over the workers
COMMAND_KEYS = ("--workers", "--resource-wait-s")  # what sets a command's replicas and bounds its wait for them


class EncoderReplica:
    """One copy of an encoder on a Ray actor's device (its GPU, or ``threads`` CPU threads): what the actors of
    ``RayEncoder`` and of batch embedding (``sbert_ray.runs.encode_corpus``) hold. ``encoder`` may be a reference to a
    CPU copy in the object store, which every actor on a node reads once. ``teacher``: a ``models.teachers``
    teacher on the CPU (Ray hands the actor the value of a reference in the object store), moved onto the same
    device, for ``score``."""

    def __init__(
        self, encoder: SentenceEncoder | ray.ObjectRef, device: str, threads: int, teacher: Teacher | None = None
    ):
        torch.set_num_threads(threads)
        encoder = ray.get(encoder) if isinstance(encoder, ray.ObjectRef) else encoder
        # Re-cast on the worker's own device: "bf16" weights become float16 on GPUs without bfloat16.
        self.encoder = encoder.to(device).to_precision(encoder.precision)
        if teacher is not None:
            one_tokenizer_thread()  # as sbert-ray score's actors: the teacher tokenises its pairs here
        self.teacher = None if teacher is None else teacher.to(device)

    def encode(
        self, sentences: list[str], batch_size: int, prompt: str | None = None, max_tokens: int | None = None
    ) -> np.ndarray:
        return self.encoder.encode(
            sentences, batch_size=batch_size, convert_to="numpy", prompt=prompt, max_tokens=max_tokens
        )

    def apply(self, function: Callable[..., T], *args) -> T:
        """``function(encoder, *args)`` on this worker: work that encodes and then reduces what it encoded (a
        corpus chunk searched for each query's top k) sends back only the reduction."""
        return function(self.encoder, *args)

    def score(self, queries: list[str], texts: list[str], batch_size: int, start: int) -> tuple[np.ndarray, int]:
        """The teacher's score of each (query, text) pair (``Teacher.score``, as ``sbert-ray score`` calls it), and
        ``start``: where the pairs begin in the caller's list."""
        return self.teacher.score(queries, [texts], batch_size)[0], start

    def encode_token_ids(self, ids: dict[str, list[list[int]]], batch_size: int, prompt_length: int = 0) -> np.ndarray:
        return self.encoder.encode_token_ids(
            ids, batch_size=batch_size, convert_to="numpy", prompt_length=prompt_length
        )


def replica_resources(use_gpu: bool, cpus: float = 1) -> dict[str, float]:
    """What each encoder replica (``--workers`` of encode, eval and mine) asks Ray for: CPUs, and a GPU on cuda."""
    return {"CPU": cpus, "GPU": 1 if use_gpu else 0}


def reserve_replicas(
    replica: dict[str, float], workers: int, wait_s: float, keys: tuple[str, str] = COMMAND_KEYS
) -> PlacementGroup:
    """A placement group of ``workers`` replicas' resources, within ``wait_s`` seconds, else ``ResourcesBusy`` naming
    what is missing and ``keys`` (the option or config key setting the count, and the one bounding the wait): Ray
    would wait for ever, and the command hang silently. PACK: on one node where they fit, else spread over nodes."""
    asked = {key: need for key, need in replica.items() if need}  # "1 CPU", not "1 CPU, 0 GPU"
    what = f"{keys[0]} {workers} encoder replicas of {resources_text(asked)}"
    return reserve([replica] * workers, "PACK", wait_s, what, keys[1])


def shareable(encoder: SentenceEncoder) -> ray.ObjectRef:
    """A CPU copy of ``encoder`` in the object store for actors to load onto their own device; the caller's
    encoder stays where it is."""
    return ray.put(encoder if encoder.device.type == "cpu" else copy.deepcopy(encoder).cpu())


class RayEncoder:
    """Drop-in for ``SentenceEncoder.encode`` that runs on ``num_workers`` Ray actors (one GPU each with
    ``use_gpu``; or each on ``replica``'s resources, a GPU share among them), started in a placement group reserved
    for them within ``resource_wait_s`` (else ``ResourcesBusy`` naming what is missing and ``keys``: the commands'
    ``--workers`` and ``--resource-wait-s`` by default). With a ``teacher`` (``models.teachers``) each actor holds
    it too, for ``score``. Use as a context manager, or call ``close()``, to release the actors and their
    resources."""

    def __init__(
        self,
        encoder: SentenceEncoder,
        num_workers: int,
        use_gpu: bool = False,
        cpus_per_worker: int = 1,
        resource_wait_s: float = 600.0,
        replica: dict[str, float] | None = None,
        keys: tuple[str, str] = COMMAND_KEYS,
        teacher: Teacher | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        connect_ray()  # as every driver: RAY_ADDRESS's cluster, else a fresh local one on 127.0.0.1
        self.encoder = encoder  # kept for tokenisation (the batch order) and its attributes
        self.teacher = teacher
        bundle = {"GPU": 0, **(replica or replica_resources(use_gpu, cpus_per_worker))}
        self.group = reserve_replicas(bundle, num_workers, resource_wait_s, keys)
        shared = shareable(encoder)
        shared_teacher = None if teacher is None else ray.put(teacher)  # loaded on the CPU (load_teacher)
        actor = ray.remote(EncoderReplica)
        device, threads = "cuda" if bundle["GPU"] else "cpu", max(1, math.ceil(bundle["CPU"]))
        self.workers = [
            actor.options(num_cpus=bundle["CPU"], num_gpus=bundle["GPU"], **in_bundle(self.group, i)).remote(
                shared, device, threads, shared_teacher
            )
            for i in range(num_workers)
        ]

    @property
    def prompts(self) -> dict[str, str]:
        return self.encoder.prompts

    def batches(self, sentences: Sequence[str], batch_size: int, prompt: str = "") -> tuple[list[list[int]], int]:
        """Index batches in the order ``SentenceEncoder.encode`` would form them (with ``prompt`` before each), and
        the token budget they were cut by, which the workers cut their shares by (their own default would follow
        the share's size, not the whole input's)."""
        ids = self.encoder.token_ids([prompt + sentence for sentence in sentences])["input_ids"]
        lengths = [len(row) for row in ids]
        budget = self.encoder.token_budget(batch_size, lengths)
        return smart_batches(lengths, batch_size, budget), budget

    def encode(
        self, sentences: Sequence[str], batch_size: int = 32, convert_to: str = "numpy", prompt_name: str | None = None
    ) -> np.ndarray:
        if convert_to != "numpy":
            raise ValueError("RayEncoder.encode returns numpy arrays only")
        prompt = self.encoder.resolve_prompt(prompt_name=prompt_name)  # the workers get the text, resolved once
        out = np.empty((len(sentences), self.encoder.output_dim), dtype=np.float32)
        batches, budget = self.batches(sentences, batch_size, prompt)
        shares = [[i for batch in batches[w :: len(self.workers)] for i in batch] for w in range(len(self.workers))]
        futures = [
            worker.encode.remote([sentences[i] for i in share], batch_size, prompt, budget)
            for worker, share in zip(self.workers, shares, strict=True)
        ]
        for share, embeddings in zip(shares, ray.get(futures), strict=True):
            out[share] = embeddings
        return out

    def map_unordered(self, function: Callable[..., T], items: Iterable[tuple], *shared) -> Iterator[T]:
        """``function(encoder, *item, *shared)`` for each item, on the workers, yielded as they finish (in any
        order). ``shared`` goes to the object store once; each worker has at most IN_FLIGHT items queued, so what
        waits here for the caller stays bounded whatever the number of items."""
        shared = [ray.put(value) for value in shared]
        yield from self._spread(lambda worker, item: worker.apply.remote(function, *item, *shared), items)

    def score(self, queries: Sequence[str], texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """The teacher's score of each (query, text) pair, in pieces of BATCHES_PER_PIECE batches scored on the
        workers. A piece's pairs are batched as one ``Teacher.score`` call of them batches them (a cross-encoder
        sorts its pairs by length), so a score may differ from one call over all pairs in the last bits (float32:
        ~1e-7), as another batch size would make it differ."""
        if self.teacher is None:
            raise ValueError("this RayEncoder was started without a teacher")
        piece = batch_size * BATCHES_PER_PIECE
        pieces = (
            (list(queries[start : start + piece]), list(texts[start : start + piece]), batch_size, start)
            for start in range(0, len(queries), piece)
        )
        out = np.empty(len(queries), dtype=np.float32)
        for scores, start in self._spread(lambda worker, item: worker.score.remote(*item), pieces):
            out[start : start + len(scores)] = scores
        return out

    def _spread(self, submit: Callable[[ray.actor.ActorHandle, tuple], ray.ObjectRef], items: Iterable[tuple]):
        """``submit(worker, item)`` for each item, each worker given at most IN_FLIGHT at a time; the results as
        they finish."""
        pending, idle = {}, [w for w in self.workers for _ in range(IN_FLIGHT)]
        for item in items:
            if not idle:
                yield from self._next_done(pending, idle)
            worker = idle.pop()
            pending[submit(worker, item)] = worker
        while pending:
            yield from self._next_done(pending, idle)

    @staticmethod
    def _next_done(pending: dict, idle: list) -> Iterator:
        [done], _ = ray.wait(list(pending), num_returns=1)
        idle.append(pending.pop(done))
        yield ray.get(done)

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def __enter__(self) -> RayEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
