"""The Hub code path on local copies of every Hub dataset we name, in each repository's own layout and schema.

`SBERT_RAY_HUB_MIRROR` points `load_hub` at <mirror>/<owner>/<name> instead of the Hub id, through the same
`datasets.load_dataset` call. Each copy below is built from a few dozen rows of ../shared/data in the file
names, configs, splits, columns, label classes and score scale of the real repository (sources cited in
sbert_ray/data/hub.py), so a renamed column, split, config or label class fails here.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import shutil
from pathlib import Path

import pytest
from datasets import ClassLabel, Dataset, Features, Value

from sbert_ray.cli import main
from sbert_ray.data import (
    DATA_DIR_ENV,
    HUB_MIRROR_ENV,
    HUB_SOURCES,
    NLI_LABELS,
    DataError,
    LabelledPair,
    Records,
    ScoredPair,
    check_available,
    load_records,
    load_sts_subsets,
    nli_triplets,
)
from sbert_ray.data.readers import _LOCAL
from sbert_ray.evaluation.sts import STS_DATASETS, STS_YEARS, evaluate_pairs, run_sts_suite
from sbert_ray.models.encoder import SentenceEncoder

ROWS = 20  # per split
HUB_NLI_CLASSES = ["entailment", "neutral", "contradiction"]  # the Hub's ClassLabel order (ids 0, 1, 2)
STRING = Value("string")
SCORED_FEATURES = {"sentence1": STRING, "sentence2": STRING, "score": Value("float64")}
NLI_FEATURES = {"premise": Value("string"), "hypothesis": Value("string"), "label": ClassLabel(names=HUB_NLI_CLASSES)}
TRIPLET_FEATURES = {"anchor": Value("string"), "positive": Value("string"), "negative": Value("string")}
MTEB_CARD = "---\nlanguage:\n- en\n---"  # the 22-byte README of every mteb/*-sts repository: no configs


def parquet(path: Path, rows: list[dict], features: dict[str, Value | ClassLabel]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows, features=Features(features)).to_parquet(path)


def jsonl_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)


def card(folder: Path, configs: dict[str, dict[str, str]]) -> None:
    """A dataset card whose `configs:` YAML maps each config's splits to file patterns, as the Hub writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {pattern}" for split, pattern in splits.items()]
    (folder / "README.md").write_text("\n".join([*lines, "---", ""]), encoding="utf-8")


def hub_nli_row(pair: LabelledPair) -> dict:
    return {"premise": pair.sentence1, "hypothesis": pair.sentence2, "label": NLI_LABELS[pair.label]}


def raw_nli_rows(path: Path, start: int) -> list[dict]:
    """ROWS rows of an SNLI/MultiNLI CSV as they are, "-" (no gold label) included."""
    with open(path, encoding="utf-8", newline="") as file:
        return list(csv.DictReader(file))[start : start + ROWS]


