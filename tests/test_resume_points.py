"""Resume points (``training.resume_points``): only complete ones are chosen, the two newest stay whatever keep_best
ranks, and the ranks of one node download a point once. The cluster test that kills a run with ``full_every: 3`` and
``keep_best: 1`` is ``test_training.py::test_a_killed_run_resumes_on_the_curve_of_an_uninterrupted_one``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import local_cluster
import pyarrow.fs as pafs
import pytest

from sbert_ray.training.resume_points import ResumePoints, fetch_once_per_node
from sbert_ray.training.state import MODEL_DIR, STATE_FILE, TRAINING_FILE


def full_state(tmp_path: Path, step: int) -> Path:
    """A folder laid out as a full-state checkpoint of ``step`` (the files' contents do not matter here)."""
    folder = tmp_path / f"local-{step}"
    (folder / MODEL_DIR).mkdir(parents=True)
    (folder / MODEL_DIR / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / STATE_FILE).write_text(f'{{"global_step": {step}}}')
    (folder / TRAINING_FILE).write_bytes(b"optimizer %d" % step)
    return folder


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.servers)])
def points(request, tmp_path, monkeypatch) -> ResumePoints:
    if request.param == "local":
        return ResumePoints(pafs.LocalFileSystem(), str(tmp_path / "run" / "resume_points"))
    server = request.getfixturevalue("s3_server")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    filesystem, path = pafs.FileSystem.from_uri(f"s3://{local_cluster.BUCKET}/{tmp_path.name}/run/resume_points")
    return ResumePoints(filesystem, path)


def test_the_newest_complete_point_is_chosen_and_the_two_newest_stay(points, tmp_path):
    """Points of steps 30, 60, 90: 90 is chosen and 30 is gone. A kill while step 120 uploads leaves its folder
    without the marker: still 90. Step 120 uploaded again replaces what the kill left, and 60 goes."""
    for step in (30, 60, 90):
        local = full_state(tmp_path, step)
        points.save(local, step)
        assert not local.exists()  # the local copy goes once uploaded
    assert points.latest().global_step == 90
    assert sorted(points._folders()) == [60, 90]

    half = points._path(120)  # what an upload cut short by a kill leaves
    points.filesystem.create_dir(half)
    with points.filesystem.open_output_stream(f"{half}/{TRAINING_FILE}") as stream:
        stream.write(b"optim")
    assert points.latest().global_step == 90

    points.save(full_state(tmp_path, 120), 120)
    newest = points.latest()
    assert newest.global_step == 120 and sorted(points._folders()) == [90, 120]
    with points.filesystem.open_input_stream(f"{newest.path}/{TRAINING_FILE}") as stream:
        assert stream.read() == b"optimizer 120"


def test_a_killed_points_upload_before_the_newest_complete_one_is_removed(tmp_path):
    """A half-uploaded point older than a complete one (the run resumed before it and went past it) is deleted
    with the next save, not kept forever."""
    points = ResumePoints(pafs.LocalFileSystem(), str(tmp_path / "resume_points"))
    points.save(full_state(tmp_path, 30), 30)
    Path(points._path(45)).mkdir()
    points.save(full_state(tmp_path, 60), 60)
    assert sorted(points._folders()) == [30, 60]


# One rank of a node: fetch the newest point of a run's resume folder into the node's cache; print what it got.
FETCH_RANK = """
import sys
from pathlib import Path
import pyarrow.fs as pafs
from sbert_ray.training.resume_points import ResumePoints, fetch_once_per_node
points = ResumePoints(pafs.LocalFileSystem(), sys.argv[1])
local, downloaded = fetch_once_per_node(points.filesystem, points.latest(), Path(sys.argv[2]))
print(local, downloaded, (local / "training.pt").read_bytes().decode())
"""


def test_the_ranks_of_one_node_download_a_point_once(tmp_path):
    """Two processes (the ranks of one node, as Ray Train starts them) fetch the same point at once: one
    downloads, both load the same complete folder. A later point of the same run replaces the node's copy."""
    points = ResumePoints(pafs.LocalFileSystem(), str(tmp_path / "resume_points"))
    points.save(full_state(tmp_path, 30), 30)
    command = [sys.executable, "-c", FETCH_RANK, points.folder, str(tmp_path / "node")]
    ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    fetched = sorted(rank.communicate(timeout=300)[0].split(" ", 2) for rank in ranks)
    assert [downloaded for _, downloaded, _ in fetched] == ["False", "True"]
    assert {(local, content.strip()) for local, _, content in fetched} == {(fetched[0][0], "optimizer 30")}

    points.save(full_state(tmp_path, 60), 60)
    local, downloaded = fetch_once_per_node(points.filesystem, points.latest(), tmp_path / "node")
    assert downloaded and not Path(fetched[0][0]).exists()
    assert (local / TRAINING_FILE).read_bytes() == b"optimizer 60"
