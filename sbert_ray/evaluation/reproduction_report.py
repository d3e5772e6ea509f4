"""``sbert-ray report``: our evaluation results beside the paper's Tables 1-7, as markdown with PNG plots.

Inputs are results files written by ``sbert-ray eval --output`` ({entry: metrics}) or MLflow runs (their
``evaluation.json`` artifact). The report states every known difference of data and model from the paper, and
can be logged to MLflow as a run of its own.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sbert_ray.config import ConfigError, flatten
from sbert_ray.evaluation.paper_numbers import PAPER_TABLES, PaperTable

# Tables whose columns are our datasets: table -> ({our entry: paper column}, metric).
COLUMN_TABLES: dict[int, tuple[dict[str, str], str]] = {
    1: (
        {"sts12": "STS12", "sts13": "STS13", "sts14": "STS14", "sts15": "STS15", "sts16": "STS16"}
        | {"stsb": "STSb", "sickr": "SICK-R"},
        "spearman_cosine",
    ),
    2: ({"stsb": "STSb"}, "spearman_cosine"),
    5: (
        {"MR": "MR", "CR": "CR", "SUBJ": "SUBJ", "MPQA": "MPQA", "SST2": "SST", "TREC": "TREC", "MRPC": "MRPC"},
        "accuracy",
    ),
}
# Tables whose rows are our datasets: table -> (our entries, metrics in the paper's column order).
ROW_TABLES: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    3: (("afs-10fold", "afs-cross-topic", "ukp-aspect", "bws"), ("pearson_cosine", "spearman_cosine")),
    4: (("wikisec", "nli-triplets"), ("accuracy_euclidean",)),
}
# Paper rows drawn beside ours in each table's plot.
REFERENCE_ROWS = {
    1: ("Avg. BERT", "SBERT-NLI-base"),
    2: ("SBERT-STSb-base", "SBERT-NLI-STSb-base"),
    3: ("tf-idf (unsupervised)", "SBERT-AFS-base (10-fold CV)", "SBERT-AFS-base (cross-topic)"),
    4: ("Dor et al.", "SBERT-WikiSec-base"),
    5: ("Avg. BERT", "SBERT-NLI-base"),
}
NOT_FROM_EVALUATION = {
    6: "an ablation over training runs (pooling / concatenation, scored on STSb dev): compare the dev Spearman of "
    "`sbert-ray train` runs with model.pooling / stages.0.concat overrides, not evaluation results.",
    7: "encoding throughput: measured by the benchmark (sentences per second), not by evaluation results.",
}

SENTEVAL_NOTE = (
    "SentEval: scikit-learn logistic regression on frozen embeddings, C from SentEval's grid 2^-2..2^3 chosen "
    "by an inner 5-fold CV (SentEval: 10-fold) or SST2's dev split; 10-fold CV for MR/CR/SUBJ/MPQA, standard "
    "splits for SST2/TREC/MRPC; MRPC on (|u-v|, u*v). Texts as SentEval distributes them (pre-tokenised)."
)
DATA_NOTES: dict[str, str] = {
    "sts12": "STS12-16: local SemEval test files, each year scored as one concatenated set (as the paper); "
    "STS13 without SMT (LDC licence), as SentEval and SBERT.",
    "stsb": "STSb: test split, 1,379 pairs.",
    "sickr": "SICK-R: the test split (4,927 pairs) of the SemEval-2014 release.",
    "afs-10fold": "AFS 10-fold: pairs of all three topics shuffled into 10 folds (seed 42).",
    "afs-cross-topic": "AFS cross-topic: train on two topics, test on the third, averaged over the three.",
    "ukp-aspect": "UKP ASPECT instead of AFS (AFS is not available offline): 3,595 pairs over 28 topics, its official "
    "4 cross-topic folds (7 test topics each; train = 17 other topics, 4 dev topics unused for training); labels "
    "mapped HS=3, SS=2, NS=1, DTORCD=0. Different corpus, topics and label scale: compare trends, not values.",
    "bws": "BWS argument similarity instead of AFS: 3,400 pairs over 8 topics, scores 0-1, leave-one-topic-out "
    "(8 folds; the paper's AFS cross-topic has 3). Different corpus: compare trends, not values.",
    "wikisec": "Wikipedia-section triplets (Dor et al. 2018), test split.",
    "nli-triplets": "SNLI-test triplets (premise, entailed, contradicting hypothesis; 3,247) instead of the "
    "Wikipedia-section triplets (not available offline): same accuracy, different task and data.",
    **dict.fromkeys(("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC"), SENTEVAL_NOTE),
}
MODEL_NOTE = (
    "The paper's SBERT models are BERT-base / BERT-large (110M / 340M parameters) fine-tuned on SNLI + MultiNLI "
    "(~1M pairs, 1 epoch) and, for Tables 2-4, on the task's own training data."
)


@dataclass
class ResultSet:
    label: str
    results: dict[str, dict]
    source: str
    model: str | None = None
    notes: list[str] = field(default_factory=list)


def read_results_file(spec: str) -> ResultSet:
    """``label=path.json`` or ``path.json`` (label = the file's stem)."""
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = Path(spec).stem, spec
    return ResultSet(label, json.loads(Path(path).read_text()), source=path)


def read_mlflow_run(run_id: str, tracking_uri: str) -> ResultSet:
    """A run's ``evaluation.json`` artifact; the model comes from its ``model.name`` param."""
    from sbert_ray.tracking.mlflow_run import RunLogger

    client = RunLogger(tracking_uri, run_id).client
    run = client.get_run(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        results = json.loads(Path(client.download_artifacts(run_id, "evaluation.json", tmp)).read_text())
    label = run.info.run_name or run_id
    return ResultSet(label, results, source=f"MLflow run {run_id}", model=run.data.params.get("model.name"))


def gather_result_sets(
    files: Sequence[str], run_ids: Sequence[str], tracking_uri: str | None, notes: Sequence[str] = ()
) -> list[ResultSet]:
    """The result sets to report: results files (``[LABEL=]PATH``), then MLflow runs, with each ``LABEL=TEXT`` note
    added to the first set of that label."""
    result_sets = [read_results_file(spec) for spec in files]
    result_sets += [read_mlflow_run(run_id, tracking_uri) for run_id in run_ids]
    if not result_sets:
        raise ConfigError("give at least one results file or --run")
    for note in notes:
        label, _, text = note.partition("=")
        matching = [rs for rs in result_sets if rs.label == label]
        if not matching:
            raise ConfigError(f"--note {note!r}: no results labelled {label!r}")
        matching[0].notes.append(text)
    return result_sets


def argsim_mode(metrics: dict) -> str:
    finetuned = any("train_pairs" in fold for fold in metrics.get("folds", {}).values())
    return "fine-tuned per fold" if finetuned else "unsupervised"


def our_rows(number: int, result_set: ResultSet) -> dict[str, tuple[float | None, ...]]:
    """Rows of paper table ``number`` filled from one result set (empty when it has nothing for the table)."""
    results = result_set.results
    if number in COLUMN_TABLES:
        columns, metric = COLUMN_TABLES[number]
        if not any(entry in results for entry in columns):
            return {}
        by_column = {column: results[entry][metric] for entry, column in columns.items() if entry in results}
        values = [by_column.get(column) for column in PAPER_TABLES[number].columns]
        if "Avg" in PAPER_TABLES[number].columns:  # averaged only when every dataset is there, as the paper's
            complete = len(by_column) == len(columns) and None not in by_column.values()  # null: undefined
            values[-1] = sum(by_column.values()) / len(by_column) if complete else None
        return {f"ours: {result_set.label}": tuple(values)}
    if number in ROW_TABLES:
        entries, metrics = ROW_TABLES[number]
        rows = {}
        for entry in (e for e in entries if e in results):
            mode = f", {argsim_mode(results[entry])}" if number == 3 else ""
            rows[f"ours: {result_set.label}, {entry}{mode}"] = tuple(results[entry][m] for m in metrics)
        return rows
    return {}


def _cell(value: float | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"


def table_markdown(table: PaperTable, ours: dict[str, tuple]) -> str:
    lines = [
        f"| model | {' | '.join(table.columns)} |",
        "|---|" + "---|" * len(table.columns),
    ]
    for name, values in table.rows.items():
        lines.append(f"| {name} | {' | '.join(_cell(v) for v in values)} |")
    for name, values in ours.items():
        lines.append(f"| **{name}** | {' | '.join(_cell(v) for v in values)} |")
    return "\n".join(lines)


def plot_table(table: PaperTable, ours: dict[str, tuple], path: Path) -> None:
    """Grouped bars per paper column: reference paper rows beside our rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: table.rows[name] for name in REFERENCE_ROWS.get(table.number, ())} | ours
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(table.columns) + 2), 4))
    for i, (name, values) in enumerate(series.items()):
        heights = [math.nan if v is None else v for v in values]
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(table.columns))]
        ax.bar(xs, heights, width, label=name, hatch="//" if name in ours else None)
    ax.set_xticks(range(len(table.columns)), table.columns)
    ax.set_ylabel(table.metric)
    ax.set_title(f"Table {table.number}: {table.title}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_report(result_sets: Sequence[ResultSet], out_dir: str | Path) -> Path:
    """Write ``report.md`` and ``table<N>.png`` into ``out_dir``; return the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = list(dict.fromkeys(entry for rs in result_sets for entry in rs.results))
    lines = ["# Reproduction report: Sentence-BERT (Reimers & Gurevych, EMNLP 2019)", "", "## Results compared", ""]
    for rs in result_sets:
        lines.append(
            f"- **{rs.label}** ({rs.source}{f', model {rs.model}' if rs.model else ''}): {', '.join(rs.results)}"
        )
    lines += ["", "## Differences from the paper", "", "### Data", ""]
    notes = list(dict.fromkeys(DATA_NOTES[e] for e in entries if e in DATA_NOTES))
    lines += [f"- {note}" for note in notes] or ["- none of the evaluated datasets has a known difference"]
    lines += ["", "### Models", "", f"- {MODEL_NOTE}"]
    for rs in result_sets:
        model = f"{rs.model}; " if rs.model else ""
        lines.append(f"- {rs.label}: {model}" + (" ".join(rs.notes) or "no model notes given (use --note)."))
    for number, table in PAPER_TABLES.items():
        lines += ["", f"## Table {number}: {table.title} ({table.metric})", ""]
        ours = {name: row for rs in result_sets for name, row in our_rows(number, rs).items()}
        lines.append(table_markdown(table, ours))
        if ours:
            plot_table(table, ours, out_dir / f"table{number}.png")
            lines += ["", f"![Table {number}](table{number}.png)"]
        elif number in NOT_FROM_EVALUATION:
            lines += ["", f"Not reproduced here: {NOT_FROM_EVALUATION[number]}"]
        else:
            lines += ["", "No matching results in the inputs."]
    lines += ["", "## Every number", ""]
    for rs in result_sets:
        lines += [f"### {rs.label}", "", "| entry | metric | value |", "|---|---|---|"]
        for entry, metrics in rs.results.items():
            lines += [f"| {entry} | {key} | {_cell(value)} |" for key, value in flatten(metrics, sep="/").items()]
        lines.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def log_report(report_path: Path, result_sets: Sequence[ResultSet], tracking_uri: str, experiment: str) -> str:
    """Log the report folder and every number of the results to a new MLflow run; returns the run id."""
    from sbert_ray.tracking.mlflow_run import RunTracker

    with RunTracker(tracking_uri, experiment, run_name="reproduction-report") as tracker:
        tracker.log_artifacts(report_path.parent, "report")
        tracker.log_metrics(
            {f"{rs.label}/{key}": value for rs in result_sets for key, value in flatten(rs.results, sep="/").items()}
        )
    return tracker.run_id
