"""Readers on the real local files (counts from each SOURCE.md) and on small broken files."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from sbert_ray.data import (
    DATA_DIR_ENV,
    HUB_SOURCES,
    NLI_LABELS,
    STS_SUBSETS,
    UKP_ASPECT_FOLDS,
    DataError,
    LabelledPair,
    ScoredPair,
    TopicPair,
    Triplet,
    load_records,
    load_sts_subsets,
    read_user_file,
    resolve_data_dir,
)
from sbert_ray.data.readers import read_bws, read_nli_csv, read_sick, read_sts_subset, read_stsb, read_xnli

# (name, split, verified count from SOURCE.md, record type)
COUNTS = [
    ("stsb", "train", 5749, ScoredPair),
    ("stsb", "dev", 1500, ScoredPair),
    ("stsb", "test", 1379, ScoredPair),
    ("sickr", "train", 4500, ScoredPair),
    ("sickr", "trial", 500, ScoredPair),
    ("sickr", "dev", 500, ScoredPair),
    ("sickr", "test", 4927, ScoredPair),
    ("sickr", "all", 9927, ScoredPair),
    ("sts12", "test", 3108, ScoredPair),
    ("sts13", "test", 1500, ScoredPair),
    ("sts14", "test", 3750, ScoredPair),
    ("sts15", "test", 3000, ScoredPair),
    ("sts16", "test", 1186, ScoredPair),
    ("snli", "dev", 9842, LabelledPair),
    ("snli", "test", 9824, LabelledPair),
    ("mnli", "dev_matched", 9815, LabelledPair),
    ("mnli", "dev_mismatched", 9832, LabelledPair),
    ("snli-senteval", "dev", 9842, LabelledPair),
    ("snli-senteval", "test", 9824, LabelledPair),
    ("xnli", "dev", 2490, LabelledPair),
    ("xnli", "test", 5010, LabelledPair),
    ("cad-snli", "original/train", 1666, LabelledPair),
    ("cad-snli", "original/dev", 200, LabelledPair),
    ("cad-snli", "original/test", 400, LabelledPair),
    ("cad-snli", "revised_combined/train", 6664, LabelledPair),
    ("cad-snli", "revised_combined/dev", 800, LabelledPair),
    ("cad-snli", "revised_combined/test", 1600, LabelledPair),
    ("cad-snli", "train", 1666 + 6664, LabelledPair),
    ("nli-offline", "train", 1666 + 6664 + 2490 + 5010, LabelledPair),
    ("ukp-aspect", "all", 3595, TopicPair),
    ("bws", "all", 3400, TopicPair),
]


@pytest.mark.parametrize(("name", "split", "count", "record_type"), COUNTS)
def test_local_counts(data_dir: Path, name: str, split: str, count: int, record_type: type) -> None:
    records = load_records(name, split, data_dir)
    assert len(records) == count
    assert records.skipped == 0
    assert all(type(record) is record_type for record in records)


def label_counts(records) -> dict[str, int]:
    return {NLI_LABELS[label]: n for label, n in Counter(record.label for record in records).items()}


@pytest.mark.parametrize(
    ("name", "split", "entailment", "neutral", "contradiction", "dropped"),
    [
        ("snli", "dev", 3329, 3235, 3278, 158),
        ("snli", "test", 3368, 3219, 3237, 176),
        ("mnli", "dev_matched", 3479, 3123, 3213, 185),
        ("mnli", "dev_mismatched", 3463, 3129, 3240, 168),
        ("xnli", "test", 1670, 1670, 1670, 0),
        ("cad-snli", "original/train", 562, 554, 550, 0),
    ],
)
def test_nli_labels_map_to_our_indices(data_dir, name, split, entailment, neutral, contradiction, dropped) -> None:
    records = load_records(name, split, data_dir)
    assert label_counts(records) == {"entailment": entailment, "neutral": neutral, "contradiction": contradiction}
    assert records.dropped == dropped


def test_snli_dash_labels_are_dropped_and_logged(data_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="sbert_ray.data.records"):
        records = read_nli_csv(data_dir / "nli" / "snli" / "snli_1.0_dev.csv")
    assert records.dropped == 10000 - 9842
    assert "dropped 158 of 10000 rows" in caplog.text and "snli_1.0_dev.csv" in caplog.text


def test_xnli_first_rows_follow_the_hf_label_convention(data_dir) -> None:
    # xnli_test_en.tsv rows 0 and 1 carry labels 2 (contradiction) and 0 (entailment).
    first, second = read_xnli(data_dir / "nli-extra" / "xnli-en" / "xnli_test_en.tsv")[:2]
    assert NLI_LABELS[first.label] == "contradiction"
    assert NLI_LABELS[second.label] == "entailment"


def test_snli_senteval_matches_snli_csv_labels(data_dir) -> None:
    # SOURCE.md: the gold rows of snli_1.0_dev.csv match labels.dev line by line.
    csv_labels = [record.label for record in load_records("snli", "dev", data_dir)]
    senteval_labels = [record.label for record in load_records("snli-senteval", "dev", data_dir)]
    assert csv_labels == senteval_labels


@pytest.mark.parametrize(("name", "low", "high"), [("stsb", 0.0, 5.0), ("sickr", 1.0, 5.0), ("bws", 0.0, 1.0)])
def test_scores_stay_on_their_scale(data_dir, name, low, high) -> None:
    split = "all" if name in ("sickr", "bws") else "train"
    scores = [record.score for record in load_records(name, split, data_dir)]
    assert low <= min(scores) and max(scores) <= high
    assert max(scores) - min(scores) > (high - low) / 2  # not squashed or rescaled


def test_stsb_reads_rows_with_extra_source_columns(data_dir) -> None:
    lines = (data_dir / "stsb" / "sts-test.csv").read_text(encoding="utf-8").splitlines()
    nine = next(number for number, line in enumerate(lines) if line.count("\t") == 8)
    record = read_stsb(data_dir / "stsb" / "sts-test.csv")[nine]
    fields = lines[nine].split("\t")
    assert (record.sentence1, record.sentence2, record.score) == (fields[5], fields[6], float(fields[4]))


def test_sick_test_crlf_is_stripped(data_dir) -> None:
    records = read_sick(data_dir / "sickr" / "SICK_test_annotated.txt")
    assert not any(record.sentence2.endswith("\r") for record in records)


SUBSET_COUNTS = {
    "sts12": {"MSRpar": 750, "MSRvid": 750, "SMTeuroparl": 459, "surprise.OnWN": 750, "surprise.SMTnews": 399},
    "sts13": {"FNWN": 189, "OnWN": 561, "headlines": 750},
    "sts14": {
        "OnWN": 750,
        "deft-forum": 450,
        "deft-news": 300,
        "headlines": 750,
        "images": 750,
        "tweet-news": 750,
    },
    "sts15": {"answers-forums": 375, "answers-students": 750, "belief": 375, "headlines": 750, "images": 750},
    "sts16": {"answer-answer": 254, "headlines": 249, "plagiarism": 230, "postediting": 244, "question-question": 209},
}


@pytest.mark.parametrize("name", list(STS_SUBSETS))
def test_sts_year_is_its_subsets_concatenated(data_dir, name) -> None:
    subsets = load_sts_subsets(name, data_dir)
    assert {subset: len(pairs) for subset, pairs in subsets.items()} == SUBSET_COUNTS[name]
    assert list(load_records(name, "test", data_dir)) == [pair for pairs in subsets.values() for pair in pairs]
    assert all(0.0 <= pair.score <= 5.0 for pairs in subsets.values() for pair in pairs)


def test_sts_pairs_without_gold_are_dropped_not_errors(data_dir) -> None:
    pairs = load_sts_subsets("sts15", data_dir)["answers-forums"]
    assert (len(pairs), pairs.dropped) == (375, 2000 - 375)


def test_ukp_aspect_labels_and_folds(data_dir) -> None:
    records = load_records("ukp-aspect", "all", data_dir)
    assert Counter(record.score for record in records) == {3.0: 460, 2.0: 841, 1.0: 1723, 0.0: 571}
    topics = {record.topic for record in records}
    assert len(topics) == 28
    for k, fold in enumerate(UKP_ASPECT_FOLDS):
        assert set(fold["dev"]) | set(fold["test"]) <= topics
        parts = {part: load_records("ukp-aspect", f"fold{k}/{part}", data_dir) for part in ("train", "dev", "test")}
        part_topics = {part: {record.topic for record in pairs} for part, pairs in parts.items()}
        assert (len(part_topics["train"]), len(part_topics["dev"]), len(part_topics["test"])) == (17, 4, 7)
        assert part_topics["train"] | part_topics["dev"] | part_topics["test"] == topics
        assert sum(len(pairs) for pairs in parts.values()) == len(records)


def test_nli_triplets_pair_each_entailment_with_each_contradiction(data_dir) -> None:
    pairs = load_records("snli", "test", data_dir)
    triplets = load_records("nli-triplets", "test", data_dir)
    labels = {(pair.sentence1, pair.sentence2): NLI_LABELS[pair.label] for pair in pairs}
    assert all(isinstance(triplet, Triplet) for triplet in triplets)
    assert all(labels[(t.anchor, t.positive)] == "entailment" for t in triplets)
    assert all(labels[(t.anchor, t.negative)] == "contradiction" for t in triplets)
    per_premise = Counter((pair.sentence1, NLI_LABELS[pair.label]) for pair in pairs)
    premises = {pair.sentence1 for pair in pairs}
    expected = sum(per_premise[(p, "entailment")] * per_premise[(p, "contradiction")] for p in premises)
    assert len(triplets) == expected > 3000
    assert len(set(triplets)) == len(triplets)


def test_nli_offline_keeps_snli_and_mnli_evaluation_data_out(data_dir) -> None:
    offline = {(pair.sentence1, pair.sentence2) for pair in load_records("nli-offline", "train", data_dir)}
    for split in ("dev", "test"):
        snli = {(pair.sentence1, pair.sentence2) for pair in load_records("snli", split, data_dir)}
        assert not offline & snli


# --- data directory, names and splits -------------------------------------------------------------------------


def test_resolve_data_dir_prefers_argument_then_environment(data_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir(data_dir) == data_dir
    assert resolve_data_dir(None) == tmp_path
    monkeypatch.delenv(DATA_DIR_ENV)
    assert resolve_data_dir(None) is None
    with pytest.raises(DataError, match="does not exist"):
        resolve_data_dir(tmp_path / "missing")


def test_load_records_reads_the_environment_data_dir(data_dir, monkeypatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(data_dir))
    assert len(load_records("stsb", "dev")) == 1500


def test_unknown_names_and_splits_say_what_exists(data_dir) -> None:
    with pytest.raises(DataError, match=r"no split 'validation'.*train, dev, test"):
        load_records("stsb", "validation", data_dir)
    with pytest.raises(DataError, match="only on the Hugging Face Hub"):
        load_records("all-nli", "train", data_dir)
    with pytest.raises(DataError, match="not a local dataset"):
        load_records("afs", "all", data_dir)
    with pytest.raises(DataError, match="fold<0-3>"):
        load_records("ukp-aspect", "fold7/test", data_dir)


def test_hub_table_names_the_public_datasets(monkeypatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert HUB_SOURCES["stsb"].path == "sentence-transformers/stsb"
    assert HUB_SOURCES["stsb"].score_scale == 5.0  # Hub copy is 0-1, ours 0-5
    assert HUB_SOURCES["all-nli"].config == "pair-class"
    assert HUB_SOURCES["wikisec"].path == "sentence-transformers/wikipedia-sections"
    assert [HUB_SOURCES[f"sts{y}"].path for y in range(12, 17)] == [f"mteb/sts{y}-sts" for y in range(12, 17)]
    with pytest.raises(DataError, match="no split 'test'.*all"):
        load_records("sickr", "test")  # mteb/sickr-sts holds all 9,927 pairs: only "all" maps to it
    with pytest.raises(DataError, match="no Hugging Face Hub source"):
        load_records("nli-offline", "train")


# --- bad rows -------------------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


STSB_ROW = "main-news\theadlines\t2015\t0001\t{score}\t{s1}\t{s2}"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("main-news\theadlines\t2015\t0001\t2.5\tonly one sentence", "expected 7 or 9 TAB-separated fields, got 6"),
        (STSB_ROW.format(score="n/a", s1="a", s2="b"), "unparsable score 'n/a'"),
        (STSB_ROW.format(score="nan", s1="a", s2="b"), "score 'nan' is not a finite number"),
        (STSB_ROW.format(score="3.0", s1="  ", s2="b"), "empty sentence1"),
    ],
)
def test_bad_stsb_row_names_file_and_line(tmp_path, bad_line, message) -> None:
    good = STSB_ROW.format(score="1.0", s1="a", s2="b")
    path = write(tmp_path / "sts-train.csv", f"{good}\n{good}\n{bad_line}\n")
    with pytest.raises(DataError) as error:
        read_stsb(path)
    assert str(error.value) == f"{path}, line 3: {message}"


def test_skip_mode_counts_and_reports(tmp_path, caplog) -> None:
    good = STSB_ROW.format(score="1.0", s1="a", s2="b")
    bad = STSB_ROW.format(score="x", s1="a", s2="b")
    path = write(tmp_path / "sts-train.csv", "\n".join([good, bad, good, "too\tfew", good]) + "\n")
    with caplog.at_level(logging.WARNING):
        records = read_stsb(path, errors="skip")
    assert (len(records), records.skipped) == (3, 2)
    assert "skipped 2 of 5 rows" in caplog.text
    assert f"{path}, line 2: unparsable score 'x'" in caplog.text
    assert f"{path}, line 4: expected 7 or 9" in caplog.text


def test_unknown_nli_label_names_file_and_line(tmp_path) -> None:
    path = write(tmp_path / "snli.csv", 'pairID,sentence1,sentence2,label\n1,"A, b",c,neutral\n2,d,e,maybe\n')
    with pytest.raises(DataError, match=rf"{path}, line 3: unknown label 'maybe' \(expected one of"):
        read_nli_csv(path)


def test_csv_line_numbers_count_quoted_newlines(tmp_path) -> None:
    path = write(tmp_path / "snli.csv", 'pairID,sentence1,sentence2,label\n1,"two\nlines",c,neutral\n2,d,,neutral\n')
    with pytest.raises(DataError, match=rf"{path}, line 4: empty sentence2"):
        read_nli_csv(path)


def test_bad_sts_gold_score_names_the_gold_file(tmp_path) -> None:
    write(tmp_path / "STS.input.demo.txt", "a\tb\nc\td\ne\tf\n")
    write(tmp_path / "STS.gs.demo.txt", "4.0\n\nhigh\n")
    with pytest.raises(DataError, match=r"STS.input.demo.txt, line 3: unparsable gold score \(STS.gs.demo.txt\)"):
        read_sts_subset(tmp_path, "demo")
    records = read_sts_subset(tmp_path, "demo", errors="skip")
    assert (len(records), records.dropped, records.skipped) == (1, 1, 1)


def test_misaligned_sts_files_are_an_error(tmp_path) -> None:
    write(tmp_path / "STS.input.demo.txt", "a\tb\nc\td\n")
    write(tmp_path / "STS.gs.demo.txt", "4.0\n")
    with pytest.raises(DataError, match="must align"):
        read_sts_subset(tmp_path, "demo")


def test_missing_column_is_reported_at_the_header(tmp_path) -> None:
    path = write(tmp_path / "pairs.tsv", "first\tsecond\tsimilarity\na\tb\t0.5\n")
    with pytest.raises(DataError, match=rf"{path}, line 1: no column 'score'"):
        read_user_file(path, "scored", {"sentence1": "first", "sentence2": "second"})


# --- user files -----------------------------------------------------------------------------------------------


def test_user_csv_tsv_jsonl_with_column_mapping(tmp_path) -> None:
    columns = {"sentence1": "premise", "sentence2": "hypothesis", "label": "gold"}
    csv_path = write(tmp_path / "nli.csv", 'premise,hypothesis,gold\n"A man, sitting",He sits,entailment\n')
    tsv_path = write(tmp_path / "nli.tsv", 'premise\thypothesis\tgold\r\nA "quoted" man\tHe sits\tneutral\r\n')
    rows = [{"premise": "A man", "hypothesis": "Nobody", "gold": "contradiction", "extra": 1}]
    jsonl_path = write(tmp_path / "nli.jsonl", "\n".join(json.dumps(row) for row in rows) + "\n\n")
    assert read_user_file(csv_path, "labelled", columns) == [LabelledPair("A man, sitting", "He sits", 1)]
    assert read_user_file(tsv_path, "labelled", columns) == [LabelledPair('A "quoted" man', "He sits", 2)]
    assert read_user_file(jsonl_path, "labelled", columns) == [LabelledPair("A man", "Nobody", 0)]


def test_user_labels_mapping_and_other_kinds(tmp_path) -> None:
    path = write(tmp_path / "para.jsonl", '{"sentence1": "a", "sentence2": "b", "label": 1}\n')
    assert read_user_file(path, "labelled", labels={0: 0, 1: 1}) == [LabelledPair("a", "b", 1)]
    path = write(tmp_path / "topics.csv", "topic,sentence1,sentence2,score\nT,a,b,0.25\n")
    assert read_user_file(path, "topic") == [TopicPair("T", "a", "b", 0.25)]
    path = write(tmp_path / "wikisec.csv", "Sentence1,Sentence2,Sentence3\na,p,n\n")
    triplet = {"anchor": "Sentence1", "positive": "Sentence2", "negative": "Sentence3"}
    assert read_user_file(path, "triplet", triplet) == [Triplet("a", "p", "n")]


def test_bad_user_rows(tmp_path) -> None:
    path = write(tmp_path / "s.jsonl", '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a"\n')
    with pytest.raises(DataError, match=rf"{path}, line 2: invalid JSON"):
        read_user_file(path, "scored")
    path = write(tmp_path / "s2.jsonl", '{"sentence1": "a", "sentence2": null, "score": 1}\n')
    with pytest.raises(DataError, match=rf"{path}, line 1: sentence2 is NoneType, not text"):
        read_user_file(path, "scored")
    path = write(tmp_path / "s.tsv", "sentence1\tsentence2\tscore\na\tb\n")
    with pytest.raises(DataError, match=rf"{path}, line 2: expected 3 fields, got 2"):
        read_user_file(path, "scored")
    with pytest.raises(DataError, match="unsupported file type '.parquet'"):
        read_user_file(tmp_path / "s.parquet", "scored")
    with pytest.raises(ValueError, match="errors must be"):
        read_user_file(path, "scored", errors="ignore")


# --- bytes, fields and scores that used to pass or crash (issue 11) -------------------------------------------


@pytest.mark.parametrize("suffix", [".tsv", ".csv", ".jsonl"])
def test_a_byte_that_is_not_utf8_names_file_and_line(tmp_path, suffix) -> None:
    header = {".tsv": "sentence1\tsentence2\tscore", ".csv": "sentence1,sentence2,score", ".jsonl": None}[suffix]
    rows = [("a", "b", 1.0), ("caf\udce9", "b", 2.0), ("c", "d", 3.0)]  # \udce9: the Latin-1 byte 0xe9
    if suffix == ".jsonl":
        lines = [f'{{"sentence1": "{s1}", "sentence2": "{s2}", "score": {score}}}' for s1, s2, score in rows]
    else:
        sep = "\t" if suffix == ".tsv" else ","
        lines = [header] + [sep.join([s1, s2, str(score)]) for s1, s2, score in rows]
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))  # was: 'utf-8' codec can't decode
    line = 2 if suffix == ".jsonl" else 3
    with pytest.raises(DataError, match=rf"^{path}, line {line}: sentence1 is not valid UTF-8 \(byte 0xe9\)$"):
        read_user_file(path, "scored")
    records = read_user_file(path, "scored", errors="skip")
    assert [r.sentence1 for r in records] == ["a", "c"] and records.skipped == 1


def test_a_byte_that_is_not_utf8_in_stsb_names_file_and_line(tmp_path) -> None:
    good = STSB_ROW.format(score="1.0", s1="a", s2="b").encode()
    path = tmp_path / "sts-train.csv"
    path.write_bytes(b"\n".join([good, good.replace(b"\ta\t", b"\t\xff\xfe\t")]) + b"\n")
    with pytest.raises(DataError, match=rf"^{path}, line 2: sentence1 is not valid UTF-8 \(byte 0xff\)$"):
        read_stsb(path)


def test_an_over_long_csv_field_names_file_and_line(tmp_path) -> None:
    path = write(tmp_path / "long.csv", f"sentence1,sentence2,score\na,b,1\nc,{'x' * 200_000},2\n")
    with pytest.raises(DataError, match=rf"^{path}, line 3: broken CSV \(field larger than field limit"):
        read_user_file(path, "scored")  # was a bare _csv.Error traceback
    with pytest.raises(DataError, match="line 3: broken CSV"):
        read_user_file(path, "scored", errors="skip")  # the parser lost its place: never skipped silently
    tsv = write(tmp_path / "long.tsv", f"sentence1\tsentence2\tscore\nc\t{'x' * 200_000}\t2\n")
    assert len(read_user_file(tsv, "scored")[0].sentence2) == 200_000  # no such limit without quoting


def test_an_unclosed_quote_is_an_error_not_the_rest_of_the_file(tmp_path) -> None:
    # Non-strict csv reads the rest of the file into the quoted field: rows 3-4 vanished without a word.
    path = write(tmp_path / "q.csv", 'sentence1,sentence2,score\na,"b,1\nc,d,2\ne,f,3\n')
    with pytest.raises(DataError, match=rf"^{path}, line 2: broken CSV \(unexpected end of data\)"):
        read_user_file(path, "scored")


@pytest.mark.parametrize(
    ("reader", "name", "text", "message"),
    [
        (read_stsb, "sts-train.csv", STSB_ROW.format(score="100", s1="a", s2="b"), "line 1: score 100 is outside"),
        (read_stsb, "sts-train.csv", STSB_ROW.format(score="-0.5", s1="a", s2="b"), "line 1: score -0.5 is outside"),
        (
            read_sick,
            "SICK_train.txt",
            "sentence_A\tsentence_B\trelatedness_score\na\tb\t0.5",
            "line 2: relatedness_score",
        ),
        (
            read_bws,
            "BWS.csv",
            "topic,sentence_1,sentence_2,regression_label\nT,a,b,0.5\nT,c,d,3",
            "line 3: regression_label 3",
        ),
    ],
)
def test_scores_off_their_dataset_scale_are_refused(tmp_path, reader, name, text, message) -> None:
    path = write(tmp_path / name, text + "\n")
    scale = {read_stsb: "[0, 5]", read_sick: "[1, 5]", read_bws: "[0, 1]"}[reader]
    with pytest.raises(DataError) as error:
        reader(path)
    assert str(error.value).startswith(f"{path}, {message}") and str(error.value).endswith(f"this data's scale {scale}")


def test_user_file_scores_are_checked_against_the_given_range(tmp_path) -> None:
    path = write(tmp_path / "s.jsonl", '{"sentence1": "a", "sentence2": "b", "score": 100}\n')
    assert read_user_file(path, "scored")[0].score == 100  # no declared scale: any finite number
    with pytest.raises(DataError, match=rf"^{path}, line 1: score 100 is outside this data's scale \[0, 5\]$"):
        read_user_file(path, "scored", score_range=(0.0, 5.0))


@pytest.mark.parametrize(
    ("score", "message"),
    [("true", "score is a boolean (True), not a number"), ("[1]", "unparsable score [1]"), ("1e999", "not a finite")],
)
def test_json_scores_must_be_numbers(tmp_path, score, message) -> None:
    path = write(tmp_path / "s.jsonl", f'{{"sentence1": "a", "sentence2": "b", "score": {score}}}\n')
    with pytest.raises(DataError, match=rf"^{path}, line 1: ") as error:
        read_user_file(path, "scored")  # JSON true was read as the score 1.0
    assert message in str(error.value)


def test_json_labels_must_be_hashable_and_not_booleans(tmp_path) -> None:
    path = write(tmp_path / "l.jsonl", '{"sentence1": "a", "sentence2": "b", "label": [1]}\n')
    with pytest.raises(DataError, match=r"line 1: unknown label \[1\]"):  # was TypeError: unhashable type
        read_user_file(path, "labelled", labels={0: 0, 1: 1})
    path = write(tmp_path / "b.jsonl", '{"sentence1": "a", "sentence2": "b", "label": true}\n')
    with pytest.raises(DataError, match="line 1: unknown label True"):  # True == 1 would map to class 1
        read_user_file(path, "labelled", labels={0: 0, 1: 1})


def test_deeply_nested_json_is_a_row_error(tmp_path) -> None:
    path = write(tmp_path / "deep.jsonl", "[" * 100_000 + "\n")
    with pytest.raises(DataError, match=rf"^{path}, line 1: invalid JSON"):  # was a RecursionError
        read_user_file(path, "scored")


@pytest.mark.parametrize("suffix", [".CSV", ".Tsv", ".JSONL"])
def test_user_file_suffixes_are_read_in_any_case(tmp_path, suffix) -> None:
    """DATA.CSV was taken for a registered dataset's name and refused as unknown."""
    from sbert_ray.config import StageConfig
    from sbert_ray.training.sources import is_path, read_tables, stage_sources

    rows = [("A man eats.", "A person eats.", 4.5), ("A cat.", "A car.", 0.5)]
    if suffix == ".JSONL":
        text = "".join(json.dumps({"sentence1": a, "sentence2": b, "score": s}) + "\n" for a, b, s in rows)
    else:
        sep = "," if suffix == ".CSV" else "\t"
        text = "".join(sep.join(map(str, row)) + "\n" for row in [("sentence1", "sentence2", "score"), *rows])
    stage = StageConfig(dataset=str(write(tmp_path / f"PAIRS{suffix}", text)), objective="regression")
    assert is_path(stage.dataset)
    (source,) = stage_sources(stage, 0)
    (table,) = read_tables(source, source.files[0], stage, None)
    assert table.column("text_0").to_pylist() == [r[0] for r in rows]
    assert table.column("text_1").to_pylist() == [r[1] for r in rows]
    assert table.column("label").to_pylist() == pytest.approx([0.9, 0.1])  # score / score_max, float32
