"""Readers for every local data format, the user's own files, and `load_records` by dataset name.

The data directory comes from `--data-dir` or `$SBERT_RAY_DATA_DIR`; with neither, `load_records` reads the
Hugging Face Hub (see `hub.py`). Every reader returns `Records` (a list that also counts skipped and dropped
rows). A bad row is a `DataError` naming file and line, or with errors="skip" a counted, logged skip.

File quirks handled here (see each folder's SOURCE.md): TAB files are split on TAB with no quote handling
(STSb, SICK, STS, XNLI, CAD-SNLI, UKP ASPECT contain stray `"`); CRLF line ends are stripped; CSV files
(SNLI/MultiNLI, BWS) use strict RFC-4180 quoting (a broken quote stops the read at its line rather than swallowing
the rows after it); blank lines are not rows. Bytes that are not UTF-8 make their row a bad row (file and line),
and every score must lie on its source's declared scale.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TextIO, TypeVar

from sbert_ray.data.hub import HUB_SOURCES, check_hub, load_hub
from sbert_ray.data.records import (
    NLI_LABEL_IDS,
    NLI_LABELS,
    RECORD_TYPES,
    DataError,
    Errors,
    Kind,
    Record,
    RecordCollector,
    Records,
    RowError,
    Triplet,
    make_record,
)

DATA_DIR_ENV = "SBERT_RAY_DATA_DIR"
T = TypeVar("T")

# Declared score scales (each folder's SOURCE.md), both ends included. UKP ASPECT's scores come from
# UKP_ASPECT_SCORES (0-3) and cannot leave it.
STS_SCALE = (0.0, 5.0)  # STSb and STS12-16
SICK_SCALE = (1.0, 5.0)
BWS_SCALE = (0.0, 1.0)

STS_SUBSETS: dict[str, tuple[str, ...]] = {
    "sts12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "sts13": ("FNWN", "OnWN", "headlines"),  # without SMT (LDC-licensed), as SentEval and SBERT
    "sts14": ("OnWN", "deft-forum", "deft-news", "headlines", "images", "tweet-news"),
    "sts15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "sts16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}

# UKP ASPECT labels as a graded similarity (our choice; SOURCE.md leaves it open): highly / somewhat /
# not similar / different topic or can't decide.
UKP_ASPECT_SCORES: dict[object, float] = {"HS": 3.0, "SS": 2.0, "NS": 1.0, "DTORCD": 0.0}

# The official 4-fold cross-topic split (UKPLab acl2019 make_splits.py); train = the other 17 topics.
UKP_ASPECT_FOLDS: tuple[dict[str, tuple[str, ...]], ...] = (
    {
        "test": (
            "Tissue engineering",
            "Big data",
            "Fracking",
            "Social networks",
            "Net neutrality",
            "Hydroelectric dams",
            "Internet of things",
        ),
        "dev": ("Hydrogen fuel cells", "Electronic voting", "Drones", "Solar energy"),
    },
    {
        "test": (
            "Nanotechnology",
            "Geoengineering",
            "Recycling",
            "Offshore drilling",
            "Robotic surgery",
            "Cloud storing",
            "Stem cell research",
        ),
        "dev": ("Net neutrality", "Internet of things", "Hydrogen fuel cells", "Social networks"),
    },
    {
        "test": (
            "Wind power",
            "Cryptocurrency",
            "Virtual reality",
            "Public surveillance",
            "Drones",
            "Organ donation",
            "Electric cars",
        ),
        "dev": ("Gene editing", "Solar energy", "Social networks", "3d printing"),
    },
    {
        "test": (
            "3d printing",
            "Gene editing",
            "Hydrogen fuel cells",
            "Gmo",
            "Solar energy",
            "Electronic voting",
            "Genetic diagnosis",
        ),
        "dev": ("Cryptocurrency", "Hydroelectric dams", "Geoengineering", "Internet of things"),
    },
)

# XNLI label ids (Hugging Face convention) -> our NLI_LABELS indices.
XNLI_LABEL_IDS: dict[object, int] = {
    str(index): NLI_LABEL_IDS[name] for index, name in enumerate(("entailment", "neutral", "contradiction"))
}

_NLI_CSV_COLUMNS = {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"}


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The data directory: the argument, else $SBERT_RAY_DATA_DIR, else None (= use the Hub)."""
    chosen, origin = (data_dir, "--data-dir") if data_dir else (os.environ.get(DATA_DIR_ENV), DATA_DIR_ENV)
    if not chosen:
        return None
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise DataError(f"data directory {path} (from {origin}) does not exist")
    return path


