"""Quality parity with the reference library (issue: distributed training, item 8).

Fine-tunes all-MiniLM-L6-v2 on STSb train (regression, batch 16, lr 2e-5, 10% warm-up, 1 epoch, fixed seed)
three ways, side by side in one run on one machine:
  - sbert-ray on Ray Train with 1 worker (batch 16),
  - sbert-ray with 2 workers (8 each, the same global batch of 16),
  - sentence-transformers' own SentenceTransformerTrainer with the same settings,
then scores each (and the untrained model) on STSb test. Prints JSON, writes it to --output and logs it to
MLflow. Expected: all three within 0.5 points of each other and clearly above the untrained model.

    python benchmarks/parity_st.py --data-dir ../shared/data --output results/parity.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from sbert_ray.config import load_config
from sbert_ray.data import load_records
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.resolve import resolve_model_ref
from sbert_ray.runs.train_run import run_training
from sbert_ray.tracking.mlflow_run import RunTracker, resolve_tracking_uri

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SETTINGS = {"batch_size": 16, "learning_rate": 2e-5, "warmup_ratio": 0.1, "epochs": 1, "seed": 42}


def ours(num_workers: int, data_dir: str, workdir: Path, tracking_uri: str, limit: int | None) -> float:
    overrides = [
        f"name=parity-{num_workers}w-{int(time.time())}",
        f"data_dir={data_dir}",
        f"seed={SETTINGS['seed']}",
        f"stages.0.learning_rate={SETTINGS['learning_rate']}",
        f"stages.0.limit={limit or 'null'}",
        "evaluation.before_tasks=[]",
        "evaluation.final_tasks=[stsb]",
        "evaluation.eval_every=0",
        f"scaling.num_workers={num_workers}",
        f"scaling.cpus_per_worker={2 / num_workers}",  # both runs use the machine's 2 cores
        f"checkpoint.storage_path={workdir / 'runs'}",
        f"tracking.tracking_uri={tracking_uri}",
        "tracking.experiment=parity",
    ]
    config = load_config(Path(__file__).parents[1] / "jobs" / "configs" / "quickstart.yaml", overrides)
    return run_training(config).final["stsb/spearman_cosine"]


def reference(data_dir: str, workdir: Path, limit: int | None) -> float:
    """sentence-transformers' trainer with the settings the paper (and our defaults) use."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
        losses,
    )

    pairs = load_records("stsb", "train", data_dir)[:limit]
    dataset = Dataset.from_dict(
        {
            "sentence1": [p.sentence1 for p in pairs],
            "sentence2": [p.sentence2 for p in pairs],
            "score": [p.score / 5 for p in pairs],
        }
    )
    model = SentenceTransformer(resolve_model_ref(MODEL), device="cpu")
    args = SentenceTransformerTrainingArguments(
        output_dir=str(workdir / "st"),
        num_train_epochs=SETTINGS["epochs"],
        per_device_train_batch_size=SETTINGS["batch_size"],
        learning_rate=SETTINGS["learning_rate"],
        warmup_ratio=SETTINGS["warmup_ratio"],
        weight_decay=0.01,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        seed=SETTINGS["seed"],
        save_strategy="no",
        report_to="none",
    )
    SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset, loss=losses.CosineSimilarityLoss(model)
    ).train()
    model.save(str(workdir / "st-model"))
    return stsb_test(str(workdir / "st-model"), data_dir)


def stsb_test(model: str, data_dir: str) -> float:
    return evaluate_pairs(SentenceEncoder.load(model), load_records("stsb", "test", data_dir))["spearman_cosine"]


def timed(fn, *args) -> tuple[float, float]:
    start = time.perf_counter()
    score = fn(*args)
    return score, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("SBERT_RAY_DATA_DIR", "../shared/data"))
    parser.add_argument("--output", default="results/parity.json")
    parser.add_argument("--limit", type=int, help="train on the first N STSb pairs only (a quick look)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: as training)")
    args = parser.parse_args()
    tracking_uri = resolve_tracking_uri(args.tracking_uri)

    with tempfile.TemporaryDirectory(prefix="sbert-ray-parity-") as tmp:
        workdir = Path(tmp)
        untrained = stsb_test(MODEL, args.data_dir)
        one_worker, one_worker_s = timed(ours, 1, args.data_dir, workdir, tracking_uri, args.limit)
        two_workers, two_workers_s = timed(ours, 2, args.data_dir, workdir, tracking_uri, args.limit)
        st, st_s = timed(reference, args.data_dir, workdir, args.limit)

    scores = {"sbert_ray_1_worker": one_worker, "sbert_ray_2_workers": two_workers, "sentence_transformers": st}
    result = {
        "model": MODEL,
        "settings": {**SETTINGS, "train_pairs": args.limit or 5749},
        "stsb_test_spearman": {"untrained": untrained, **scores},
        "wall_seconds": {"sbert_ray_1_worker": one_worker_s, "sbert_ray_2_workers": two_workers_s,
                         "sentence_transformers": st_s},
        "max_gap_points": max(scores.values()) - min(scores.values()),
        "min_gain_over_untrained": min(scores.values()) - untrained,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")

    with RunTracker(tracking_uri, "parity", run_name="parity-st") as tracker:
        tracker.log_metrics({f"stsb_test/{k}": v for k, v in result["stsb_test_spearman"].items()})
        tracker.log_metrics({f"wall_seconds/{k}": v for k, v in result["wall_seconds"].items()})
        tracker.log_dict(result, "parity.json")


if __name__ == "__main__":
    main()
