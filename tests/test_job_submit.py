"""The product path end to end, as README's job-submission recipe writes it: a token generated in a fresh HOME, a
head started with it (dashboard on 127.0.0.1), `ray job submit` of jobs/train.py logging to an `mlflow server`
on 127.0.0.1, and a finished run whose model loads in sentence-transformers."""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from local_cluster import BIN, REPO, localized, recipe_commands
from mlflow.tracking import MlflowClient
from sentence_transformers import SentenceTransformer

# README's quickstart shrunk to a tiny random BERT on an STSb slice (key=value overrides, as users write them).
TINY_QUICKSTART = [
    "name=submitted", "model.name=random:tiny", "stages.0.limit=96", "stages.0.batch_size=8",
    "stages.0.learning_rate=1.0e-4", "evaluation.eval_every=4", "evaluation.dev_limit=100",
    "evaluation.before_tasks=[stsb]", "evaluation.final_tasks=[stsb]", "scaling.cpus_per_worker=0.5",
    "evaluation.async_dev=false",
]  # fmt: skip


def test_dashboard_refuses_requests_without_the_token(token_head):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{token_head.dashboard}/api/jobs/", timeout=10)
    assert refused.value.code == 401
    request = urllib.request.Request(
        f"{token_head.dashboard}/api/jobs/", headers={"Authorization": f"Bearer {token_head.token_path.read_text()}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_readme_recipe_submits_a_job_that_trains_and_logs_to_mlflow_server(token_head, mlflow_server, tmp_path):
    """The rest of README's recipe (the head fixture ran its first commands): `ray job submit` as written."""
    commands = recipe_commands()
    exports = [c for c in commands if c.startswith("export ")]
    (submit,) = [c for c in commands if c.startswith("ray job submit")]
    submission_id = f"sbert-ray-test-{int(time.time())}"
    job = localized(submit, {"dashboard": int(token_head.dashboard.rsplit(":", 1)[1])})
    job = job.replace("ray job submit", f"ray job submit --submission-id {submission_id}", 1)
    job += " " + " ".join(
        [*TINY_QUICKSTART, f"tracking.tracking_uri={mlflow_server}", f"checkpoint.storage_path={tmp_path / 'runs'}"]
    )
    env = {**os.environ, **token_head.env, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_AUTH_MODE")  # the recipe exports it itself
    deadline = time.time() + 120
    while True:  # a fresh head's job agent takes a moment; Ray says "No available agent ... try again later"
        submitted = subprocess.run(
            ["bash", "-c", "set -e\n" + "\n".join([*exports, job])],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if "No available agent" not in submitted.stderr or time.time() > deadline:
            break
        time.sleep(2)
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0 and f"Job '{submission_id}' succeeded" in output, output[-4000:]
    assert "stsb test spearman_cosine: before" in output and "MLflow run" in output
    assert re.search(r"stage 1/1  step (\d+)/\1  loss [\d.]+  dev [-\d.]+", output)  # the last report's progress line

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sbert-ray")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.ray_job_id = '{submission_id}'")
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "dev/spearman_cosine", "final/stsb/spearman_cosine"):
        assert key in run.data.metrics
    model_dir = client.download_artifacts(run.info.run_id, "model", str(tmp_path))
    embeddings = SentenceTransformer(model_dir, device="cpu").encode(["a sentence", "another one"])
    assert embeddings.shape == (2, 32)
