"""The layering in docs/architecture.md, checked on the import statements of the package (module level
and inside functions alike): dependencies point down, no import circles, Ray and MLflow only where they belong."""

from __future__ import annotations

import ast
import functools
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sbert_ray"

# Lower numbers sit lower; a module may import its own layer or below. models/losses/data form one layer.
LAYERS = {
    "tracking": 0,
    "progress": 0,  # tqdm bars and the --quiet switch, for every layer
    "ray_compat": 0,  # Ray's private and version-sensitive APIs, and joining a cluster, for every Ray user
    "atomic_files": 0,  # write under a temporary name, then rename: for every layer that writes files
    "data": 1,
    "models": 1,
    "losses": 1,
    "config": 2,
    "files": 2,  # path checks and JSON for every file a command writes
    "reservations": 2,  # Ray resources reserved with a bounded wait, for training, encoder pools and dev scoring
    "evaluation": 3,
    "training": 4,
    "tuning": 4,
    "bench": 4,
    "runs": 5,
    "cli": 6,
}
# Ray's rooms: orchestration, Tune, and the adapters around the Ray-free training core and benchmarks.
RAY_ALLOWED = (
    "ray_compat",
    "runs",
    "training.worker",
    "training.trainer",
    "training.faults",  # on Ray Train's controller: which worker errors end the run
    "training.preemption",  # SIGTERM on a Ray Train worker
    "tuning",
    "bench.train_speed_on_ray",
    "bench.ingest_speed",  # its cluster mode: the stream through Ray Data
    "training.stage_data",
    "training.validation",  # Ray Train's checkpoint validation: dev scores beside training
    "evaluation.encoder_pool",
    "reservations",
    "data.remote_corpus",  # a corpus on object storage, read by Ray Data (mining, retrieval on a cluster)
)
MLFLOW_ALLOWED = ("tracking",)
# What a GPU machine without Ray, MLflow, datasets, pyarrow or pandas runs (`sbert-ray bench encode`, `bench train
# --local`): none of them may be imported when these modules load (tests/test_without_ray.py runs the benches and the
# GPU scripts with them blocked).
RAY_FREE = ("sbert_ray.cli", "sbert_ray.training.stages", "sbert_ray.bench.train_speed", "sbert_ray.bench.encode_speed")
NOT_ON_THE_GPU_MACHINE = ("ray", "mlflow", "datasets", "pyarrow", "pandas")


def modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }


def imports(path: Path, module_level: bool = False) -> set[str]:
    """Every absolute module name imported anywhere in the file (``module_level``: when it loads, not inside a
    function or class)."""
    names = set()
    tree = ast.parse(path.read_text())
    nodes = _module_level(tree) if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _module_level(node: ast.AST):
    """The statements that run when the module loads: all but function and class bodies and ``if TYPE_CHECKING:``
    blocks (names for annotations only)."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda | ast.If):
            yield child
            yield from _module_level(child)
        elif isinstance(child, ast.If) and not (isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING"):
            yield child
            yield from _module_level(child)


@functools.cache  # one parse of the package for all the parametrised tests
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {imp for imp in imports(path) if imp in known and imp != name} for name, path in known.items()}


def part(module: str) -> str:
    """sbert_ray.evaluation.sts -> evaluation; sbert_ray.config -> config."""
    return module.split(".")[1] if module.count(".") else "sbert_ray"


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_down(module):
    if part(module) == "sbert_ray":
        return
    upward = sorted(imp for imp in graph()[module] if LAYERS[part(imp)] > LAYERS[part(module)])
    assert not upward, f"{module} imports from a higher layer: {upward}"


def test_no_import_circles():
    edges = graph()
    # Package __init__ files re-export their own modules; an edge into one's own package is not a dependency.
    edges = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in edges.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(nxt) :] + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("library, allowed", [("ray", RAY_ALLOWED), ("mlflow", MLFLOW_ALLOWED)])
def test_ray_and_mlflow_only_where_they_belong(library, allowed):
    offenders = [
        name
        for name, path in modules().items()
        if any(imp == library or imp.startswith(library + ".") for imp in imports(path))
        and not name.removeprefix("sbert_ray.").startswith(allowed)
    ]
    assert not offenders, f"{library} imported in {offenders}"


PRIVATE_RAY = ("ray.core.generated", "ray.train.v2")  # modules of Ray's that are not its public API, besides ray.*._x


def private_ray_uses(path: Path) -> list[str]:
    """Imports of ``PRIVATE_RAY`` modules, ``ray._x`` attribute chains and ``ray.init(_x=...)`` keywords in a file."""
    tree = ast.parse(path.read_text())
    found = [
        f"import {name}"
        for name in imports(path)
        if name.startswith(PRIVATE_RAY) or (name.startswith("ray.") and any(p.startswith("_") for p in name.split(".")))
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and ast.unparse(node).startswith("ray."):
            found.append(ast.unparse(node))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "ray.init":
            found += [f"ray.init({kw.arg}=...)" for kw in node.keywords if kw.arg and kw.arg.startswith("_")]
    return found


def test_private_ray_apis_only_in_ray_compat():
    """One module owns them (and tests/test_ray_compat.py tries each), so a Ray upgrade is checked in one place."""
    offenders = {
        name: uses
        for name, path in modules().items()
        if name != "sbert_ray.ray_compat" and (uses := private_ray_uses(path))
    }
    assert not offenders, f"private Ray APIs outside sbert_ray/ray_compat.py: {offenders}"
    assert private_ray_uses(PACKAGE / "ray_compat.py"), "the check finds nothing even where they are"


@pytest.mark.parametrize("root", RAY_FREE)
def test_the_training_core_and_the_benches_load_without_what_the_gpu_machine_lacks(root):
    """Followed through every module of this package that ``root`` loads: none imports Ray, MLflow, datasets,
    pyarrow or pandas at load time (inside a function, on a path the benchmarks do not take, is allowed)."""
    known, seen, todo = modules(), set(), [root]
    while todo:
        name = todo.pop()
        seen.add(name)
        loaded = imports(known[name], module_level=True)
        offending = sorted(imp for imp in loaded if imp.partition(".")[0] in NOT_ON_THE_GPU_MACHINE)
        assert not offending, f"{root} loads {name}, which imports {offending}"
        parents = {".".join(imp.split(".")[:i]) for imp in loaded for i in range(2, imp.count(".") + 1)}
        todo += [imp for imp in loaded | parents if imp in known and imp not in seen]


def test_the_config_imports_no_model_code():
    """Every CLI command imports the config first: loading transformers' model code there cost ~3 s of each
    command's start-up. Model classes load where a model is built."""
    probe = "import sys, sbert_ray.config; print(sorted(m for m in sys.modules if m.endswith('modeling_utils')))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


