"""Faults and bad input around a run: a password in the tracking URI, an unreachable or failing MLflow server,
reruns of a finished run or of another config under the same name (started twice at once), and a sweep started
from another directory, interrupted (Ctrl-C) and resumed.

Against real `mlflow server`s on 127.0.0.1 running MLflow's basic-auth app, so the password in the URI is really
used (a wrong one is refused), and everything a run writes is searched for it afterwards.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import local_cluster
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import yaml
from cluster_fixtures import (
    complete_resume_points,
    live_placement_groups,
    snapshot_now,
    strike_reports_from,
    train_workers,
    wait_for_registered_checkpoint,
)
from mlflow.tracking import MlflowClient

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, load_config
from sbert_ray.data.readers import load_records
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.runs import record
from sbert_ray.runs.owned_paths import MODEL_MARKER
from sbert_ray.runs.plan import METRICS_SPOOL, absolute_paths, prepare
from sbert_ray.tracking.store import redact, redact_uri

USER, PASSWORD = "sbert", "Pa55-w0rd-never-shown"  # distinctive: any occurrence of it is a leak


def with_password(uri: str) -> str:
    """``http://127.0.0.1:PORT`` as ``http://USER:PASSWORD@127.0.0.1:PORT``."""
    return uri.replace("://", f"://{USER}:{PASSWORD}@", 1)


class AuthServer:
    """An `mlflow server` running MLflow's basic-auth app (requests without the admin's password are refused) that
    a test can stop and start again: same port, same stores."""

    def __init__(self, root: Path):
        self.root, self.port = root, local_cluster.free_port()
        self.uri = with_password(f"http://127.0.0.1:{self.port}")
        self.process = None

    def start(self) -> None:
        settings = {
            "default_permission": "READ",
            "database_uri": f"sqlite:///{self.root / 'auth.db'}",
            "admin_username": USER,
            "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
            # A password checked once is remembered for a while (MLflow's auth cache; off by default): each check
            # is a scrypt hash, 0.33 CPU-s here, and the suite's runs beside it are short of CPU. A wrong password
            # is checked every time.
            "auth_cache_ttl_seconds": 600,
        }
        (self.root / "basic_auth.ini").write_text("[mlflow]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        command = [
            str(local_cluster.BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", "1", "--app-name", "basic-auth",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        env = {
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_AUTH_CONFIG_PATH": str(self.root / "basic_auth.ini"),
            "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD,  # from the environment: no file of the test holds it
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "sbert-ray-tests",
        }
        self.process = local_cluster.start(command, self.root / "server.log", env)
        local_cluster.wait_for_url(f"http://127.0.0.1:{self.port}/health", process=self.process)

    def stop(self) -> None:
        local_cluster.stop(self.process)

    def client(self) -> MlflowClient:
        return MlflowClient(self.uri)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    """Its own server, not the session's: the outage test stops and restarts it."""
    server = AuthServer(tmp_path_factory.mktemp("mlflow-auth"))
    server.start()
    yield server
    server.stop()


def leaks(texts: dict[str, str], roots: list[Path]) -> list[str]:
    """Where the password occurs: among ``texts`` (captured output, params, tags) and the files under ``roots``."""
    found = [f"{name}: {line}" for name, text in texts.items() for line in text.splitlines() if PASSWORD in line]
    for root in roots:
        found += [str(p) for p in root.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    return found


def run_texts(client: MlflowClient, experiment: str, downloads: Path) -> dict[str, str]:
    """Params and tags of every run of ``experiment``, as text; each run's artifacts downloaded under
    ``downloads``."""
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    texts = {}
    for run in client.search_runs([experiment_id]):
        client.download_artifacts(run.info.run_id, "", str(downloads / run.info.run_id))
        texts |= {
            f"run {run.info.run_id} {kind}": json.dumps(v)
            for kind, v in (("params", run.data.params), ("tags", run.data.tags))
        }
    return texts


def ray_logs() -> Path:
    return Path(ray._private.worker._global_node.get_logs_dir_path())


# ------------------------------------------------------------------------------------- masking


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("postgresql://u:p%40ss@db:5432/mlflow", "postgresql://u:***@db:5432/mlflow"),
        ("https://u:PASS@host:8443/x?token=abc&a=1", "https://u:***@host:8443/x?token=***&a=1"),
        ("mysql+pymysql://u:S3@h/db?password=zz", "mysql+pymysql://u:***@h/db?password=***"),
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
        ("http://u@127.0.0.1:5000", "http://u@127.0.0.1:5000"),
        ("https://u:Zq#x9/Kv?w@host:8443", "https://u:***@host:8443"),  # unencoded #, / and ? in the password
    ],
)
def test_redact_uri_masks_passwords_and_secret_query_values(uri, shown):
    assert redact_uri(uri) == shown
    assert redact(f"API request to {uri}/api failed", uri) == f"API request to {shown}/api failed"