def write_mirror(root: Path, data: Path) -> dict[tuple[str, str], tuple[list, int]]:
    """Every Hub dataset of HUB_SOURCES under root/<owner>/<name>; returns {(name, split): (records, dropped)}."""
    expected: dict[tuple[str, str], tuple[list, int]] = {}
    snli = {split: load_records("snli", split, data) for split in ("dev", "test")}

    def triplets_from(split: str, part: int) -> Records:
        return nli_triplets(Records(snli[split][part * 3 * ROWS : (part + 1) * 3 * ROWS]))

    # sentence-transformers/stsb: data/<split>-00000-of-00001.parquet, score = STSb score / 5.
    folder = root / "sentence-transformers/stsb"
    card(folder, {"default": {s: f"data/{s}-*" for s in ("train", "validation", "test")}})
    for ours, hub in (("train", "train"), ("dev", "validation"), ("test", "test")):
        pairs = load_records("stsb", ours, data)[:ROWS]
        rows = [{"sentence1": p.sentence1, "sentence2": p.sentence2, "score": p.score / 5} for p in pairs]
        parquet(folder / f"data/{hub}-00000-of-00001.parquet", rows, SCORED_FEATURES)
        expected["stsb", ours] = (pairs, 0)

    # mteb/stsXX-sts: test.jsonl.gz (+ train.jsonl.gz for STS12) with split, sentence1, sentence2, score 0-5.
    def mteb_sts(path: str, splits: dict[str, list[ScoredPair]]) -> None:
        (root / path).mkdir(parents=True)
        (root / path / "README.md").write_text(MTEB_CARD, encoding="utf-8")
        for split, pairs in splits.items():
            rows = [
                {"split": split, "sentence1": p.sentence1, "sentence2": p.sentence2, "score": p.score} for p in pairs
            ]
            jsonl_gz(root / path / f"{split}.jsonl.gz", rows)

    for year in STS_YEARS:
        pairs = [p for subset in load_sts_subsets(year, data).values() for p in subset[:4]]
        splits = {"test": pairs}
        if year == "sts12":  # STS 2012 train pairs are not in shared/data; STSb train rows stand in
            splits["train"] = load_records("stsb", "train", data)[ROWS : 2 * ROWS]
            expected[year, "train"] = (splits["train"], 0)
        mteb_sts(f"mteb/{year}-sts", splits)
        expected[year, "test"] = (pairs, 0)
    sick = load_records("sickr", "all", data)[::500]  # all of SICK in one "test" split
    mteb_sts("mteb/sickr-sts", {"test": sick})
    expected["sickr", "all"] = (sick, 0)

    # sentence-transformers/all-nli: configs pair-class and triplet, <config>/<split>-00000-of-00001.parquet.
    folder = root / "sentence-transformers/all-nli"
    splits = ("train", "dev", "test")
    card(folder, {config: {s: f"{config}/{s}-*" for s in splits} for config in ("pair-class", "triplet")})
    for i, split in enumerate(splits):
        pairs = snli["dev"][i * ROWS : (i + 1) * ROWS]
        parquet(folder / f"pair-class/{split}-00000-of-00001.parquet", [hub_nli_row(p) for p in pairs], NLI_FEATURES)
        expected["all-nli", split] = (pairs, 0)
        triplets = triplets_from("test", i)
        parquet(
            folder / f"triplet/{split}-00000-of-00001.parquet",
            [dataclasses.asdict(t) for t in triplets],
            TRIPLET_FEATURES,
        )
        expected["nli-triplets", split] = (list(triplets), 0)

    # sentence-transformers/wikipedia-sections: configs pair and triplet, triplet/<split>-*.parquet.
    folder = root / "sentence-transformers/wikipedia-sections"
    splits = ("train", "validation", "test")
    card(folder, {config: {s: f"{config}/{s}-*" for s in splits} for config in ("pair", "triplet")})
    for i, (ours, hub) in enumerate(zip(("train", "dev", "test"), splits, strict=True)):
        triplets = triplets_from("dev", i)
        parquet(
            folder / f"triplet/{hub}-00000-of-00001.parquet",
            [dataclasses.asdict(t) for t in triplets],
            TRIPLET_FEATURES,
        )
        parquet(
            folder / f"pair/{hub}-00000-of-00001.parquet",
            [{"anchor": t.anchor, "positive": t.positive} for t in triplets],
            {"anchor": STRING, "positive": STRING},
        )
        expected["wikisec", ours] = (list(triplets), 0)

    # stanfordnlp/snli: config plain_text, plain_text/<split>-00000-of-00001.parquet, label -1 = no gold label.
    folder = root / "stanfordnlp/snli"
    splits = ("train", "validation", "test")
    card(folder, {"plain_text": {s: f"plain_text/{s}-*" for s in splits}})
    for i, (ours, hub) in enumerate(zip(("train", "dev", "test"), splits, strict=True)):
        raw = raw_nli_rows(data / "nli/snli/snli_1.0_dev.csv", 50 + i * ROWS)  # row 66 has no gold label
        rows = [
            {
                "premise": r["sentence1"],
                "hypothesis": r["sentence2"],
                "label": HUB_NLI_CLASSES.index(r["label"]) if r["label"] != "-" else -1,
            }
            for r in raw
        ]
        parquet(folder / f"plain_text/{hub}-00000-of-00001.parquet", rows, NLI_FEATURES)
        gold = [
            LabelledPair(r["sentence1"], r["sentence2"], NLI_LABELS.index(r["label"])) for r in raw if r["label"] != "-"
        ]
        expected["snli", ours] = (gold, len(raw) - len(gold))

    # nyu-mll/multi_nli: data/<split>-00000-of-00001.parquet with MultiNLI's own columns; gold rows only.
    folder = root / "nyu-mll/multi_nli"
    splits = {"train": "matched", "validation_matched": "matched", "validation_mismatched": "mismatched"}
    card(folder, {"default": {s: f"data/{s}-*" for s in splits}})
    mnli_features = {
        "promptID": Value("int32"),
        "pairID": Value("string"),
        **{f"premise{part}": Value("string") for part in ("", "_binary_parse", "_parse")},
        **{f"hypothesis{part}": Value("string") for part in ("", "_binary_parse", "_parse")},
        "genre": Value("string"),
        "label": ClassLabel(names=HUB_NLI_CLASSES),
    }
    for i, (hub, dev) in enumerate(splits.items()):
        raw = [r for r in raw_nli_rows(data / f"nli/mnli/multinli_1.0_dev_{dev}.csv", i * ROWS) if r["label"] != "-"]
        rows = [
            {
                "promptID": int(r["pairID"].rstrip("cen")),
                "pairID": r["pairID"],
                **{f"premise{part}": r["sentence1"] for part in ("", "_binary_parse", "_parse")},
                **{f"hypothesis{part}": r["sentence2"] for part in ("", "_binary_parse", "_parse")},
                "genre": "fiction",
                "label": HUB_NLI_CLASSES.index(r["label"]),
            }
            for r in raw
        ]
        parquet(folder / f"data/{hub}-00000-of-00001.parquet", rows, mnli_features)
        ours = {"train": "train", "validation_matched": "dev_matched", "validation_mismatched": "dev_mismatched"}[hub]
        expected["mnli", ours] = (
            [LabelledPair(r["sentence1"], r["sentence2"], NLI_LABELS.index(r["label"])) for r in raw],
            0,
        )
    return expected


