"""Benchmark records out: a printed table, a bar chart, JSON, and an MLflow run holding all of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sbert_ray.files import json_text

COLUMNS = (  # (header, record key, format)
    ("impl", "impl", "{}"),
    ("precision", "precision", "{}"),
    ("cast", "cast", "{}"),
    ("sorted", "smart_batching", "{}"),
    ("batch", "batch_size", "{}"),
    ("sent/s", "sentences_per_s", "{:.0f}"),
    ("spread", "spread", "{:.0%}"),
    ("x ST fp32", "speedup_vs_reference_fp32", "{:.2f}"),
    ("x fastest ST", "speedup_vs_fastest_reference", "{:.2f}"),
    ("x unsorted", "smart_batching_speedup", "{:.2f}"),
    ("sent/cpu-s", "sentences_per_cpu_s", "{:.0f}"),
    ("x ST (cpu)", "speedup_vs_reference_fp32_cpu", "{:.2f}"),
    ("x unsorted (cpu)", "smart_batching_speedup_cpu", "{:.2f}"),
    ("pad", "padding_share", "{:.1%}"),
    ("GFLOP/s", "achieved_gflops", "{:.1f}"),
    ("util", "utilisation", "{:.1%}"),
    ("STSb", "spearman", "{:.2f}"),
)

LOGGED_METRICS = (
    "sentences_per_s",
    "sentences_per_cpu_s",
    "speedup_vs_reference_fp32",
    "speedup_vs_fastest_reference",
    "utilisation",
    "spearman",
)


def label(record: dict) -> str:
    how = record["precision"] if record["cast"] == "none" else f"{record['precision']}-{record['cast']}"
    order = "sorted" if record["smart_batching"] else "unsorted"
    return f"{record['impl']}/{how}/{order}/bs{record['batch_size']}"


def format_table(records: Sequence[dict], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    """One row per record, ``columns`` as (header, record key, format); spread is (max - min) / median of the
    repeats' rates."""
    rows = [[header for header, _, _ in columns]]
    for record in records:
        rows.append(["-" if record.get(key) is None else fmt.format(record[key]) for _, key, fmt in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def bar_chart(records: Sequence[dict], title: str):
    """Horizontal bars of the median rate with min-max whiskers, one per record; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if not r.get("skipped")]  # rows that could not run have no rates
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(records) + 1.5))
    rates = [r["sentences_per_s"] for r in records]
    whiskers = [
        [rate - r["sentences_per_s_min"] for rate, r in zip(rates, records, strict=True)],
        [r["sentences_per_s_max"] - rate for rate, r in zip(rates, records, strict=True)],
    ]
    colours = ["tab:blue" if r["impl"] == "sbert-ray" else "tab:gray" for r in records]
    ax.barh(range(len(records)), rates, xerr=whiskers, color=colours, capsize=3)
    ax.set_yticks(range(len(records)), [label(r) for r in records], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("sentences / s (median of repeats, min-max whiskers)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def log_bench(records: Sequence[dict], kind: str, params: dict, tracking_uri: str, experiment: str) -> str:
    """One MLflow run: params, headline metrics per record, the records as JSON and the chart; returns its id."""
    import matplotlib.pyplot as plt

    from sbert_ray.tracking.mlflow_run import RunTracker, environment_tags

    with RunTracker(tracking_uri, experiment, run_name=f"bench-{kind}") as tracker:
        tracker.set_tags(environment_tags())
        tracker.log_params(params)
        metrics = {
            f"{label(record)}/{key}": record[key]
            for record in records
            for key in LOGGED_METRICS
            if record.get(key) is not None
        }
        tracker.log_metrics(metrics)
        tracker.log_text(json_text(list(records)), f"bench_{kind}.json")
        figure = bar_chart(records, f"sbert-ray bench {kind}: {params.get('model', '')}")
        tracker.log_figure(figure, f"bench_{kind}.png")
        plt.close(figure)
    return tracker.run_id


def log_records(
    records: Sequence[dict],
    kind: str,
    name_of: Callable[[dict], str],
    metrics: Sequence[str],
    params: dict,
    tracking_uri: str,
    experiment: str,
) -> str:
    """One MLflow run ``bench-<kind>``: params, ``metrics`` of each record under ``name_of(record)``, the records as
    JSON; returns its id."""
    from sbert_ray.tracking.mlflow_run import RunTracker, environment_tags

    with RunTracker(tracking_uri, experiment, run_name=f"bench-{kind}") as tracker:
        tracker.set_tags(environment_tags())
        tracker.log_params(params)
        tracker.log_metrics(
            {f"{name_of(r)}/{key}": r[key] for r in records for key in metrics if r.get(key) is not None}
        )
        tracker.log_text(json_text(list(records)), f"bench_{kind}.json")
        return tracker.run_id
