"""Hub retrieval sets on local copies in each publisher's own layout (SBERT_RAY_HUB_MIRROR, as tests/test_hub.py):
NanoBEIR (zeta-alpha-ai/Nano*), mteb/<set> and BeIR/<set> with BeIR/<set>-qrels. Each copy holds the same
retrieval set (built from STSb dev) in the repository's files, configs, splits and column names, so a renamed
config, split or column fails here; numeric ids in a TSV and an empty document are in it too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Value
from test_hub import card, parquet

from sbert_ray.config import ConfigError
from sbert_ray.data import HUB_MIRROR_ENV, load_records
from sbert_ray.data.records import DataError
from sbert_ray.data.retrieval_hub import read_hub_retrieval
from sbert_ray.data.retrieval_sets import RetrievalSet, stsb_retrieval
from sbert_ray.evaluation.retrieval import evaluate_retrieval
from sbert_ray.evaluation.tasks import EvalTasks, parse_tasks
from sbert_ray.models.encoder import SentenceEncoder

TEXT = {"_id": Value("string"), "text": Value("string")}
TITLED = {"_id": Value("string"), "title": Value("string"), "text": Value("string")}


@pytest.fixture(scope="module")
def expected(data_dir) -> RetrievalSet:
    """The set every copy holds; ids made numeric (BEIR's often are: a TSV reads them as numbers)."""
    data = stsb_retrieval(load_records("stsb", "dev", data_dir)[:200])
    number = {key: str(1000 + k) for k, key in enumerate([*data.queries, *data.corpus])}
    return RetrievalSet(
        {number[key]: text for key, text in data.queries.items()},
        {number[key]: text for key, text in data.corpus.items()},
        {number[key]: {number[doc] for doc in docs} for key, docs in data.relevant.items()},
    )


def qrels_rows(data: RetrievalSet) -> list[dict]:
    rows = [{"query-id": q, "corpus-id": d, "score": 1} for q, docs in sorted(data.relevant.items()) for d in docs]
    return [*rows, {"query-id": rows[0]["query-id"], "corpus-id": next(iter(data.corpus)), "score": 0}]


def jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory, expected) -> Path:
    root = tmp_path_factory.mktemp("hub-mirror")
    corpus = [{"_id": key, "text": text} for key, text in expected.corpus.items()]
    queries = [{"_id": key, "text": text} for key, text in expected.queries.items()]
    # Titles split off the first document's text: title + " " + text gives it back.
    title, _, rest = corpus[0]["text"].partition(" ")
    titled = [{"_id": corpus[0]["_id"], "title": title, "text": rest}] + [{**row, "title": ""} for row in corpus[1:]]

    # zeta-alpha-ai/NanoMSMARCO: configs corpus / queries / qrels, one train split each, parquet; an empty document.
    nano = root / "zeta-alpha-ai" / "NanoMSMARCO"
    card(nano, {name: {"train": f"{name}/train-*"} for name in ("corpus", "queries", "qrels")})
    parquet(nano / "corpus" / "train-00000-of-00001.parquet", [*corpus, {"_id": "999", "text": ""}], TEXT)
    parquet(nano / "queries" / "train-00000-of-00001.parquet", queries, TEXT)
    parquet(
        nano / "qrels" / "train-00000-of-00001.parquet",
        [row for row in qrels_rows(expected) if row["score"] > 0],
        {"query-id": Value("string"), "corpus-id": Value("string"), "score": Value("int64")},
    )

    # mteb/scifact: corpus.jsonl, queries.jsonl, qrels/<split>.jsonl under configs corpus / queries / default.
    mteb = root / "mteb" / "scifact"
    card(
        mteb,
        {
            "default": {"test": "qrels/test.jsonl", "train": "qrels/train.jsonl"},
            "corpus": {"corpus": "corpus.jsonl"},
            "queries": {"queries": "queries.jsonl"},
        },
    )
    jsonl(mteb / "corpus.jsonl", titled)
    jsonl(mteb / "queries.jsonl", queries)
    jsonl(mteb / "qrels" / "test.jsonl", qrels_rows(expected))
    jsonl(mteb / "qrels" / "train.jsonl", qrels_rows(expected)[:1])

    # BeIR/scifact (configs corpus / queries with splits of the same names) and BeIR/scifact-qrels (test.tsv).
    beir = root / "BeIR" / "scifact"
    card(beir, {"corpus": {"corpus": "corpus/corpus-*"}, "queries": {"queries": "queries/queries-*"}})
    parquet(beir / "corpus" / "corpus-00000-of-00001.parquet", titled, TITLED)
    parquet(beir / "queries" / "queries-00000-of-00001.parquet", [{**row, "title": ""} for row in queries], TITLED)
    qrels = root / "BeIR" / "scifact-qrels"
    qrels.mkdir(parents=True)
    (qrels / "README.md").write_text("---\nlicense: cc-by-sa-4.0\n---\n", encoding="utf-8")  # no configs
    lines = [
        "query-id\tcorpus-id\tscore",
        *(f"{r['query-id']}\t{r['corpus-id']}\t{r['score']}" for r in qrels_rows(expected)),
    ]
    (qrels / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.mark.parametrize("repo", ["zeta-alpha-ai/NanoMSMARCO", "mteb/scifact", "BeIR/scifact"])
def test_each_layout_reads_as_the_same_retrieval_set(mirror, expected, monkeypatch, repo):
    monkeypatch.setenv(HUB_MIRROR_ENV, str(mirror))
    assert read_hub_retrieval(repo) == expected


def test_hub_tasks_score_the_set_under_its_name(mirror, expected, monkeypatch, tiny_model_dir):
    monkeypatch.setenv(HUB_MIRROR_ENV, str(mirror))
    tiny = SentenceEncoder.load(str(tiny_model_dir))
    reference = evaluate_retrieval(tiny, expected)
    [nano, mteb] = parse_tasks("nanobeir:msmarco,retrieval:mteb/scifact")
    EvalTasks([nano, mteb]).check(None)
    assert nano.run(tiny) == {f"NanoMSMARCO/{key}": value for key, value in reference.items()}
    assert mteb.run(tiny)["scifact/ndcg_at_10_cosine"] == reference["ndcg_at_10_cosine"]
    [train] = parse_tasks("retrieval:mteb/scifact:train")
    assert train.run(tiny)["scifact-train/queries"] == 1


def test_hub_names_and_splits_are_checked(mirror, monkeypatch):
    with pytest.raises(ConfigError, match="unknown NanoBEIR set 'msmarc'; choose from climatefever"):
        parse_tasks("nanobeir:msmarc")
    with pytest.raises(ConfigError, match="zeta-alpha-ai/NanoNQ has no split 'dev'; choose one of test"):
        parse_tasks("retrieval:zeta-alpha-ai/NanoNQ:dev")
    monkeypatch.setenv(HUB_MIRROR_ENV, str(mirror))
    [missing] = parse_tasks("nanobeir:nq")
    with pytest.raises(ConfigError, match=f"--tasks: task 'nanobeir:nq': {HUB_MIRROR_ENV}=.* has no copy of "):
        EvalTasks([missing]).check(None)
    with pytest.raises(DataError, match="BeIR/scifact-qrels .*split.*dev"):
        read_hub_retrieval("BeIR/scifact", "dev")  # the qrels repository has test.tsv only
