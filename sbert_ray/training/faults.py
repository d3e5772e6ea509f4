"""Which errors on a training worker end the run at once and which restart it.

A restart replays the run from its latest checkpoint: that heals an infrastructure fault (a worker, node or actor
that died; a network, storage or GCS error) but meets a deterministic one again at the same point, without end
under ``checkpoint.max_failures: -1``. Deterministic here: bad input (a file's bad row, a config or model error
found on a worker: ``DataError``, ``ConfigError`` and any other ``ValueError`` or ``TypeError``) and running out
of device memory. The worker turns those into ``DeterministicError`` (``deterministic_error``), one line naming
what is wrong; ``EndOnDeterministicError``, a callback on Ray Train's controller, ends the run when a worker
raised one. A NaN loss is not raised at all: the workers return it (``training.loop.Diverged``).

Why a controller callback: Ray Train 2.60's failure policy (``DefaultFailurePolicy``, built from ``FailureConfig``
alone) retries every worker error up to ``max_failures`` and offers no hook to decide otherwise, but an error
raised by a ``UserCallback`` is a controller error it does not retry. The worker raises (rather than returning
the error, as ``Diverged`` does) because a rank that fails alone, mid-step, leaves the others waiting in a
collective: only Ray stopping the group frees them, and it stops the group on any worker error.

Ray Train's controller imports this module to unpickle the callback and the errors: no torch at module level.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import ray.exceptions
import ray.train

from sbert_ray.config import TrainConfig

# The errors whose replay fails the same way (a pyarrow ArrowInvalid of a corrupt file is a ValueError too); an
# OSError (network, storage), a RayError (a dead actor or node) or a RuntimeError (torch.distributed) restarts.
DETERMINISTIC = (ValueError, TypeError)
T = TypeVar("T")


class DeterministicError(RuntimeError):
    """A worker's error that a restart would meet again; ``bad_input``: the user's data or config is at fault."""

    def __init__(self, message: str, bad_input: bool = True):
        super().__init__(message)
        self.bad_input = bad_input

    def __reduce__(self):  # through Ray's pickling with both arguments
        return type(self), (str(self), self.bad_input)


class WorkerFaults:
    """Around a worker's training: an error a restart would meet again leaves as a ``DeterministicError``; others
    as they are. ``opened`` wraps the stage data callable to know the stage training now."""

    def __init__(self, config: TrainConfig):
        self.config, self.stage = config, 0

    def opened(self, stage_data: Callable[[int], T]) -> Callable[[int], T]:
        def open_stage(index: int) -> T:
            self.stage = index
            return stage_data(index)

        return open_stage

    def __enter__(self) -> WorkerFaults:
        return self

    def __exit__(self, exc_type, error, traceback) -> None:
        fault = None if error is None else deterministic_error(error, self.config, self.stage)
        if fault is not None:
            raise fault from error


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it wraps: a Ray task's error holds the remote one in ``cause``, Python's in ``__cause__``
    (a Ray task's error is also an instance of its cause's class, with Ray's traceback as its message)."""
    seen: BaseException | None = error
    while seen is not None:
        yield seen
        seen = getattr(seen, "cause", None) or seen.__cause__


def deterministic_error(error: BaseException, config: TrainConfig, stage: int) -> DeterministicError | None:
    """``error`` as a one-line ``DeterministicError`` when a restart would meet it again, else None; ``stage``:
    the stage the worker was training (its batch size goes into an out-of-memory error's hint)."""
    for cause in causes(error):
        if _is_out_of_memory(cause):
            return DeterministicError(out_of_memory_message(config, stage), bad_input=False)
        if isinstance(cause, DETERMINISTIC) and not isinstance(cause, ray.exceptions.RayError):
            # Ray Data appends its retry advice to a task error's message as further lines; ours is the first.
            return DeterministicError(str(cause).partition("\n")[0] or type(cause).__name__)
    return None


def _is_out_of_memory(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # only a worker that trains has it, and only there can memory run out
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def out_of_memory_message(config: TrainConfig, stage: int) -> str:
    """What ran out and what to change: the global batch, each worker's micro-batch and the sequence width."""
    settings = config.stages[stage]
    workers = config.scaling.max_workers
    micro = settings.batch_size // (workers * settings.grad_accum_steps)
    return (
        f"out of device memory in stage {stage}: stages.{stage}.batch_size {settings.batch_size} on {workers} "
        f"worker(s) is {micro} examples per micro-batch, each of up to model.max_seq_length "
        f"{config.model.max_seq_length} tokens; raise stages.{stage}.grad_accum_steps (same global batch, smaller "
        f"micro-batches), lower model.max_seq_length, or use objective cached_mnrl"
    )


class EndOnDeterministicError(ray.train.UserCallback):
    """On Ray Train's controller: a worker's ``DeterministicError`` ends the run (raised here, the failure policy
    does not retry it) whatever ``max_failures`` says; any other worker error goes on to the policy."""

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for rank in sorted(worker_exceptions):
            if isinstance(worker_exceptions[rank], DeterministicError):
                raise worker_exceptions[rank]


def raised_on_a_worker(error: ray.train.TrainingFailedError) -> DeterministicError | None:
    """The ``DeterministicError`` that ended a ``fit()`` (Ray raises it as a ``ControllerError``), else None."""
    failure = getattr(error, "controller_failure", None)
    return failure if isinstance(failure, DeterministicError) else None