# --- raw rows ---------------------------------------------------------------------------------------------


def _open(path: Path, newline: str) -> TextIO:
    try:
        return open(path, encoding="utf-8-sig", errors="surrogateescape", newline=newline)
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"{path}: no such file") from None


def _lines(path: Path) -> Iterator[str]:
    """Every line without its LF or CRLF ending; only LF splits (a stray CR inside text stays text). Bytes that
    are not UTF-8 are kept as surrogate escapes, so the row holding them fails with its line number."""
    with _open(path, newline="\n") as file:
        for line in file:
            yield line.removesuffix("\n").removesuffix("\r")


def _tab_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of a TAB file read without quote handling."""
    for number, line in enumerate(_lines(path), start=1):
        if line:
            yield number, line.split("\t")


def _csv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number where the record starts, fields) of an RFC-4180 CSV file. A quoting error or an over-long
    field (csv.field_size_limit) stops the read even with errors="skip": the parser has lost its place in the
    file, so the rows after it cannot be trusted."""
    with _open(path, newline="") as file:
        reader = csv.reader(file, strict=True)
        start = 1
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                raise DataError(f"{path}, line {start}: broken CSV ({error})") from None
            if fields:
                yield start, fields
            start = reader.line_num + 1


def _named(fields: list[str], names: list[str]) -> dict[str, str]:
    if len(fields) != len(names):
        raise RowError(f"expected {len(names)} fields, got {len(fields)}")
    return dict(zip(names, fields, strict=True))


def _named_record(
    kind: Kind,
    fields: list[str],
    names: list[str],
    columns: Mapping[str, str],
    values: Mapping[object, float | int] | None,
    score_range: tuple[float, float] | None,
) -> Record:
    return make_record(kind, _named(fields, names), columns, values, score_range)


