"""Free the placement groups that stopped sweep trials leave behind.

Each trial fits its own ``TorchTrainer``: the trial's actor owns a Train controller actor, which reserves the
workers' resources in a placement group. Ray keeps a placement group until both its creator actor and its job
have ended (ray-project/ray#54305), so when Tune stops a trial (ASHA) and kills its actor, the controller dies
with it and its group stays reserved for as long as the sweep's driver runs; the next trials then wait for
resources that never come back.

Ray Train 2.60 starts a ``PlacementGroupCleaner`` actor to remove such groups, but it asks the state API about
the controller without an address: it finds the cluster from RAY_ADDRESS (not set in Ray's worker processes),
else the machine's "latest cluster" file ``/tmp/ray/ray_current_cluster``, which the last ``ray start`` wrote and
which a head stopped any other way than ``ray stop`` leaves behind. With a stale file its first check raises
``RpcError: Timed out while waiting for GCS to become available``, which ends its monitor thread: nothing is
ever cleaned. It also needs the dashboard, which ``include_dashboard=False`` clusters lack. So the sweep removes
these groups itself: a group is left behind when the actor that created it is dead while the job lives on.
"""

from __future__ import annotations

import logging
import time

from ray import tune
from ray.util.placement_group import remove_placement_group

from sbert_ray.ray_compat import actor_created_placement_groups

logger = logging.getLogger(__name__)


def remove_orphaned_placement_groups() -> int:
    """Remove this job's placement groups whose creator actor has died; returns how many were removed."""
    orphans = [held.group for held in actor_created_placement_groups() if held.creator_dead]
    for group in orphans:
        remove_placement_group(group)
    if orphans:
        logger.info("removed %d placement group(s) left by stopped trials", len(orphans))
    return len(orphans)


def release_trial_placement_groups(timeout_s: float = 60.0) -> None:
    """After the sweep: wait until no trial's Train placement group is left, removing each one as its controller
    dies (a stopped trial's controller dies shortly after the trial's actor). Warns if some are still held."""
    deadline = time.monotonic() + timeout_s
    while True:
        remove_orphaned_placement_groups()
        held = actor_created_placement_groups()
        if not held:
            return
        if time.monotonic() > deadline:
            ids = ", ".join(record.group.id.hex() for record in held)
            logger.warning("placement groups still held by live actors after the sweep: %s", ids)
            return
        time.sleep(0.5)


class RemoveOrphanedPlacementGroups(tune.Callback):
    """Tune callback: every few seconds of the sweep's loop, free what stopped trials left reserved."""

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self._last = 0.0

    def on_step_begin(self, iteration: int, trials: list, **info) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            remove_orphaned_placement_groups()
