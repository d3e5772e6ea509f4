"""What a training run remembers about itself: ``<storage_path>/<name>/sbert_ray_run.json``, beside its
checkpoints (a local folder or object storage alike, through pyarrow's filesystems as Ray Train writes them).

A run is found again by its name and checkpoint storage (Ray Train resumes from the latest checkpoint there). The
record says whether that is the same training: the fingerprint of every config key that shapes the trained model,
the MLflow run it logs to, and whether it finished.

- no record: a new run;
- same fingerprint, unfinished: resumed (Ray restores the checkpoint, the same MLflow run continues);
- same fingerprint, finished: nothing is trained; the caller gets the finished run's result back;
- another fingerprint: a ``ConfigError`` naming each key that differs, before Ray or MLflow is touched;
- ``restart``: the old run folder is kept under another name (``<name>.replaced-<time>``) and the run starts anew.

Not fingerprinted, as they do not change what is trained (a resumed run takes their new values; its MLflow params
keep the first ones, and the new config is logged as ``config.yaml``): where data, models and records live
(``data_dir``, ``output_dir``, ``checkpoint.*``), how and where the run is tracked (``tracking.*``), what is scored
besides training and where (``evaluation.before_tasks``, ``final_tasks``, ``first_stage``, ``batch_size``,
``eval_every``, ``async_dev``, ``dev_resources``, ``dev_workers``) and the resources of each worker
(``scaling.cpus_per_worker``, ``gpus_per_worker``, ``torch_threads``) and how long to wait for them
(``scaling.resource_wait_s``). Everything else is: the seed, the model, every stage, the dev set (it decides which
checkpoints are kept), the number of workers and GPU use (data sharding and precision). The fingerprint covers
the config, not the contents of data files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from pyarrow import fs

from sbert_ray.config import ConfigError, TrainConfig, flatten, to_dict
from sbert_ray.runs import owned_paths

RECORD_FILE = "sbert_ray_run.json"
NOT_FINGERPRINTED = (
    "name",
    "data_dir",
    "output_dir",
    "checkpoint.",
    "tracking.",
    "evaluation.before_tasks",
    "evaluation.final_tasks",
    "evaluation.first_stage",
    "evaluation.batch_size",
    "evaluation.eval_every",
    "evaluation.async_dev",
    "evaluation.dev_resources",
    "evaluation.dev_workers",
    "scaling.cpus_per_worker",
    "scaling.gpus_per_worker",
    "scaling.torch_threads",
    "scaling.resource_wait_s",
)


def training_settings(config: TrainConfig) -> dict[str, Any]:
    """The fingerprinted keys of ``config`` (dotted, as MLflow params) and their values."""
    return {k: v for k, v in flatten(to_dict(config)).items() if not k.startswith(NOT_FINGERPRINTED)}


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class RunRecord:
    fingerprint: str
    settings: dict[str, Any]  # training_settings() of the config the run was started with
    mlflow_run_id: str
    tracking_uri: str  # masked
    status: str = "running"  # running | finished | diverged
    started: str = ""
    finished: str = ""
    result: dict[str, Any] | None = None  # the finished run's TrainResult fields (tracking URI masked)
    error: str = ""  # why a diverged run stopped

    @classmethod
    def load(cls, run_dir: str) -> RunRecord | None:
        try:
            data = owned_paths.read_marker(run_dir, RECORD_FILE)
            return None if data is None else cls(**data)
        except (json.JSONDecodeError, TypeError) as err:
            raise ConfigError(
                f"{run_dir}/{RECORD_FILE}: not a run record ({err}); pass --restart to start this run anew"
            ) from None

    def save(self, run_dir: str) -> None:
        """Whole or not at all: a crash leaves the old record or the new one, never half."""
        owned_paths.write_marker(run_dir, RECORD_FILE, dataclasses.asdict(self))


def new_record(config: TrainConfig, mlflow_run_id: str, shown_uri: str) -> RunRecord:
    settings = training_settings(config)
    return RunRecord(fingerprint(settings), settings, mlflow_run_id, shown_uri, started=_now())


def finish(record: RunRecord, result: dict[str, Any], run_dir: str) -> None:
    record.status, record.finished, record.result = "finished", _now(), result
    record.save(run_dir)


def diverged(record: RunRecord, message: str, run_dir: str) -> None:
    """Resuming a run that stopped on a NaN/inf loss would replay the same steps into the same NaN: its record
    says so, and the next start with this config is refused."""
    record.status, record.error = "diverged", message
    record.save(run_dir)


def previous_run(run_dir: str, config: TrainConfig, shown_uri: str, restart: bool = False) -> RunRecord | None:
    """The record of the run at ``run_dir`` when ``config`` continues it (or finished it); None for a new run.
    Raises ``ConfigError`` when another config ran under this name, or (unfinished) logged to another store."""
    record = RunRecord.load(run_dir)
    if restart:
        return record
    if record is None:
        if _has_checkpoints(run_dir):
            raise ConfigError(
                f"{run_dir} holds checkpoints of a run without a record of its config (an earlier sbert-ray): "
                "pass --restart to train anew (the folder is kept), or choose another name"
            )
        return None
    if record.status == "diverged":
        raise ConfigError(
            f"run {config.name!r} at {run_dir} diverged ({record.error}); resuming would diverge again: change "
            "the config (e.g. a lower learning rate) and pass --restart (the old run folder is kept), or choose "
            "another name"
        )
    settings = training_settings(config)
    if fingerprint(settings) != record.fingerprint:
        changes = "; ".join(changed_keys(record.settings, settings))
        raise ConfigError(
            f"run {config.name!r} at {run_dir} was {'trained' if record.status == 'finished' else 'started'} with "
            f"another config ({changes}): run it with its own config to "
            f"{'see it' if record.status == 'finished' else 'resume it'}, pass --restart to train anew (the old "
            "run folder is kept), or choose another name"
        )
    if record.status != "finished" and record.tracking_uri != shown_uri:
        raise ConfigError(
            f"tracking.tracking_uri: run {config.name!r} at {run_dir} logs to MLflow at {record.tracking_uri}, not "
            f"{shown_uri}: resume it with that tracking store, or pass --restart to train anew"
        )
    return record


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """["stages.0.learning_rate: 2e-05 -> 3e-05", "stages.1.dataset: (none) -> nli", ...]"""
    missing = "(none)"
    return [
        f"{key}: {old.get(key, missing)!r} -> {new.get(key, missing)!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, missing) != new.get(key, missing)
    ]


def _has_checkpoints(run_dir: str) -> bool:
    return any(name.startswith("checkpoint_") for name in _entry_names(run_dir))


def _entry_names(run_dir: str) -> set[str]:
    filesystem, path = fs.FileSystem.from_uri(run_dir)
    return {entry.base_name for entry in filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))}


def _is_run_folder(run_dir: str) -> bool:
    """Ours to move: a folder with our run record or Ray Train checkpoints (a run of an earlier sbert-ray), or an
    empty one. A file or any other folder is not."""
    filesystem, path = fs.FileSystem.from_uri(run_dir)
    if filesystem.get_file_info(path).type != fs.FileType.Directory:
        return False
    names = _entry_names(run_dir)
    return not names or RECORD_FILE in names or _has_checkpoints(run_dir)


def archive(run_dir: str) -> str | None:
    """Move the run folder aside (``<name>.replaced-<UTC time>``) so a restarted run begins empty; the old
    checkpoints, final model (when inside it) and record stay there. Object storage has no folder rename: the
    files are copied, then deleted. Raises ``ConfigError`` for a folder that is not a run (``owned_paths``)."""
    owned_paths.refuse_protected(run_dir, "checkpoint.storage_path")
    filesystem, path = fs.FileSystem.from_uri(run_dir)
    if filesystem.get_file_info(path).type == fs.FileType.NotFound:
        return None
    if not _is_run_folder(run_dir):
        raise ConfigError(
            f"--restart: {run_dir} is not a run folder of sbert-ray (no {RECORD_FILE}, no checkpoints), so it is "
            "not moved aside: choose another name, or move the folder yourself"
        )
    suffix = f".replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if isinstance(filesystem, fs.LocalFileSystem):
        filesystem.move(path, path + suffix)
    else:
        fs.copy_files(path, path + suffix, source_filesystem=filesystem, destination_filesystem=filesystem)
        filesystem.delete_dir(path)
    return run_dir + suffix


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