def _read_table(
    path: Path,
    rows: Iterable[tuple[int, list[str]]],
    kind: Kind,
    columns: Mapping[str, str],
    values: Mapping[object, float | int] | None = None,
    errors: Errors = "raise",
    drop: tuple[str, str] | None = None,
    score_range: tuple[float, float] | None = None,
) -> Records:
    """Records from a table whose first row names the columns; `drop` = (column, value) rows to drop."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        raise DataError(f"{path}: empty file, expected a header line")
    header_line, names = first
    for field in dataclasses.fields(RECORD_TYPES[kind]):
        key = columns.get(field.name, field.name)
        if key not in names:
            raise DataError(f"{path}, line {header_line}: no column {key!r} for {field.name} (columns: {names})")
    drop_index = names.index(drop[0]) if drop else None
    collector = RecordCollector(str(path), errors)
    for line, fields in rows:
        if drop and len(fields) == len(names) and fields[drop_index] == drop[1]:
            collector.drop(f"{drop[0]} {drop[1]!r}")
            continue
        collector.add(line, _named_record, kind, fields, names, columns, values, score_range)
    return collector.finish()


# --- one reader per local format ----------------------------------------------------------------------------


def _stsb_record(fields: list[str]) -> Record:
    # genre, filename, year, id, score, sentence1, sentence2 [, source1, source2]
    if len(fields) not in (7, 9):
        raise RowError(f"expected 7 or 9 TAB-separated fields, got {len(fields)}")
    return make_record(
        "scored", {"score": fields[4], "sentence1": fields[5], "sentence2": fields[6]}, score_range=STS_SCALE
    )


def read_stsb(path: Path, errors: Errors = "raise") -> Records:
    """STS benchmark sts-{train,dev,test}.csv: TAB, no header, score 0-5 in column 5."""
    collector = RecordCollector(str(path), errors)
    for line, fields in _tab_rows(Path(path)):
        collector.add(line, _stsb_record, fields)
    return collector.finish()


def read_sick(path: Path, errors: Errors = "raise") -> Records:
    """SICK_{train,trial,test_annotated}.txt: relatedness score 1-5 as ScoredPair."""
    columns = {"sentence1": "sentence_A", "sentence2": "sentence_B", "score": "relatedness_score"}
    return _read_table(Path(path), _tab_rows(Path(path)), "scored", columns, errors=errors, score_range=SICK_SCALE)


def _sts_record(pair: str, gold: str, gold_name: str) -> Record:
    fields = pair.split("\t")
    if len(fields) != 2:
        raise RowError(f"expected 2 TAB-separated sentences, got {len(fields)} fields")
    key = f"gold score ({gold_name})"  # so a bad score names the file it is in
    row = {"sentence1": fields[0], "sentence2": fields[1], key: gold}
    return make_record("scored", row, {"score": key}, score_range=STS_SCALE)


def read_sts_subset(folder: Path, subset: str, errors: Errors = "raise") -> Records:
    """STS.input.<subset>.txt + STS.gs.<subset>.txt; pairs with an empty gold line are unscored and dropped."""
    inputs, gold = Path(folder) / f"STS.input.{subset}.txt", Path(folder) / f"STS.gs.{subset}.txt"
    pairs, scores = list(_lines(inputs)), list(_lines(gold))
    if len(pairs) != len(scores):
        raise DataError(f"{inputs} has {len(pairs)} lines but {gold} has {len(scores)}; they must align")
    collector = RecordCollector(str(inputs), errors)
    for number, (pair, score) in enumerate(zip(pairs, scores, strict=True), start=1):
        if not score.strip():
            collector.drop(f"no gold score in {gold.name}")
            continue
        collector.add(number, _sts_record, pair, score, gold.name)
    return collector.finish()


def read_nli_csv(path: Path, errors: Errors = "raise") -> Records:
    """SNLI / MultiNLI CSV (pairID, sentence1, sentence2, label); "-" (no gold label) rows are dropped."""
    rows = _csv_rows(Path(path))
    return _read_table(Path(path), rows, "labelled", _NLI_CSV_COLUMNS, errors=errors, drop=("label", "-"))


def _senteval_record(premise: str, hypothesis: str, label: str) -> Record:
    return make_record("labelled", {"sentence1": premise, "sentence2": hypothesis, "label": label})


def read_senteval_nli(folder: Path, split: str, errors: Errors = "raise") -> Records:
    """SentEval SNLI: aligned s1.<split>, s2.<split>, labels.<split> (tokenized, gold rows only)."""
    paths = [Path(folder) / f"{stem}.{split}" for stem in ("s1", "s2", "labels")]
    columns = [list(_lines(path)) for path in paths]
    if len({len(column) for column in columns}) != 1:
        counts = ", ".join(f"{path.name} {len(column)}" for path, column in zip(paths, columns, strict=True))
        raise DataError(f"{folder}: s1/s2/labels.{split} must have equal line counts, got {counts}")
    collector = RecordCollector(str(Path(folder) / f"{{s1,s2,labels}}.{split}"), errors)
    for number, row in enumerate(zip(*columns, strict=True), start=1):
        collector.add(number, _senteval_record, *row)
    return collector.finish()


def read_xnli(path: Path, errors: Errors = "raise") -> Records:
    """XNLI-en TSV (id, premise, hypothesis, label 0=entailment 1=neutral 2=contradiction)."""
    columns = {"sentence1": "premise", "sentence2": "hypothesis"}
    return _read_table(Path(path), _tab_rows(Path(path)), "labelled", columns, XNLI_LABEL_IDS, errors)


def read_cad_snli(path: Path, errors: Errors = "raise") -> Records:
    """Counterfactually-augmented SNLI TSV (sentence1, sentence2, gold_label as a word)."""
    columns = {"label": "gold_label"}
    return _read_table(Path(path), _tab_rows(Path(path)), "labelled", columns, errors=errors)


def read_ukp_aspect(path: Path, errors: Errors = "raise") -> Records:
    """UKP_ASPECT.tsv as TopicPair, label mapped to a score by UKP_ASPECT_SCORES."""
    columns = {"sentence1": "sentence_1", "sentence2": "sentence_2", "score": "label"}
    return _read_table(Path(path), _tab_rows(Path(path)), "topic", columns, UKP_ASPECT_SCORES, errors)


def read_bws(path: Path, errors: Errors = "raise") -> Records:
    """BWS_corpus.csv as TopicPair with score = regression_label (0-1)."""
    columns = {"sentence1": "sentence_1", "sentence2": "sentence_2", "score": "regression_label"}
    return _read_table(Path(path), _csv_rows(Path(path)), "topic", columns, errors=errors, score_range=BWS_SCALE)


def read_wikisec_csv(path: Path, errors: Errors = "raise") -> Records:
    """Wikipedia-sections triplets CSV (Dor et al. 2018 release) with Sentence1/2/3 = anchor/positive/negative."""
    columns = {"anchor": "Sentence1", "positive": "Sentence2", "negative": "Sentence3"}
    return read_user_file(path, "triplet", columns, errors)


def _json_record(
    text: str,
    kind: Kind,
    columns: Mapping[str, str],
    values: Mapping[object, float | int] | None,
    score_range: tuple[float, float] | None,
) -> Record:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        raise RowError(f"invalid JSON ({error.msg})") from None
    except RecursionError:
        raise RowError("invalid JSON (nested too deeply)") from None
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    return make_record(kind, row, columns, values, score_range)


def read_user_file(
    path: str | os.PathLike,
    kind: Kind,
    columns: Mapping[str, str] | None = None,
    errors: Errors = "raise",
    labels: Mapping[object, int] | None = None,
    score_range: tuple[float, float] | None = None,
) -> Records:
    """The user's own .csv (RFC-4180), .tsv (TAB, no quoting) or .jsonl file with named columns.

    kind: "scored" | "labelled" | "triplet" | "pair" | "topic". columns: record field -> column name, e.g.
    {"sentence1": "premise", "sentence2": "hypothesis", "label": "gold"}; unlisted fields use their own name.
    labels: raw label -> class index (default: the NLI_LABELS words); scores must be numbers.
    score_range: the file's score scale (low, high), both included; training passes [0, the stage's score_max].
    """
    path = Path(path)
    if kind not in RECORD_TYPES:
        raise DataError(f"{path}: unknown record kind {kind!r} (choose one of {', '.join(RECORD_TYPES)})")
    columns = dict(columns or {})
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _read_table(path, _csv_rows(path), kind, columns, labels, errors, score_range=score_range)
    if suffix == ".tsv":
        return _read_table(path, _tab_rows(path), kind, columns, labels, errors, score_range=score_range)
    if suffix == ".jsonl":
        collector = RecordCollector(str(path), errors)
        for number, line in enumerate(_lines(path), start=1):
            if line.strip():
                collector.add(number, _json_record, line, kind, columns, labels, score_range)
        return collector.finish()
    raise DataError(f"{path}: unsupported file type {suffix!r} (use .csv, .tsv or .jsonl)")


def user_file_columns(path: str | os.PathLike) -> list[str]:
    """The columns a user file names: its header (.csv, .tsv) or the keys of its first JSON object (.jsonl); []
    for an empty or unreadable start, which ``read_user_file`` then reports with its line."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        first = next(_csv_rows(path) if suffix == ".csv" else _tab_rows(path), None)
        return first[1] if first else []
    first = next((line for line in _lines(path) if line.strip()), "")
    with contextlib.suppress(json.JSONDecodeError, RecursionError):
        row = json.loads(first)
        return list(row) if isinstance(row, dict) else []
    return []