HEAVY_LIBRARIES = ("torch", "transformers", "ray", "mlflow")  # seconds of start-up each on a 2-core machine


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--help"], 0, ""),
        (["train", "--help"], 0, ""),
        (["train", "{config}", "modle.name=random:tiny"], 2, "unknown key 'modle'"),
        (["train", "{config}", "stages.0.learning_rate=-1"], 2, "stages.0.learning_rate must be > 0"),
    ],
)
def test_help_and_config_errors_answer_without_heavy_imports(argv, code, message, tmp_path):
    """`sbert-ray --help` and a config error answer at once: nothing on their path imports torch, transformers,
    Ray or MLflow (the commands import those inside their handlers, after the config is loaded)."""
    config = tmp_path / "config.yaml"
    config.write_text("name: x\nmodel:\n  name: random:tiny\n")
    probe = (
        "import sys\nfrom sbert_ray.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as exit:\n    code = exit.code\n"
        f"print(code, sorted(m for m in {HEAVY_LIBRARIES} if m in sys.modules))"
    )
    argv = [arg.format(config=config) for arg in argv]
    result = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == f"{code} []", result.stdout[-500:]
    assert message in result.stderr


def test_ray_trains_controller_unpickles_no_code_of_ours(tmp_path):
    """The controller unpickles the loop config (the loop function only reaches the workers): a TrainConfig there
    made it import this package and torch, ~3 s of CPU beside the starting workers on every fit."""
    import ray.train

    from sbert_ray.config import TrainConfig
    from sbert_ray.training.stage_plan import WorkerPlan
    from sbert_ray.training.trainer import torch_trainer

    plan = WorkerPlan.of(TrainConfig(), rows=[[64]])
    trainer = torch_trainer(plan, ({}, []), ray.train.RunConfig(storage_path=str(tmp_path)))
    assert b"sbert_ray" not in pickle.dumps(trainer.train_loop_config)


@pytest.mark.parametrize(
    "modules, libraries",
    [
        # The stage datasets (tokenize, the read tasks' sources) and the progress callback: Ray Train's controller
        # and Ray Data's DatasetManager and SplitCoordinator unpickle them on the way to the first step; they
        # never tokenise.
        ("sbert_ray.training.stage_data, sbert_ray.runs.progress_lines", ("torch", "transformers", "mlflow")),
        ("sbert_ray.runs.scoring", ("mlflow",)),  # the final scores' task, which logs nothing
        # Every Train worker: LoRA imports peft where a stage trains adapters, rank 0 of a logged run MLflow, and a
        # sharded run FSDP (DTensor with it).
        ("sbert_ray.training.worker", ("peft", "mlflow", "torch.distributed.tensor", "torch.distributed.fsdp")),
    ],
)
def test_what_rays_processes_unpickle_imports_no_more_than_they_use(modules, libraries):
    """Each of torch, transformers, MLflow, peft and DTensor is ~1 s or more of start-up for a fresh Ray process on 2
    cores."""
    probe = f"import sys, {modules}\nprint(sorted(m for m in {libraries} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "[]", result.stdout[-500:]
