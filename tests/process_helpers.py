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


def start_mlflow_server(root: Path, port: int, admin: tuple[str, str] | None = None) -> subprocess.Popen:
    """A real `mlflow server` on 127.0.0.1:``port`` with its sqlite store and proxied artifacts under ``root`` (the
    same store again when restarted on the same root); with ``admin`` (user, password), MLflow's basic-auth app,
    which refuses requests without them. Returns once it answers."""
    command = [
        str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if admin is not None:
        auth_config = root / "basic_auth.ini"
        settings = {
            "default_permission": "READ",
            "database_uri": f"sqlite:///{root / 'auth.db'}",
            "admin_username": admin[0],
            "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
        }
        auth_config.write_text("[mlflow]\n" + "".join(f"{key} = {value}\n" for key, value in settings.items()))
        command += ["--app-name", "basic-auth"]
        # The admin password from the environment, so that no file of the test holds it.
        env |= {
            "MLFLOW_AUTH_CONFIG_PATH": str(auth_config),
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin[1],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "sbert-ray-tests",
        }
    server = start(command, root / "server.log", **env)
    wait_for_url(f"http://127.0.0.1:{port}/health", process=server)
    return server


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