def nli_triplets(pairs: Records) -> Records:
    """(premise, entailed hypothesis, contradicting hypothesis) triplets from labelled NLI pairs.

    Pairs are grouped by premise text; every entailment x contradiction combination of a premise becomes one
    triplet (premises in first-seen order). Premises lacking either label give none; neutral pairs are unused.
    """
    entailment, contradiction = NLI_LABELS.index("entailment"), NLI_LABELS.index("contradiction")
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for pair in pairs:
        positives, negatives = groups.setdefault(pair.sentence1, ([], []))
        if pair.label == entailment:
            positives.append(pair.sentence2)
        elif pair.label == contradiction:
            negatives.append(pair.sentence2)
    triplets = (
        Triplet(premise, positive, negative)
        for premise, (positives, negatives) in groups.items()
        for positive in positives
        for negative in negatives
    )
    return Records(triplets, skipped=pairs.skipped, dropped=pairs.dropped)


# --- dataset names -> local files ---------------------------------------------------------------------------


def _choose(name: str, split: str, choices: Mapping[str, T]) -> T:
    if split not in choices:
        raise DataError(f"local dataset {name!r} has no split {split!r}; choose one of {', '.join(choices)}")
    return choices[split]


_STSB_FILES = {"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test.csv"}
# "dev" aliases SICK's trial split; "all" = train + trial + test (what mteb/sickr-sts calls "test").
_SICK_FILES = {
    "train": ("SICK_train.txt",),
    "trial": ("SICK_trial.txt",),
    "dev": ("SICK_trial.txt",),
    "test": ("SICK_test_annotated.txt",),
    "all": ("SICK_train.txt", "SICK_trial.txt", "SICK_test_annotated.txt"),
}
_SNLI_FILES = {"dev": "snli_1.0_dev.csv", "test": "snli_1.0_test.csv"}
_MNLI_FILES = {
    "dev_matched": "multinli_1.0_dev_matched.csv",
    "dev_mismatched": "multinli_1.0_dev_mismatched.csv",
}
_XNLI_FILES = {"dev": "xnli_validation_en.tsv", "test": "xnli_test_en.tsv"}
# "original/<s>" or "revised_combined/<s>"; a bare "<s>" is both (the release's all_combined/<s>).
_CAD_FILES = {
    **{
        f"{part}/{s}": (f"{part}/{s}.tsv",)
        for part in ("original", "revised_combined")
        for s in ("train", "dev", "test")
    },
    **{s: (f"original/{s}.tsv", f"revised_combined/{s}.tsv") for s in ("train", "dev", "test")},
}
_WIKISEC_FILES = {"train": "train.csv", "dev": "validation.csv", "test": "test.csv"}