# ------------------------------------------------------------------ unreachable store: fails fast


def silent_server() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers (a hung server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize("case", ["refused", "hung", "wrong password"])
def test_unusable_tracking_store_is_refused_in_seconds_with_masked_uri(case, auth_server, tiny_train_config, capsys):
    listener = None
    if case == "refused":
        uri, expected = (
            f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{local_cluster.free_port()}/mlflow",
            "cannot be reached",
        )
    elif case == "hung":
        listener, port = silent_server()
        uri, expected = f"http://{USER}:{PASSWORD}@127.0.0.1:{port}", "does not answer"
    else:
        uri, expected = auth_server.uri.replace(PASSWORD, "not-the-password"), "MLFLOW_TRACKING_PASSWORD"
    config = tiny_train_config(name=f"unusable-{case.replace(' ', '-')}", tracking_uri=uri)
    start = time.monotonic()
    try:
        code = main(["train", str(config)])
    finally:
        if listener is not None:
            listener.close()
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 2 and elapsed < 15, (code, elapsed)
    assert "sbert-ray train: error: tracking.tracking_uri: " in err and expected in err and redact_uri(uri) in err
    assert PASSWORD not in out + err and "not-the-password" not in out + err
    assert not (config.parent / "runs").exists()  # nothing started, nothing left behind


# -------------------------------------------------------- a password URI, and the server going away


def spooled(spool: Path) -> list[dict]:
    """The metrics waiting in rank 0's spool file (its last line may be half written)."""
    metrics = []
    for line in spool.read_text().splitlines() if spool.exists() else []:
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return metrics


def run_of(client: MlflowClient, experiment: str):
    """The one run of ``experiment``, or None before it exists."""
    found = client.get_experiment_by_name(experiment)
    runs = found and client.search_runs([found.experiment_id])
    return runs[0] if runs else None


def test_training_survives_an_mlflow_outage_and_never_shows_the_password(
    local_ray, auth_server, tiny_train_config, capfd
):
    """The server is stopped once rank 0's first steps are logged and started again a little later: training goes on,
    rank 0 keeps its metrics in the run folder meanwhile, and the run ends FINISHED with every logged step. A
    password in the tracking URI appears nowhere: output, logs, run files, checkpoints, model card, MLflow."""
    # 2 epochs of 600 steps (~25 s here): training is still going when the server stops, even on a fast machine. One
    # worker: what is logged, and from where, is rank 0's alone.
    path = tiny_train_config(name="outage", limit=4800, eval_every=100, tracking_uri=auth_server.uri)
    config = yaml.safe_load(path.read_text())
    config["stages"][0]["epochs"] = 2
    config["scaling"]["num_workers"] = 1
    config["tracking"]["experiment"] = "outage"
    config["evaluation"]["final_tasks"] = []
    path.write_text(yaml.safe_dump(config))
    run_dir = Path(config["checkpoint"]["storage_path"]) / "outage"
    outcome: dict = {}
    driver = threading.Thread(target=lambda: outcome.update(code=main(["train", str(path)])))
    driver.start()

    client = auth_server.client()
    deadline = time.time() + 300
    # Until rank 0 has logged its first steps, asked once a second: each request costs the server a password hash
    # (~0.3 CPU-s here), taken from the training beside it.
    run = None
    while not (run := run or run_of(client, "outage")) or not client.get_metric_history(run.info.run_id, "train/loss"):
        assert time.time() < deadline and driver.is_alive(), "training logged no steps"
        time.sleep(1)
    run_id = run.info.run_id
    auth_server.stop()
    down_since = int(time.time() * 1000)
    spool = run_dir / METRICS_SPOOL
    deadline = time.time() + 120
    while not any(  # rank 0 keeps training and buffering (a loss logged after the stop, not one cut off by it)
        m["key"] == "train/loss" and m["timestamp"] >= down_since for m in spooled(spool)
    ):
        assert time.time() < deadline and driver.is_alive(), "no metrics were buffered while the server was down"
        time.sleep(0.2)
    auth_server.start()
    back_since = int(time.time() * 1000)
    driver.join(timeout=300)
    out, err = capfd.readouterr()
    assert outcome.get("code") == 0, err[-3000:]

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    steps = {m.step: m.timestamp for m in client.get_metric_history(run_id, "train/loss")}
    assert sorted(steps) == list(range(10, 2 * 4800 // 8 + 1, 10))  # every step rank 0 logged, none lost
    assert any(down_since <= t <= back_since for t in steps.values())  # logged while the server was down
    assert not spool.exists()  # everything buffered went out
    assert "does not answer" in out + err  # the outage was reported (masked)

    shown = redact_uri(auth_server.uri)
    assert run.data.params["tracking.tracking_uri"] == shown and f"MLflow: {shown}" in out
    downloads = run_dir.parent / "downloaded"
    texts = run_texts(client, "outage", downloads)
    assert shown in (downloads / run_id / "config.yaml").read_text()
    assert shown in (downloads / run_id / "model" / "README.md").read_text()
    found = leaks({"stdout": out, "stderr": err} | texts, [run_dir.parent, auth_server.root, ray_logs()])
    assert found == []


# ------------------------------------------------------------------------------------ sweeps


def trial_statuses(sweep_dir: Path) -> list[str]:
    """Trial statuses as Tune last saved them (what a resumed sweep starts from)."""
    states = sorted(sweep_dir.glob("experiment_state-*.json"))
    if not states:
        return []
    try:
        trials = json.loads(states[-1].read_text())["trial_data"]
    except json.JSONDecodeError:  # caught while Tune rewrites it
        return []
    return [json.loads(trial)["status"] for trial, _ in trials]


def reported_trials(sweep_dir: Path) -> int:
    """Trials that have reported at least once (Tune appends each report to the trial folder's result.json)."""
    return sum(1 for results in sweep_dir.glob("*/result.json") if results.stat().st_size)


def interrupt_after_the_first_trial(sweep: Path, sweep_dir: Path, local_ray: str, log: Path) -> float:
    """``sbert-ray tune sweep`` as a driver of the session's cluster, given Ctrl-C (SIGINT to its process group, as
    a terminal sends it) once its first trial has finished and the second has reported once (it is training);
    the seconds it took to end. Tune saves its state each second and again on Ctrl-C, then stops the running trial."""
    first = subprocess.Popen(
        [sys.executable, "-m", "sbert_ray.cli", "tune", str(sweep)],
        env={**os.environ, "RAY_ADDRESS": local_ray, "TUNE_GLOBAL_CHECKPOINT_S": "1"},
        start_new_session=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 300
        while trial_statuses(sweep_dir) != ["TERMINATED", "RUNNING"] or reported_trials(sweep_dir) < 2:
            assert time.time() < deadline and first.poll() is None, "the second trial did not report"
            time.sleep(0.5)
        os.killpg(first.pid, signal.SIGINT)
        interrupted = time.monotonic()
        assert first.wait(timeout=120) == 130, log.read_text()[-3000:]
        return time.monotonic() - interrupted
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()


def test_interrupted_sweep_from_its_own_directory_frees_its_trial_and_resumes_with_relative_paths(
    local_ray, mlflow_server, tmp_path, data_dir, monkeypatch, capfd
):
    """A sweep config with relative paths (its training file, an evaluation file, output_dir) and a password in its
    tracking URI, run from its folder, given Ctrl-C during its second trial and continued with --resume (one sweep
    for these claims: each sweep costs two Train fits). Ctrl-C ends the sweep within a bound, its running trial's
    Train workers and placement group with it, and leaves nothing that looks finished: no summary, the sweep's and
    the trial's MLflow runs KILLED. Tune runs each trial in the trial's own folder, yet every trial reads the files
    and writes its model to output_dir/<trial id>; the finished trial is not run again, the interrupted one runs to
    the end and the sweep ends with its summary. The password of the tracking URI is in nothing the sweep writes or
    prints."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with (tmp_path / "data" / "pairs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence1", "sentence2", "score"])
        writer.writerows((r.sentence1, r.sentence2, r.score) for r in load_records("stsb", "train", data_dir)[:256])
    with (tmp_path / "data" / "held-out.jsonl").open("w") as f:
        for r in load_records("stsb", "dev", data_dir)[:50]:
            f.write(json.dumps({"sentence1": r.sentence1, "sentence2": r.sentence2, "score": r.score}) + "\n")
    sweep = {
        "name": "relative",
        "scheduler": "fifo",
        "max_concurrent_trials": 1,
        "search_space": {"stages.0.learning_rate": {"grid": [1.0e-4, 3.0e-4]}},
        "base": {
            "data_dir": str(data_dir),
            "output_dir": "models",
            "model": {"name": "random:tiny"},
            "stages": [{"dataset": "data/pairs.csv", "objective": "regression", "batch_size": 8, "epochs": 8}],
            # A report every 32 of the 256 steps (8 epochs of 32: steps are cheap, reports less so): Ctrl-C comes
            # after the second trial's first report, seconds of training before its end. A report at the end of 8
            # steps, then every 2 of 8, then every 4 of 32 left too little of the trial to interrupt: it had finished
            # when Ctrl-C came (CI of abd5ca1; 2026-12-06 with the test cluster's warm workers, twice).
            "evaluation": {
                "dev_limit": 50,
                "eval_every": 32,
                "final_tasks": ["pairs:data/held-out.jsonl"],
                "async_dev": False,
            },
            "scaling": {"num_workers": 1, "cpus_per_worker": 0.5},
            "checkpoint": {"storage_path": "runs", "max_failures": 0},
            "tracking": {"tracking_uri": with_password(mlflow_server), "experiment": "relative-sweep"},
        },
    }
    Path("sweep.yaml").write_text(yaml.safe_dump(sweep))
    sweep_dir = tmp_path / "runs" / "relative"
    interrupted_log = tmp_path / "interrupted-driver.log"
    seconds = interrupt_after_the_first_trial(Path("sweep.yaml"), sweep_dir, local_ray, interrupted_log)
    assert seconds < 90 and "sweep 'relative' interrupted" in interrupted_log.read_text()
    assert "continue it with --resume" in interrupted_log.read_text()
    assert live_placement_groups() == {}
    assert train_workers() == []
    assert not (sweep_dir / "summary").exists()
    client = MlflowClient(mlflow_server)
    experiment_id = client.get_experiment_by_name("relative-sweep").experiment_id
    statuses = sorted(r.info.status for r in client.search_runs([experiment_id]))
    assert statuses == ["FINISHED", "KILLED", "KILLED"]  # the first trial's; the second trial's and the sweep's
    (finished,) = client.search_runs([experiment_id], "attributes.status = 'FINISHED'")

    # A second start never mixes two sweeps; refused before Ray starts.
    assert main(["tune", "sweep.yaml"]) == 2 and "pass --resume" in capfd.readouterr().err
    code = main(["tune", "sweep.yaml", "--resume"])  # from this process
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "(resumed)" in out
    runs = client.search_runs([experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]  # the same parent run, continued
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert all("final/held-out/spearman_cosine" in run.data.metrics for run in children.values())
    again_finished = children.pop(finished.info.run_name)
    assert (again_finished.info.run_id, again_finished.info.end_time) == (finished.info.run_id, finished.info.end_time)
    assert [r.info.status for r in children.values()] == ["FINISHED"]
    assert trial_statuses(sweep_dir) == ["TERMINATED", "TERMINATED"]

    table = list(csv.DictReader((sweep_dir / "summary" / "results.csv").open()))
    assert [row["status"] for row in table] == ["finished", "finished"]
    models = sorted((tmp_path / "models").iterdir())
    assert [m.name for m in models] == sorted(row["trial"] for row in table)  # one model per trial
    for model in models:
        assert SentenceEncoder.load(model).encode(["a sentence"]).shape == (1, 32)
        assert (model / "README.md").exists()
    best = yaml.safe_load((sweep_dir / "summary" / "best_config.yaml").read_text())
    assert best["stages"][0]["dataset"] == str(tmp_path / "data" / "pairs.csv")
    assert best["evaluation"]["final_tasks"] == [f"pairs:{tmp_path / 'data' / 'held-out.jsonl'}"]
    assert best["tracking"]["tracking_uri"] == redact_uri(with_password(mlflow_server))

    texts = run_texts(client, "relative-sweep", tmp_path / "downloaded")
    found = leaks(  # every file the sweep wrote or logged (not our own sweep.yaml)
        {"stdout": out, "stderr": err, "interrupted driver": interrupted_log.read_text()} | texts,
        [tmp_path / "runs", tmp_path / "models", tmp_path / "downloaded", ray_logs()],
    )
    assert found == []


# ------------------------------------------------------------------------------------ reruns


def wait_for_one_to_end(processes: list[subprocess.Popen], timeout: float) -> subprocess.Popen:
    deadline = time.time() + timeout
    while not any(process.poll() is not None for process in processes):
        assert time.time() < deadline, f"none of {len(processes)} processes ended in {timeout} s"
        time.sleep(0.2)
    return next(process for process in processes if process.returncode is not None)


def test_one_of_two_drivers_trains_a_killed_one_resumes_a_finished_one_stays_and_restart_trains_anew(
    local_ray, tiny_train_config, tmp_path, capsys
):
    """One run through its life (three fits for what took four as two tests). ``sbert-ray train`` twice at once, as
    two processes joining the session's cluster, on a fresh MLflow store (its creation is serialised too): one
    trains, the other is refused at once naming the first's host and pid (``runs.run_lease``); the metrics are
    logged once per step. The one that trains is killed mid-run (as a cancelled job), and its newest resume point's
    report struck from Ray Train's record (what a kill between a point's upload and its report leaves): the same
    command continues the same MLflow run from that point and reports it again, so every report point's model is
    ranked. Run again once finished, nothing trains; another config under the same name
    is refused; --restart trains it anew. Its final model goes to output_dir beside someone else's model: --restart
    swaps our own model for the new one (sbert_ray.runs.owned_paths), and the neighbour's files survive every run."""
    output, neighbour = tmp_path / "models" / "mine", tmp_path / "models" / "other-model" / "config.json"
    neighbour.parent.mkdir(parents=True)
    neighbour.write_text("someone else's model")
    # 100 steps, a report (and a resume point) every 20: the kill comes after the first, while 80 steps remain
    # (~0.2 s per 10 steps on a warm cluster: 30 steps were all done before the kill).
    path = tiny_train_config(name="rerun", limit=800, eval_every=20, workers=1)  # no claim here needs two ranks
    settings = yaml.safe_load(path.read_text())
    settings["output_dir"], settings["checkpoint"]["keep_best"] = str(output), 5  # every report point's model kept
    path.write_text(yaml.safe_dump(settings))
    run_dir = path.parent / "runs" / "rerun"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "RAY_ADDRESS": local_ray}
    command = [str(local_cluster.BIN / "sbert-ray"), "train", str(path), "--quiet"]
    logs = [tmp_path / f"driver-{i}.log" for i in range(2)]  # files: a pipe nobody reads would block the trainer
    drivers = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env,
                                start_new_session=True) for log in logs]  # fmt: skip
    try:
        # The refused one ends at once; the other trains on until it is killed.
        ended = wait_for_one_to_end(drivers, timeout=300)
        winner = drivers[1 - drivers.index(ended)]
        refused = logs[drivers.index(ended)].read_text()
        assert ended.returncode == 2 and winner.poll() is None, (ended.returncode, refused[-3000:])
        assert f"sbert-ray train: error: {run_dir} is being trained by another process (host {socket.gethostname()}, " \
               f"pid {winner.pid}, started " in refused  # fmt: skip
        assert "Traceback" not in refused
        wait_for_registered_checkpoint(run_dir, global_step=20)
        deadline = time.time() + 120
        while not complete_resume_points(run_dir):  # a point to resume from (uploaded after Ray took the report)
            assert time.time() < deadline and winner.poll() is None, "no resume point was completed"
            time.sleep(0.2)
    finally:
        for driver in drivers:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    client = MlflowClient(f"sqlite:///{path.parent / 'mlflow.db'}")
    experiment_id = client.get_experiment_by_name("sbert-ray").experiment_id
    (run,) = client.search_runs([experiment_id])
    assert run.info.status == "RUNNING"  # killed without a chance to close it
    steps = [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps and len(steps) == len(set(steps)), steps  # one driver logged them
    # The killed driver's workers outlive it until Ray ends its job, and may complete one more resume point meanwhile
    # (CI of b1da5e9: point 60 after the strike below had read the newest as 40, so nothing re-reported 40).
    deadline = time.time() + 60
    while train_workers():
        assert time.time() < deadline, "the killed run's workers outlived it by a minute"
        time.sleep(0.2)
    strike_reports_from(run_dir, complete_resume_points(run_dir)[-1])  # the newest point's report, and any later

    # The same command, from this process: the same run, continued from its checkpoint.
    assert main(["train", str(path)]) == 0, capsys.readouterr().err[-3000:]
    first = capsys.readouterr().out
    assert "(resumed)" in first
    saved = json.loads((run_dir / record.RECORD_FILE).read_text())
    assert saved["status"] == "finished" and saved["mlflow_run_id"] == run.info.run_id and run.info.run_id in first
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert client.get_metric_history(run.info.run_id, "train/resumed_from_step")[0].value >= 20
    ranked = {c["metrics"]["global_step"]: c["metrics"] for c in snapshot_now(run_dir)["checkpoint_results"]}
    assert ranked.keys() == {20, 40, 60, 80, 100} and all("dev_score" in m for m in ranked.values())
    marker = json.loads((output / MODEL_MARKER).read_text())
    assert (marker["run"], marker["mlflow_run_id"]) == ("rerun", saved["mlflow_run_id"])
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_*"))

    # The same config again: nothing trained, nothing logged, pointers to the finished run.
    assert main(["train", str(path)]) == 0
    again = capsys.readouterr().out
    assert "already finished with this config: nothing to train" in again
    assert f"MLflow run {saved['mlflow_run_id']}" in again and f"model: {output}" in again
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == checkpoints
    assert len(client.search_runs([experiment_id])) == 1

    # Another learning rate under the same name: refused, naming the key, before anything runs.
    assert main(["train", str(path), "stages.0.learning_rate=3e-4", "evaluation.final_tasks=[]"]) == 2
    err = capsys.readouterr().err
    assert "was trained with another config (stages.0.learning_rate: 0.0001 -> 0.0003)" in err
    assert "--restart" in err and "final_tasks" not in err  # evaluation after training is not part of it
    assert len(client.search_runs([experiment_id])) == 1

    # --restart: the old folder is kept aside, the new config trains in a new MLflow run.
    assert main(["train", str(path), "stages.0.learning_rate=3e-4", "evaluation.final_tasks=[]", "--restart"]) == 0
    out = capsys.readouterr().out
    (kept,) = run_dir.parent.glob("rerun.replaced-*")
    assert f"the previous run folder is kept at {kept}" in out
    assert json.loads((kept / record.RECORD_FILE).read_text())["mlflow_run_id"] == saved["mlflow_run_id"]
    runs = {r.info.run_id: r for r in client.search_runs([experiment_id])}
    new_id = json.loads((run_dir / record.RECORD_FILE).read_text())["mlflow_run_id"]
    assert set(runs) == {saved["mlflow_run_id"], new_id}
    assert runs[new_id].info.status == "FINISHED" and runs[new_id].data.params["stages.0.learning_rate"] == "0.0003"
    assert runs[new_id].data.metrics["train/loss"] > 0 and "(resumed)" not in out
    assert json.loads((output / MODEL_MARKER).read_text())["mlflow_run_id"] == new_id
    assert sorted(p.name for p in output.parent.iterdir()) == ["mine", "other-model"]  # no staging, no old model
    assert neighbour.read_text() == "someone else's model"


def test_the_final_model_goes_to_the_run_folder_unless_output_dir_is_set(tiny_train_config):
    path = tiny_train_config(name="placed")
    assert prepare(load_config(path))[0].output_dir == str(path.parent / "runs" / "placed" / "final-model")
    assert prepare(load_config(path, [f"output_dir={path.parent / 'mine'}"]))[0].output_dir == str(path.parent / "mine")


def test_run_record_lives_beside_checkpoints_on_object_storage(s3_server, tiny_train_config, monkeypatch):
    """With s3:// checkpoint storage the record is an object beside the checkpoints: found again, compared, and kept
    aside by --restart (object storage has no folder rename)."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    storage = f"s3://{local_cluster.BUCKET}/records"
    config, _ = absolute_paths(load_config(tiny_train_config(name="remote"), [f"checkpoint.storage_path={storage}"]))
    run_dir, uri = f"{storage}/remote", config.tracking.tracking_uri
    assert record.previous_run(run_dir, config, uri) is None
    record.new_record(config, "run-1", uri).save(run_dir)
    objects = s3_server.client().list_objects_v2(Bucket=local_cluster.BUCKET, Prefix="records/")["Contents"]
    files = [o["Key"] for o in objects if not o["Key"].endswith("/")]  # pyarrow marks folders with empty objects
    assert files == [f"records/remote/{record.RECORD_FILE}"]  # no temporary file left
    assert record.previous_run(run_dir, config, uri).mlflow_run_id == "run-1"

    stage = dataclasses.replace(config.stages[0], learning_rate=3e-4)
    with pytest.raises(ConfigError, match=r"another config \(stages\.0\.learning_rate: 0\.0001 -> 0\.0003\)"):
        record.previous_run(run_dir, dataclasses.replace(config, stages=[stage]), uri)

    kept = record.archive(run_dir)
    assert kept.startswith(f"{run_dir}.replaced-")
    assert record.RunRecord.load(run_dir) is None and record.RunRecord.load(kept).mlflow_run_id == "run-1"


# ------------------------------------------------------------- every command that tracks


@pytest.mark.servers
def test_every_tracking_command_masks_the_password_and_checks_the_store_first(
    auth_server, tiny_model_dir, data_dir, tmp_path, capfd
):
    """eval --mlflow, report, bench encode and bench train with a password in --tracking-uri: they log to the real
    basic-auth server, and the password is in none of their output, files or MLflow runs. A store that does not
    answer is refused before the benchmark runs. (train and tune: the outage and sweep tests above.)"""
    tracks = ["--tracking-uri", auth_server.uri, "--experiment"]
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", "stsb", "--data-dir", str(data_dir),
                 "--mlflow", *tracks, "secrets-eval", "--output", str(tmp_path / "eval.json")]) == 0  # fmt: skip
    eval_out, eval_err = capfd.readouterr()
    eval_run = eval_out.split("MLflow run ")[1].split()[0]
    assert main(["report", "--run", eval_run, "--out", str(tmp_path / "report"), *tracks, "secrets-report"]) == 0
    tiny = ["--model", "random:tiny", "--data-dir", str(data_dir), "--repeats", "1", "--no-reference", "--threads", "1"]
    one_variant = ["--limit", "16", "--batch-sizes", "8", "--precisions", "fp32", "--smart-batching", "on"]
    assert (
        main(["bench", "encode", *tiny, *one_variant, "--output", str(tmp_path / "be.json"), *tracks, "secrets-bench"])
        == 0
    )
    assert main(["bench", "train", *tiny, "--local", "--steps", "2", "--limit", "32", "--batch-size", "8",
                 "--output", str(tmp_path / "bt.json"), *tracks, "secrets-bench"]) == 0  # fmt: skip
    out, err = capfd.readouterr()
    out, err = eval_out + out, eval_err + err
    assert out.count(f"at {redact_uri(auth_server.uri)}") == 3 and f"at {redact_uri(auth_server.uri)}" in err

    start = time.monotonic()  # a store that does not answer: refused before anything is benchmarked
    refused = with_password(f"http://127.0.0.1:{local_cluster.free_port()}")
    assert main(["bench", "encode", *tiny, "--tracking-uri", refused]) == 2 and time.monotonic() - start < 15
    refused_out, refused_err = capfd.readouterr()
    assert "sbert-ray bench: error: --tracking-uri: " in refused_err and "cannot be reached" in refused_err
    assert "variants x" not in refused_out and "sent/s" not in refused_out

    client, texts = auth_server.client(), {"stdout": out + refused_out, "stderr": err + refused_err}
    for experiment in ("secrets-eval", "secrets-report", "secrets-bench"):
        texts |= run_texts(client, experiment, tmp_path / "downloads")
    assert len(client.search_runs([client.get_experiment_by_name("secrets-bench").experiment_id])) == 2
    assert leaks(texts, [tmp_path]) == []


# ------------------------------------------------- bad input as the user meets it: the command, one line


def one_line_error(capsys, command: str) -> str:
    """The command's error, checked to be one line and no traceback; its text after ``error: ``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"sbert-ray {command}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix(f"sbert-ray {command}: error: ")


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("{}\n", [], "the config is empty"),
        (None, ["seed=1", "seed=2"], "override 'seed' is given twice ('seed=1', 'seed=2')"),
        (None, ["model.name=''"], "model.name: empty"),
    ],
    ids=["empty-mapping", "override-twice", "empty-model-name"],
)
def test_configs_that_trained_silently_are_refused(tiny_train_config, text, overrides, message, capsys):
    """`{}` trained every default, a repeated override took the last value, an empty model name loaded the working
    directory: each is now one line naming the file and key."""
    config = tiny_train_config()
    if text is not None:
        config.write_text(text)
    assert main(["train", str(config), *overrides]) == 2
    assert one_line_error(capsys, "train").startswith(f"{config}: {message}")


