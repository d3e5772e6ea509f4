"""Starting and stopping the real servers tests talk to (`mlflow server`, `ray start --head`, `mlflow models serve`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent  # the console scripts of this environment (mlflow, ray)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_url(url: str, timeout: float = 90, process: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers; fails early when ``process`` (the server behind it) has exited."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:  # it answers (e.g. 401 without the cluster token): it is up
            return
        except OSError:
            assert process is None or process.poll() is None, f"the server for {url} exited with {process.returncode}"
            assert time.time() < deadline, f"{url} did not come up"
            time.sleep(0.5)


def start(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # so teardown can stop the whole process group
        env={**os.environ, **env},
    )


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