@dataclasses.dataclass(frozen=True)
class LocalDataset:
    """A dataset name in the data directory: the files a split needs (paths relative to the directory; a
    DataError for an unknown split), and how to read the split's records from the directory."""

    files: Callable[[str], list[str]]
    read: Callable[[Path, str, Errors], Records]

    def load(self, root: Path, split: str, errors: Errors) -> Records:
        self.files(split)  # an unknown split is a DataError here, before any file is opened
        return self.read(root, split, errors)


def _one_reader_per_file(
    folder: str, name: str, choices: Mapping[str, str | tuple[str, ...]], reader: Callable[[Path, Errors], Records]
) -> LocalDataset:
    """A dataset whose split is one or more files of `folder`, each read by `reader` and concatenated."""

    def files(split: str) -> list[str]:
        chosen = _choose(name, split, choices)
        return [f"{folder}/{file}" for file in ((chosen,) if isinstance(chosen, str) else chosen)]

    def read(root: Path, split: str, errors: Errors) -> Records:
        return Records.concat(reader(root / file, errors) for file in files(split))

    return LocalDataset(files, read)


def _sts_folder(name: str) -> str:
    return f"sts12-16/STS{name.removeprefix('sts')}-en-test"


def sts_subsets(root: Path, name: str, errors: Errors = "raise") -> dict[str, Records]:
    """STS12-16 by sub-set, in the order of STS_SUBSETS (their concatenation is the year's test set)."""
    return {subset: read_sts_subset(root / _sts_folder(name), subset, errors) for subset in STS_SUBSETS[name]}


