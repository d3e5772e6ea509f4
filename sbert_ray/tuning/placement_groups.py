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

import ray
import ray._private.state
from ray import tune
from ray.core.generated import gcs_pb2
from ray.util.placement_group import PlacementGroup, remove_placement_group

logger = logging.getLogger(__name__)

REMOVED = gcs_pb2.PlacementGroupTableData.REMOVED


def _actor_created_groups() -> list[gcs_pb2.PlacementGroupTableData]:
    """This job's live, non-detached placement groups that an actor (not the driver) created. Ray's public
    ``placement_group_table()`` leaves out who created a group, so this reads the GCS records themselves."""
    job_id = ray.get_runtime_context().get_job_id()
    records = (
        gcs_pb2.PlacementGroupTableData.FromString(raw)
        for raw in ray._private.state.state._connect_and_get_accessor().get_placement_group_table()
    )
    return [
        record
        for record in records
        if record.state != REMOVED
        and not record.is_detached
        and record.creator_job_id.hex() == job_id
        and record.creator_actor_id
        and not ray.ActorID(record.creator_actor_id).is_nil()
    ]


def remove_orphaned_placement_groups() -> int:
    """Remove this job's placement groups whose creator actor has died; returns how many were removed."""
    orphans = [record for record in _actor_created_groups() if record.creator_actor_dead]
    for record in orphans:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(record.placement_group_id)))
    if orphans:
        logger.info("removed %d placement group(s) left by stopped trials", len(orphans))
    return len(orphans)


def release_trial_placement_groups(timeout_s: float = 60.0) -> None:
    """After the sweep: wait until no trial's Train placement group is left, removing each one as its controller
    dies (a stopped trial's controller dies shortly after the trial's actor). Warns if some are still held."""
    deadline = time.monotonic() + timeout_s
    while True:
        remove_orphaned_placement_groups()
        held = _actor_created_groups()
        if not held:
            return
        if time.monotonic() > deadline:
            ids = ", ".join(record.placement_group_id.hex() for record in held)
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