def test_a_dataset_folder_trains_on_no_file_under_a_hidden_or_underscore_folder(tiny_train_config, tmp_path, capsys):
    """Spark's `_temporary/` task attempts and a `.staging/` copy hold partial and duplicate rows: skipped, as for a
    corpus. Alone they leave no data; beside a shard, a bad file there is never read (the run goes on to the next
    check, here an output_dir that is the run's own folder)."""
    folder, config = tmp_path / "shards", tiny_train_config()
    rows = {"sentence1": ["a", "b"], "sentence2": ["c", "d"], "score": [1.0, 2.0]}
    for hidden in ("_temporary/0/task-1/part-0.parquet", ".staging/part-0.parquet"):
        (folder / hidden).parent.mkdir(parents=True)
        pq.write_table(pa.table({"other": ["no sentence columns"]}), folder / hidden)
    assert main(["train", str(config), f"stages.0.dataset={folder}"]) == 2
    assert one_line_error(capsys, "train") == f"stages.0.dataset: {folder} holds no .csv/.tsv/.jsonl/.parquet files"
    pq.write_table(pa.table(rows), folder / "part-0.parquet")
    run = tmp_path / "runs" / "tiny"
    assert main(["train", str(config), f"stages.0.dataset={folder}", f"output_dir={run}"]) == 2
    assert one_line_error(capsys, "train").startswith(f"output_dir: {run} is this run's folder")