def _sts_year(name: str) -> LocalDataset:
    def files(split: str) -> list[str]:
        _choose(name, split, {"test": None})
        return [f"{_sts_folder(name)}/STS.{kind}.{s}.txt" for s in STS_SUBSETS[name] for kind in ("input", "gs")]

    def read(root: Path, split: str, errors: Errors) -> Records:
        return Records.concat(sts_subsets(root, name, errors).values())

    return LocalDataset(files, read)


_STSB = _one_reader_per_file("stsb", "stsb", _STSB_FILES, read_stsb)
_SICK = _one_reader_per_file("sickr", "sickr", _SICK_FILES, read_sick)
_SNLI = _one_reader_per_file("nli/snli", "snli", _SNLI_FILES, read_nli_csv)
_MNLI = _one_reader_per_file("nli/mnli", "mnli", _MNLI_FILES, read_nli_csv)
_XNLI = _one_reader_per_file("nli-extra/xnli-en", "xnli", _XNLI_FILES, read_xnli)
_CAD_SNLI = _one_reader_per_file("nli-extra/cad-snli", "cad-snli", _CAD_FILES, read_cad_snli)
_BWS = _one_reader_per_file("bws-argsim", "bws", {"all": "BWS_corpus.csv"}, read_bws)
# Not in shared/data; a user with the Dor et al. release puts its CSVs in <data dir>/wikisec/.
_WIKISEC = _one_reader_per_file("wikisec", "wikisec", _WIKISEC_FILES, read_wikisec_csv)


def _snli_senteval_files(split: str) -> list[str]:
    _choose("snli-senteval", split, {"dev": None, "test": None})
    return [f"nli/snli-senteval/{stem}.{split}" for stem in ("s1", "s2", "labels")]


def _snli_senteval(root: Path, split: str, errors: Errors) -> Records:
    return read_senteval_nli(root / "nli" / "snli-senteval", split, errors)


# The largest NLI training set available offline: the only real SNLI-train pairs (CAD original/train), their
# counterfactual revisions, and XNLI-en (MultiNLI-style, disjoint from MultiNLI dev). SNLI and MultiNLI dev/test
# are left out on purpose: they stay NLI evaluation data.
_NLI_OFFLINE_PARTS = (
    (_CAD_SNLI, "original/train"),
    (_CAD_SNLI, "revised_combined/train"),
    (_XNLI, "dev"),
    (_XNLI, "test"),
)


def _nli_offline_files(split: str) -> list[str]:
    _choose("nli-offline", split, {"train": None})
    return [file for dataset, part in _NLI_OFFLINE_PARTS for file in dataset.files(part)]


def _nli_offline(root: Path, split: str, errors: Errors) -> Records:
    return Records.concat(dataset.read(root, part, errors) for dataset, part in _NLI_OFFLINE_PARTS)


def _nli_triplets(root: Path, split: str, errors: Errors) -> Records:
    # Built from an SNLI evaluation split (the split names which; "test" is the usual choice).
    return nli_triplets(_SNLI.read(root, split, errors))


