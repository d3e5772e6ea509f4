"""Checkpoint on preemption: a spot node's termination notice reaches the training processes as SIGTERM (a KubeRay
pod's grace period, a cloud's spot notice forwarded to the processes); Ray's own handler would end the worker at
once, losing every step since the last report point. Here a SIGTERM only asks the worker to stop: the loop's next
loss read (at most ``training.loop.LOG_EVERY`` steps on, the same steps on every rank) tells every rank, all of them
report a full-state checkpoint at that step, wait for it to be registered, and fail with ``Stopped``; Ray Train
restarts them from that checkpoint (``checkpoint.max_failures``) or a resubmitted job resumes there.

A worker that reaches no step boundary within ``GRACE_S`` of the notice (stuck at a stage's start, waiting for
data) ends as Ray's handler would; so does a second SIGTERM. Ray stopping a worker group (a run's end, a restart)
sends SIGTERM too and SIGKILL 5 s later (``RAY_kill_worker_timeout_milliseconds``): a worker still training then
trains on until the SIGKILL, which Ray Train's controller does not wait for (it kills, then moves on).

Python sets signal handlers only on a process's main thread, and Ray Train runs the training function on another
one; the handler is installed through the worker actor itself (``RayTrainWorker.execute``, which its main thread
runs). Ray Train 2.60 also tells of node drains (``ray.train.get_preemption_info()``, a barrier across the workers
at each call) where an autoscaler drains a node before it goes; that is not wired here: on a drain Ray Train waits
for the node to go and restarts the workers itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import ray

from sbert_ray.ray_compat import run_on_train_worker_main_thread
from sbert_ray.training.loop import never

log = logging.getLogger(__name__)

GRACE_S = 60.0  # a notice's grace: k8s' default is 30 s before SIGKILL, a spot VM's 30 s to 2 min
_asked_to_stop = threading.Event()  # set by the handler (main thread), read by the training thread


def watch_sigterm() -> Callable[[], bool]:
    """Install the handler in this Ray Train worker; returns whether a SIGTERM asked it to stop (``Worker
    .stop_requested``). Where the actor cannot run it (not a Ray Train worker), SIGTERM stays Ray's."""
    try:
        run_on_train_worker_main_thread(install_handler)
    except (AttributeError, RuntimeError, ray.exceptions.RayError) as err:
        log.warning("no checkpoint on SIGTERM in this worker (%s): a preemption loses the steps since the last", err)
        return never
    return _asked_to_stop.is_set


def install_handler() -> None:
    """On the main thread: a first SIGTERM asks the training to stop; a second one, or ``GRACE_S`` later, is
    handed to the handler it replaced (Ray's, which ends the worker)."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        if _asked_to_stop.is_set():
            signal.signal(signal.SIGTERM, previous)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _asked_to_stop.set()
        # Ray stopping its workers sends SIGTERM too (then SIGKILL 5 s on): training goes on until either comes.
        log.warning(
            "SIGTERM (a preemption notice, or Ray stopping this worker): a full-state checkpoint at the next "
            "loss read, then stop (within %.0f s)",
            GRACE_S,
        )
        timer = threading.Timer(GRACE_S, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)