@pytest.fixture(scope="module")
def mirror(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("hub-mirror")
    return root, write_mirror(root, data_dir)


@pytest.fixture
def hub_env(mirror, monkeypatch):
    """No data directory, and the mirror in place of the Hub."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(HUB_MIRROR_ENV, str(mirror[0]))
    return mirror


def assert_same_records(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if isinstance(b, ScoredPair):  # back on the local scale (STSb: x 5), up to float rounding
            assert (a.sentence1, a.sentence2) == (b.sentence1, b.sentence2)
            assert a.score == pytest.approx(b.score, abs=1e-9)
        else:
            assert a == b


def test_mirror_covers_every_hub_source_and_split(mirror):
    assert set(mirror[1]) == {(name, split) for name, source in HUB_SOURCES.items() for split in source.splits}


@pytest.mark.parametrize(
    ("name", "split"), [(name, split) for name, source in HUB_SOURCES.items() for split in source.splits]
)
def test_every_hub_dataset_loads_from_its_repository_layout(hub_env, name, split):
    records = load_records(name, split)
    want, dropped = hub_env[1][name, split]
    assert_same_records(records, want)
    assert records.dropped == dropped
    assert check_available(name, split) == str(hub_env[0] / HUB_SOURCES[name].path)


def rewrite_jsonl_gz(path: Path, change) -> None:
    with gzip.open(path, "rt", encoding="utf-8") as file:
        rows = [change(json.loads(line)) for line in file]
    jsonl_gz(path, rows)


def rename_score(row: dict) -> dict:
    row["similarity"] = row.pop("score")
    return row


def rewrite_parquet(folder: Path, change) -> None:
    """change(rows, features) -> (rows, features) on every parquet file below `folder` (all splits alike)."""
    for path in folder.glob("**/*.parquet"):
        dataset = Dataset.from_parquet(str(path))
        parquet(path, *change(dataset.to_list(), dict(dataset.features)))


def relabel_classes(names: list[str]):
    return lambda rows, features: (rows, {**features, "label": ClassLabel(names=names)})


def rename_premise(rows: list[dict], features: dict) -> tuple[list[dict], dict]:
    def renamed(mapping: dict) -> dict:
        return {("sentence1" if key == "premise" else key): value for key, value in mapping.items()}

    return [renamed(row) for row in rows], renamed(features)


def edit_card(old: str, new: str):
    def edit(folder: Path) -> None:
        readme = folder / "README.md"
        readme.write_text(readme.read_text().replace(old, new))

    return edit


@pytest.mark.parametrize(
    ("name", "split", "path", "change", "message"),
    [
        (
            "sts13",
            "test",
            "mteb/sts13-sts",
            lambda f: rewrite_jsonl_gz(f / "test.jsonl.gz", rename_score),
            r"no column score \(columns: split, sentence1, sentence2, similarity\)",
        ),
        (
            "sts14",
            "test",
            "mteb/sts14-sts",
            lambda f: (f / "test.jsonl.gz").rename(f / "dev.jsonl.gz"),
            "no split 'test'",
        ),
        (
            "snli",
            "dev",
            "stanfordnlp/snli",
            edit_card("split: validation", "split: dev"),
            "no split 'validation'",
        ),
        (
            "all-nli",
            "test",
            "sentence-transformers/all-nli",
            edit_card("name: pair-class", "name: pair_class"),
            "BuilderConfig 'pair-class' not found",
        ),
        (
            "all-nli",
            "test",
            "sentence-transformers/all-nli",
            lambda f: rewrite_parquet(f / "pair-class", relabel_classes(["entails", "neutral", "contradicts"])),
            "'label' must be a ClassLabel over",
        ),
        (
            "mnli",
            "dev_matched",
            "nyu-mll/multi_nli",
            lambda f: rewrite_parquet(f, rename_premise),
            "no column premise",
        ),
    ],
)
def test_a_renamed_column_split_config_or_class_fails(
    hub_env, tmp_path, monkeypatch, name, split, path, change, message
):
    copy = tmp_path / "mirror"
    shutil.copytree(hub_env[0] / path, copy / path)
    monkeypatch.setenv(HUB_MIRROR_ENV, str(copy))
    assert len(load_records(name, split)) > 0  # the untouched copy loads
    change(copy / path)
    with pytest.raises(DataError, match=message):
        load_records(name, split)


def test_hub_class_order_is_read_by_name(hub_env, tmp_path, monkeypatch):
    path = "sentence-transformers/all-nli"
    shutil.copytree(hub_env[0] / path, tmp_path / path)
    renamed = ["neutral", "contradiction", "entailment"]  # new names for the class ids 0, 1, 2
    rewrite_parquet(tmp_path / path / "pair-class", relabel_classes(renamed))
    monkeypatch.setenv(HUB_MIRROR_ENV, str(tmp_path))
    hub_ids = [HUB_NLI_CLASSES.index(NLI_LABELS[p.label]) for p in hub_env[1]["all-nli", "test"][0]]
    assert [p.label for p in load_records("all-nli", "test")] == [NLI_LABELS.index(renamed[i]) for i in hub_ids]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return SentenceEncoder.load(str(tiny_model_dir))


def test_sts_suite_without_a_data_directory_scores_each_year_as_one_set(
    hub_env, tiny, tiny_model_dir, tmp_path, capsys
):
    results = run_sts_suite(tiny)
    assert list(results) == list(STS_DATASETS)
    for name in STS_DATASETS:
        split = "all" if name == "sickr" else "test"
        pairs = hub_env[1][name, split][0]
        assert results[name]["n"] == len(pairs)
        assert "subsets" not in results[name]  # the Hub rows name no sub-set
        assert results[name]["spearman_cosine"] == pytest.approx(
            evaluate_pairs(tiny, pairs)["spearman_cosine"], abs=1e-9
        )
    # The reported defect: `sbert-ray eval --tasks sts` without a data directory.
    output = tmp_path / "results.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", "sts", "--output", str(output)]) == 0
    assert "data: Hugging Face Hub" in capsys.readouterr().out
    written = json.loads(output.read_text())
    assert {name: entry["n"] for name, entry in written.items()} == {name: m["n"] for name, m in results.items()}


def test_offline_without_data_dir_or_mirror_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.delenv(HUB_MIRROR_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        DataError, match=r"'sts12' \(mteb/sts12-sts\) needs the Hugging Face Hub, which is unreachable.*--data-dir"
    ):
        check_available("sts12", "test")
    with pytest.raises(DataError, match="needs the Hugging Face Hub"):
        load_records("stsb", "test")  # before datasets retries the Hub


def test_mirror_without_the_dataset_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(HUB_MIRROR_ENV, str(tmp_path))
    with pytest.raises(
        DataError, match=f"has no copy of mteb/sts16-sts for 'sts16' \\(expected {tmp_path}/mteb/sts16-sts\\)"
    ):
        check_available("sts16", "test")


def test_data_dir_missing_a_file_names_it(data_dir, tmp_path):
    shutil.copytree(data_dir / "stsb", tmp_path / "stsb", ignore=shutil.ignore_patterns("sts-test.csv"))
    assert check_available("stsb", "train", tmp_path) == str(tmp_path)
    with pytest.raises(
        DataError, match=f"'stsb' split 'test' needs {tmp_path}/stsb/sts-test.csv, which does not exist"
    ):
        check_available("stsb", "test", tmp_path)
    folder = "sts12-16/STS13-en-test"
    shutil.copytree(data_dir / folder, tmp_path / folder, ignore=shutil.ignore_patterns("STS.gs.headlines.txt"))
    with pytest.raises(DataError, match=f"needs {tmp_path}/{folder}/STS.gs.headlines.txt"):
        check_available("sts13", "test", tmp_path)
    with pytest.raises(DataError, match="no split 'dev'"):
        check_available("sts13", "dev", tmp_path)


@pytest.mark.parametrize(
    ("name", "split"),
    [("stsb", s) for s in ("train", "dev", "test")]
    + [("sickr", s) for s in ("train", "trial", "test", "all")]
    + [(year, "test") for year in STS_YEARS]
    + [("snli", "dev"), ("mnli", "dev_mismatched"), ("snli-senteval", "test"), ("xnli", "dev"), ("cad-snli", "train")]
    + [("nli-offline", "train"), ("nli-triplets", "test"), ("ukp-aspect", "fold2/dev"), ("bws", "all")],
)
def test_files_checked_are_the_files_read(data_dir, name, split, monkeypatch):
    """check_available looks at exactly the files the reader opens (every local dataset except wikisec,
    which shared/data lacks)."""
    opened = set()
    real_open = open

    def recording_open(path, *args, **kwargs):
        opened.add(Path(path).resolve())
        return real_open(path, *args, **kwargs)

    assert check_available(name, split, data_dir) == str(data_dir)
    monkeypatch.setattr("builtins.open", recording_open)
    load_records(name, split, data_dir)
    assert opened == {(data_dir / file).resolve() for file in _LOCAL[name].files(split)}
