#!/usr/bin/env python
"""A multi-node Ray cluster on this machine, with the real servers a cloud cluster has:

* an S3-compatible object store (moto's server, a separate process) on 127.0.0.1 with the bucket ``sbert-ray``;
* an ``mlflow server`` (SQLite) whose artifacts go to ``s3://sbert-ray/mlflow``;
* a token-authenticated Ray head, started with README's own commands ("Submitting to a running cluster");
* a second Ray node (``ray start --address ...``) with its own CPUs.

    python scripts/local_cluster.py [--dir DIR] [--head-cpus 2] [--node-cpus 1]

It prints the environment to submit jobs with (jobs write checkpoints to ``checkpoint.storage_path:
s3://sbert-ray/runs``) and stops everything on Ctrl-C. tests/cluster_fixtures.py starts the same pieces.
Every Ray process gets its own HOME (the token lives in ``$HOME/.ray/auth_token``) and RAY_TMPDIR, so nothing
here reads or writes ``~/.ray`` or ``/tmp/ray``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment's own ray / mlflow / moto_server
BUCKET = "sbert-ray"
RECIPE_HEADING = "### Submitting to a running cluster"
# moto accepts any credentials; these are what every client and server here signs with.
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "sbert-ray",
    "AWS_SECRET_ACCESS_KEY": "sbert-ray",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Ray Train's PlacementGroupCleaner asks the state API whether its controller still lives. A test cluster has no
# dashboard, and several clusters run on this machine, so the lookup would go to whichever one Ray finds first and
# hang until it times out (12 s added to the end of every fit). Pointed at a closed port, it fails at once.
NO_STATE_API = {"RAY_API_SERVER_ADDRESS": "http://127.0.0.1:9"}
# The tests' local cluster runs many short fits of one driver after another on 2 CPUs. Ray keeps no more idle worker
# processes than CPUs and ends an idle one after 1 s, so each fit's Ray Data and evaluation tasks start processes
# anew, each importing torch and transformers; kept warm, the next fit of the same driver reuses them (2026-12-06,
# a tiny 2-worker fit: ~50 CPU-s -> ~32, scripts/fit_cpu.py; docs/testing.md).
WARM_WORKERS = {"RAY_num_workers_soft_limit": "8", "RAY_idle_worker_killing_time_threshold_ms": "600000"}
# Ray Train 2.60 starts a PreemptionWatcher actor per worker group: it polls for node drains and tells the workers,
# for ray.train.get_preemption_info(), which sbert-ray does not call (sbert_ray/training/preemption.py). The local
# cluster's fits go without it: a process less per fit, and an idle worker less to start in its place (~3 CPU-s of a
# tiny fit's ~30, scripts/fit_cpu.py).
NO_PREEMPTION_WATCHER = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# Ray Train's controller polls its workers every 2 s, and each turn of a fit's life (workers up, running, finished,
# stopped) waits for a poll; a missed poll only waits on into the next. A tiny 2-worker fit, interleaved: 26.0 s at
# 2 s against 21.6 at 0.5; 18.0 at 0.2 against 19.8 at 0.5; the same CPU seconds (2026-12-06, fit_cpu.py --warm).
FAST_CONTROLLER_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
# The suite's clusters (the local one and the token head) run many short fits of one driver after another on 2 CPUs:
# set while a cluster starts, these reach every process on it. Users' clusters keep Ray's defaults.
MANY_SHORT_FITS = {**WARM_WORKERS, **NO_PREEMPTION_WATCHER, **FAST_CONTROLLER_POLL}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_url(url: str, timeout: float = 120, process: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers; fails early when ``process`` (the server behind it) has exited."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:  # it answers (e.g. 401 without the cluster token): it is up
            return
        except OSError:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the server for {url} exited with {process.returncode}") from None
            if time.time() > deadline:
                raise TimeoutError(f"{url} did not come up") from None
            time.sleep(0.5)


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A process in its own process group (so stop() ends it and everything it started, and nothing else). The
    environment's bin folder leads PATH, as an activated environment's does: `mlflow models serve` runs `uvicorn`
    from PATH, which is not this environment's when pytest runs as `.venv/bin/python -m pytest`."""
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PATH": path, **env},
    )  # fmt: skip


def stop(process: subprocess.Popen, grace_s: float = 5) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace_s`` (raylets can take a while)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + grace_s
        while time.time() < deadline:
            process.poll()  # reap the leader once it ends: a zombie is still a member of its group
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    process.wait()


# ------------------------------------------------------------------------------------------- README's recipe