def test_an_output_dir_over_the_run_folder_is_refused_before_training(tiny_train_config, tmp_path, capsys):
    """The run folder, a folder above it or a checkpoint in it as output_dir: refused in preflight (it used to pass,
    train, and then be refused with advice to remove the folder that holds the checkpoints)."""
    config, run = tiny_train_config(), tmp_path / "runs" / "tiny"
    for output_dir, where in [
        (run, "this run's folder or a folder above it"),
        (tmp_path / "runs", "this run's folder or a folder above it"),
        (run / "checkpoint_2026-12-02_06-00-00.000000" / "model", "inside one of this run's checkpoints"),
    ]:
        assert main(["train", str(config), f"output_dir={output_dir}"]) == 2
        error = one_line_error(capsys, "train")
        assert (
            error.startswith(f"output_dir: {output_dir} is {where} ({run} holds the checkpoints")
            and "remove" not in error
        )
    assert not run.exists()  # refused before anything was written there


def test_two_tasks_with_one_entry_name_are_refused_naming_both(tiny_train_config, tmp_path, capsys):
    """Results are keyed by entry: retrieval:v1/scifact and retrieval:v2/scifact (or two pairs: files with one stem)
    would overwrite each other's numbers. Refused before any model, data or Ray work."""
    v1, v2 = tmp_path / "v1" / "scifact", tmp_path / "v2" / "scifact"
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--tasks", f"retrieval:{v1},retrieval:{v2}"]) == 2
    assert one_line_error(capsys, "eval") == (
        f"--tasks: tasks 'retrieval:{v1}' and 'retrieval:{v2}' both give results named 'scifact' (one would "
        "overwrite the other): name each once, or rename a file or folder so that the names differ"
    )
    a, b = tmp_path / "a" / "pairs.tsv", tmp_path / "b" / "pairs.jsonl"
    config = tiny_train_config()
    assert main(["train", str(config), f"evaluation.final_tasks=[stsb, 'pairs:{a}', 'pairs:{b}']"]) == 2
    error = one_line_error(capsys, "train")
    assert f"evaluation.final_tasks: tasks 'pairs:{a}' and 'pairs:{b}' both give results named 'pairs'" in error


