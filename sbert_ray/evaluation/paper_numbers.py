"""The published numbers of Reimers & Gurevych 2019 (Tables 1-7), as summarised in shared/docs/paper.md."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperTable:
    number: int
    title: str
    metric: str
    columns: tuple[str, ...]
    rows: dict[str, tuple[float | None, ...]]  # None = not reported


PAPER_TABLES: dict[int, PaperTable] = {
    1: PaperTable(
        1,
        "Unsupervised STS (no training on STS data)",
        "Spearman x100, cosine",
        ("STS12", "STS13", "STS14", "STS15", "STS16", "STSb", "SICK-R", "Avg"),
        {
            "Avg. GloVe": (55.14, 70.66, 59.73, 68.25, 63.66, 58.02, 53.76, 61.32),
            "Avg. BERT": (38.78, 57.98, 57.98, 63.15, 61.06, 46.35, 58.40, 54.81),
            "BERT CLS": (20.16, 30.01, 20.09, 36.88, 38.08, 16.50, 42.63, 29.19),
            "InferSent-GloVe": (52.86, 66.75, 62.15, 72.77, 66.87, 68.03, 65.65, 65.01),
            "USE": (64.49, 67.80, 64.61, 76.83, 73.18, 74.92, 76.69, 71.22),
            "SBERT-NLI-base": (70.97, 76.53, 73.19, 79.09, 74.30, 77.03, 72.91, 74.89),
            "SBERT-NLI-large": (72.27, 78.46, 74.90, 80.99, 76.25, 79.23, 73.75, 76.55),
            "SRoBERTa-NLI-base": (71.54, 72.49, 70.80, 78.74, 73.69, 77.77, 74.46, 74.21),
            "SRoBERTa-NLI-large": (74.53, 77.00, 73.18, 81.85, 76.82, 79.10, 74.29, 76.68),
        },
    ),
    2: PaperTable(
        2,
        "Supervised STSb (test), mean and std over 10 seeds",
        "Spearman x100",
        ("STSb", "std"),
        {
            "BERT-STSb-base": (84.30, 0.76),
            "SBERT-STSb-base": (84.67, 0.19),
            "SRoBERTa-STSb-base": (84.92, 0.34),
            "BERT-STSb-large": (85.64, 0.81),
            "SBERT-STSb-large": (84.45, 0.43),
            "SRoBERTa-STSb-large": (85.02, 0.76),
            "BERT-NLI-STSb-base": (88.33, 0.19),
            "SBERT-NLI-STSb-base": (85.35, 0.17),
            "SRoBERTa-NLI-STSb-base": (84.79, 0.38),
            "BERT-NLI-STSb-large": (88.77, 0.46),
            "SBERT-NLI-STSb-large": (86.10, 0.13),
            "SRoBERTa-NLI-STSb-large": (86.15, 0.35),
        },
    ),
    3: PaperTable(
        3,
        "Argument Facet Similarity (AFS)",
        "x100",
        ("Pearson r", "Spearman rho"),
        {
            "tf-idf (unsupervised)": (46.77, 42.95),
            "Avg. GloVe (unsupervised)": (32.40, 34.00),
            "InferSent-GloVe (unsupervised)": (27.08, 26.63),
            "SVR (10-fold CV)": (63.33, None),
            "BERT-AFS-base (10-fold CV)": (77.20, 74.84),
            "SBERT-AFS-base (10-fold CV)": (76.57, 74.13),
            "BERT-AFS-large (10-fold CV)": (78.68, 76.38),
            "SBERT-AFS-large (10-fold CV)": (77.85, 75.93),
            "BERT-AFS-base (cross-topic)": (58.49, 57.23),
            "SBERT-AFS-base (cross-topic)": (52.34, 50.65),
            "BERT-AFS-large (cross-topic)": (62.02, 60.34),
            "SBERT-AFS-large (cross-topic)": (53.82, 53.10),
        },
    ),
    4: PaperTable(
        4,
        "Wikipedia section triplets (test, 222,957 triplets)",
        "accuracy (fraction)",
        ("accuracy",),
        {
            "mean-vectors": (0.65,),
            "skip-thoughts-CS": (0.62,),
            "Dor et al.": (0.74,),
            "SBERT-WikiSec-base": (0.8042,),
            "SBERT-WikiSec-large": (0.8078,),
            "SRoBERTa-WikiSec-base": (0.7945,),
            "SRoBERTa-WikiSec-large": (0.7973,),
        },
    ),
    5: PaperTable(
        5,
        "SentEval transfer tasks",
        "accuracy x100",
        ("MR", "CR", "SUBJ", "MPQA", "SST", "TREC", "MRPC", "Avg"),
        {
            "Avg. BERT": (78.66, 86.25, 94.37, 88.66, 84.40, 92.8, 69.45, 84.94),
            "BERT CLS": (78.68, 84.85, 94.21, 88.23, 84.13, 91.4, 71.13, 84.66),
            "SBERT-NLI-base": (83.64, 89.43, 94.39, 89.86, 88.96, 89.6, 76.00, 87.41),
            "SBERT-NLI-large": (84.88, 90.07, 94.52, 90.33, 90.66, 87.4, 75.94, 87.69),
        },
    ),
    6: PaperTable(
        6,
        "Ablation on STSb dev (NLI classification objective / STSb regression objective)",
        "Spearman x100",
        ("NLI", "STSb"),
        {
            "pooling MEAN": (80.78, 87.44),
            "pooling MAX": (79.07, 69.92),
            "pooling CLS": (79.80, 86.62),
            "concat (u, v)": (66.04, None),
            "concat (|u-v|)": (69.78, None),
            "concat (u*v)": (70.54, None),
            "concat (|u-v|, u*v)": (78.37, None),
            "concat (u, v, u*v)": (77.44, None),
            "concat (u, v, |u-v|)": (80.78, None),
            "concat (u, v, |u-v|, u*v)": (80.44, None),
        },
    ),
    7: PaperTable(
        7,
        "Encoding speed (CPU i7-5820K, GPU V100)",
        "sentences per second",
        ("CPU", "GPU"),
        {
            "InferSent": (137, 1876),
            "USE": (67, 1318),
            "SBERT-base": (44, 1378),
            "SBERT-base, smart batching": (83, 2042),
        },
    ),
}