def recipe_commands(readme: Path = REPO / "README.md") -> list[str]:
    """The shell commands of README's job-submission recipe (its first ```bash block), continuation lines
    joined."""
    text = readme.read_text()
    section = text[text.index(RECIPE_HEADING) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = re.sub(r"\\\n\s*", "", block).splitlines()
    return [line for line in commands if line.strip() and not line.lstrip().startswith("#")]


def localized(command: str, ports: dict[str, int], head_cpus: int | None = None) -> str:
    """README's command with free ports instead of Ray's defaults (other clusters may hold those on this machine)
    and the head's CPU count. Fails loudly if README's command no longer has what is replaced."""
    if command.startswith("ray start --head"):
        for old, new in {
            "--port 6379": f"--port {ports['gcs']}",
            "--dashboard-port 8265": f"--dashboard-port {ports['dashboard']}",
        }.items():
            if old not in command:
                raise ValueError(f"README's recipe changed, update localized(): {command}")
            command = command.replace(old, new)
        command += f" --dashboard-agent-listen-port {ports['agent']} --ray-client-server-port {ports['client']}"
        command += f" --num-cpus {head_cpus}" if head_cpus else ""
    return command.replace("http://127.0.0.1:8265", f"http://127.0.0.1:{ports['dashboard']}")


# ------------------------------------------------------------------------------------------------ servers


@dataclass
class S3Server:
    process: subprocess.Popen
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """What clients need to reach it: boto3 and pyarrow (Ray Train's storage) read AWS_ENDPOINT_URL."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **S3_CREDENTIALS}

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"],
        )


def start_s3(root: Path) -> S3Server:
    port = free_port()
    process = start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], root / "s3.log", {})
    server = S3Server(process, f"http://127.0.0.1:{port}")
    wait_for_url(server.endpoint)
    server.client().create_bucket(Bucket=BUCKET)
    return server


def start_mlflow(root: Path, s3: S3Server) -> tuple[subprocess.Popen, str]:
    """An mlflow server on 127.0.0.1 (SQLite) that stores artifacts in the object store and proxies them, so
    clients need no S3 access of their own."""
    port = free_port()
    command = [
        str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", f"s3://{BUCKET}/mlflow",
    ]  # fmt: skip
    env = {**s3.env, "MLFLOW_S3_ENDPOINT_URL": s3.endpoint, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = start(command, root / "mlflow.log", env)
    uri = f"http://127.0.0.1:{port}"
    wait_for_url(f"{uri}/health")
    return process, uri


# ------------------------------------------------------------------------------------------------ Ray


@dataclass
class Head:
    process: subprocess.Popen  # the shell that ran README's commands; Ray's daemons stay in its process group
    gcs: str  # host:port, for `ray start --address` and ray.init(address=...)
    dashboard: str  # http://127.0.0.1:PORT, for `ray job submit --address`
    env: dict[str, str]  # HOME (with .ray/auth_token), RAY_TMPDIR, RAY_AUTH_MODE + whatever the cluster was given
    nodes: list[subprocess.Popen] = field(default_factory=list)
    node_tmpdirs: list[Path] = field(default_factory=list)

    @property
    def token_path(self) -> Path:
        return Path(self.env["HOME"]) / ".ray" / "auth_token"

    @property
    def ray_tmpdir(self) -> Path:
        return Path(self.env["RAY_TMPDIR"])


def start_head(root: Path, env: dict[str, str], cpus: int | None = None) -> Head:
    """Run README's recipe up to and including `ray start --head`, in a fresh HOME, with free ports."""
    home = root / "home"
    home.mkdir()
    # Ray's socket paths must stay short, so its temp dir is a short one of its own rather than under ``root``.
    env = {**env, "HOME": str(home), "RAY_TMPDIR": tempfile.mkdtemp(prefix="sr-", dir="/tmp")}
    ports = {name: free_port() for name in ("gcs", "dashboard", "agent", "client")}
    commands = recipe_commands()
    setup = commands[: next(i for i, c in enumerate(commands) if c.startswith("ray start")) + 1]
    script = "set -e\n" + "\n".join(localized(c, ports, cpus) for c in setup)
    process = start(["bash", "-c", script], root / "head.log", {**env, "PATH": f"{BIN}:{os.environ['PATH']}"})
    head = Head(process, f"127.0.0.1:{ports['gcs']}", f"http://127.0.0.1:{ports['dashboard']}", env)
    if process.wait(timeout=300) != 0:
        stop(process)
        raise RuntimeError(f"README's head commands failed, see {root / 'head.log'}")
    head.env["RAY_AUTH_MODE"] = "token"  # exported by the recipe for its own commands
    wait_for_url(f"{head.dashboard}/api/version")
    return head


def add_node(head: Head, root: Path, cpus: int) -> subprocess.Popen:
    """A second Ray node on this machine: `ray start --address` with the head's token and environment. It gets a
    temp dir of its own, as a node on another machine would: nodes sharing one would share their runtime_env
    folders (a job's working_dir) and their agents would manage each other's files."""
    tmpdir = Path(tempfile.mkdtemp(prefix="sr-", dir="/tmp"))
    command = [
        str(BIN / "ray"), "start", "--address", head.gcs, "--block", "--num-cpus", str(cpus),
        "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats", "--temp-dir", str(tmpdir),
    ]  # fmt: skip
    node = start(command, root / f"node-{len(head.nodes) + 1}.log", {**head.env, "RAY_TMPDIR": str(tmpdir)})
    head.nodes.append(node)
    head.node_tmpdirs.append(tmpdir)
    return node


def wait_for_nodes(head: Head, count: int, timeout: float = 120) -> None:
    import json

    deadline = time.time() + timeout
    request = urllib.request.Request(
        f"{head.dashboard}/nodes?view=summary", headers={"Authorization": f"Bearer {head.token_path.read_text()}"}
    )
    while True:
        with urllib.request.urlopen(request, timeout=5) as response:
            summary = json.load(response)["data"]["summary"]
        if sum(node["raylet"]["state"] == "ALIVE" for node in summary) >= count:
            return
        if time.time() > deadline:
            raise TimeoutError(f"{count} Ray nodes did not come up")
        time.sleep(1)


def stop_cluster(head: Head) -> None:
    for node in head.nodes:
        stop(node)
    stop(head.process)
    for tmpdir in [head.ray_tmpdir, *head.node_tmpdirs]:  # the sessions' sockets and logs
        shutil.rmtree(tmpdir, ignore_errors=True)


def tiny_training_yaml(
    name: str,
    data_dir: str | Path,
    stage: dict,
    evaluation: dict,
    storage: str | Path,
    tracking_uri: str,
    workers: int = 2,
) -> str:
    """A training config (YAML) that the tests and benchmarks run on these clusters: a random tiny BERT trained by
    ``workers`` workers of half a CPU each (two fit a 2-core machine beside the driver; one, where nothing claimed
    needs a second rank, costs a fit ~8 CPU-s less), one regression stage at lr 1e-4
    with ``stage``'s keys (its data, batch size, length) and ``evaluation`` as given. Dev scores inline on rank 0
    unless ``evaluation`` says otherwise: evaluation.async_dev's auto would place a scorer of one CPU beside the
    workers here, on the cores they train on."""
    import yaml  # here: the cluster itself needs no YAML

    config = {
        "name": name,
        "data_dir": str(data_dir),
        "model": {"name": "random:tiny"},
        "stages": [{**stage, "objective": "regression", "learning_rate": 1.0e-4}],
        "evaluation": {"async_dev": False, **evaluation},
        "scaling": {"num_workers": workers, "cpus_per_worker": 0.5},
        "checkpoint": {"storage_path": str(storage)},
        "tracking": {"tracking_uri": tracking_uri},
    }
    return yaml.safe_dump(config, sort_keys=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where logs, the MLflow database and HOME go (default: a temp dir)")
    parser.add_argument("--head-cpus", type=int, default=2)
    parser.add_argument("--node-cpus", type=int, default=1)
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="sbert-ray-cluster-"))
    root.mkdir(parents=True, exist_ok=True)
    s3 = start_s3(root)
    mlflow, tracking_uri = start_mlflow(root, s3)
    head = start_head(root, s3.env, cpus=args.head_cpus)
    try:
        add_node(head, root, args.node_cpus)
        wait_for_nodes(head, 2)
        exports = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(head.token_path), **s3.env}
        print(f"Cluster up (head + 1 node); S3 at {s3.endpoint}, MLflow at {tracking_uri}, logs in {root}")
        print("Submit from another shell:")
        print("  export " + " ".join(f"{k}={v}" for k, v in exports.items()))
        print(
            f"  ray job submit --address {head.dashboard} --working-dir . -- python jobs/train.py "
            f"jobs/configs/quickstart.yaml data_dir=$PWD/../shared/data tracking.tracking_uri={tracking_uri} "
            f"checkpoint.storage_path=s3://{BUCKET}/runs scaling.num_workers=2 scaling.placement_strategy=SPREAD "
            "scaling.cpus_per_worker=0.5"
        )
        print("Ctrl-C stops everything.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop_cluster(head)
        stop(mlflow)
        stop(s3.process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