def test_a_password_with_unencoded_delimiters_is_one_line_never_shown(tiny_train_config, tmp_path, capsys, caplog):
    """`#`, `/` and `?` in a password end the URI's host part early; urllib then took its start for the port and
    its ValueError quoted it. Now one line, the password masked everywhere, before any work."""
    uri = "http://sbert:Zq#x9/Kv?w@127.0.0.1:5000"
    assert main(["train", str(tiny_train_config()), f"tracking.tracking_uri={uri}"]) == 2
    train_error = one_line_error(capsys, "train")
    assert main(["report", "--run", "abc", "--tracking-uri", uri, "--out", str(tmp_path / "report")]) == 2
    report_error = one_line_error(capsys, "report")
    for error in (train_error, report_error):
        assert "http://sbert:***@127.0.0.1:5000 cannot be read: its password holds a '/', '?' or '#'" in error
    shown = train_error + report_error + capsys.readouterr().out + caplog.text
    assert not [piece for piece in ("Zq", "x9", "Kv", "?w") if piece in shown]


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_a_bad_row_under_train_is_one_line_naming_file_and_line(suffix, local_ray, tiny_train_config, tmp_path, capfd):
    """The row is found by the count on the cluster (a Ray Data task): the command prints our one line, not Ray's
    traceback around it (its RayTaskError is also a DataError, whose message is the remote traceback)."""
    path = tmp_path / f"pairs{suffix}"
    rows = [(f"a man {i} walks", f"a person {i} goes", "2.5") for i in range(30)]
    rows[20] = ("a bad row", "its score", "not-a-number")
    if suffix == ".jsonl":
        keys = ("sentence1", "sentence2", "score")
        path.write_text("".join(json.dumps(dict(zip(keys, row, strict=True))) + "\n" for row in rows))
    else:
        separator = "," if suffix == ".csv" else "\t"
        path.write_text("".join(separator.join(row) + "\n" for row in [("sentence1", "sentence2", "score"), *rows]))
    line = 21 if suffix == ".jsonl" else 22  # after a header line
    capfd.readouterr()
    assert main(["train", str(tiny_train_config()), f"stages.0.dataset={path}"]) == 2
    err = capfd.readouterr().err
    error = f"sbert-ray train: error: stages.0.dataset: {path}, line {line}: unparsable score 'not-a-number'"
    assert err.endswith(error + "\n") and "Traceback" not in err and "Failed to apply" not in err, err