def _ukp_fold(split: str) -> tuple[dict[str, tuple[str, ...]], str] | None:
    """None for "all"; for "fold<k>/<train|dev|test>" that fold of UKP_ASPECT_FOLDS and the part."""
    if split == "all":
        return None
    match = re.fullmatch(r"fold([0-3])/(train|dev|test)", split)
    if not match:
        raise DataError(f"local dataset 'ukp-aspect' has no split {split!r}; use 'all' or 'fold<0-3>/<train|dev|test>'")
    return UKP_ASPECT_FOLDS[int(match[1])], match[2]


def _ukp_aspect_files(split: str) -> list[str]:
    _ukp_fold(split)
    return ["ukp-aspect/UKP_ASPECT.tsv"]


def _ukp_aspect(root: Path, split: str, errors: Errors) -> Records:
    fold_part = _ukp_fold(split)
    records = read_ukp_aspect(root / "ukp-aspect" / "UKP_ASPECT.tsv", errors)
    if fold_part is None:
        return records
    fold, part = fold_part
    if part == "train":
        held_out = set(fold["dev"]) | set(fold["test"])
        kept = [record for record in records if record.topic not in held_out]
    else:
        kept = [record for record in records if record.topic in fold[part]]
    return Records(kept, skipped=records.skipped, dropped=records.dropped)


_LOCAL: dict[str, LocalDataset] = {
    "stsb": _STSB,
    "sickr": _SICK,
    **{name: _sts_year(name) for name in STS_SUBSETS},
    "snli": _SNLI,
    "mnli": _MNLI,
    "snli-senteval": LocalDataset(_snli_senteval_files, _snli_senteval),
    "xnli": _XNLI,
    "cad-snli": _CAD_SNLI,
    "nli-offline": LocalDataset(_nli_offline_files, _nli_offline),
    "nli-triplets": LocalDataset(_SNLI.files, _nli_triplets),
    "ukp-aspect": LocalDataset(_ukp_aspect_files, _ukp_aspect),
    "bws": _BWS,
    "wikisec": _WIKISEC,
}


def _local(name: str) -> LocalDataset:
    if name not in _LOCAL:
        where = " (it is only on the Hugging Face Hub: unset the data directory)" if name in HUB_SOURCES else ""
        raise DataError(f"dataset {name!r} is not a local dataset{where}; local names: {', '.join(_LOCAL)}")
    return _LOCAL[name]


def load_records(
    name: str,
    split: str,
    data_dir: str | os.PathLike | None = None,
    errors: Errors = "raise",
) -> Records:
    """All records of one dataset split: from local files when a data directory is set, else the Hub."""
    root = resolve_data_dir(data_dir)
    if root is None:
        return load_hub(name, split, errors)
    return _local(name).load(root, split, errors)


def local_files(name: str, split: str) -> list[str]:
    """The files a registered dataset's split is read from, relative to the data directory."""
    return _local(name).files(split)


def check_available(name: str, split: str, data_dir: str | os.PathLike | None = None) -> str:
    """Where `load_records(name, split, data_dir)` would read from, checked before any work, without reading
    rows: the data directory when every file the split needs is there (else a DataError naming the first missing
    file), or without one the Hub source (its mirror folder, the Hub, or the datasets cache: `check_hub`)."""
    root = resolve_data_dir(data_dir)
    if root is None:
        return check_hub(name, split)
    missing = [root / file for file in local_files(name, split) if not (root / file).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more missing files)" if len(missing) > 1 else ""
        raise DataError(f"{name!r} split {split!r} needs {missing[0]}, which does not exist{more}")
    return str(root)


def load_sts_subsets(
    name: str, data_dir: str | os.PathLike | None = None, errors: Errors = "raise"
) -> dict[str, Records]:
    """STS12-16 test pairs per sub-set (file order) from local files; without a data directory there are none
    ({}): the Hub copies (mteb/sts12-sts ... sts16-sts) carry no sub-set name in their rows (see hub.py)."""
    if name not in STS_SUBSETS:
        raise DataError(f"{name!r} is not one of {', '.join(STS_SUBSETS)}")
    root = resolve_data_dir(data_dir)
    return {} if root is None else sts_subsets(root, name, errors)
