"""Our STS suite against sentence-transformers' EmbeddingSimilarityEvaluator on the same model and data.

    python benchmarks/sts_vs_reference.py --model sentence-transformers/all-MiniLM-L6-v2 --data-dir ../shared/data

Prints JSON: per dataset our Spearman/Pearson x100 (cosine), the reference's, and the largest gap in points.
"""

from __future__ import annotations

import argparse
import json

from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

from sbert_ray.data import load_records, load_sts_subsets
from sbert_ray.evaluation.sts import STS_YEARS, run_sts_suite
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.resolve import resolve_model_ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default="../shared/data")
    args = parser.parse_args()

    ours = run_sts_suite(SentenceEncoder.load(args.model), args.data_dir)
    reference_model = SentenceTransformer(resolve_model_ref(args.model), device="cpu")
    report = {}
    for name, metrics in ours.items():
        if name in STS_YEARS:
            pairs = [p for subset in load_sts_subsets(name, args.data_dir).values() for p in subset]
        else:
            pairs = load_records(name, "test", args.data_dir)
        evaluator = EmbeddingSimilarityEvaluator(
            [p.sentence1 for p in pairs], [p.sentence2 for p in pairs], [p.score for p in pairs]
        )
        reference = evaluator(reference_model)
        report[name] = {
            "n": metrics["n"],
            "ours": {k: metrics[k] for k in ("spearman_cosine", "pearson_cosine")},
            "reference": {k: reference[k] * 100 for k in ("spearman_cosine", "pearson_cosine")},
        }
        report[name]["max_gap_points"] = max(
            abs(report[name]["ours"][k] - report[name]["reference"][k]) for k in report[name]["ours"]
        )
    print(json.dumps(report, indent=2))
    print(f"largest gap over all datasets: {max(r['max_gap_points'] for r in report.values()):.5f} points")


if __name__ == "__main__":
    main()
