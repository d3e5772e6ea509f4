"""``sbert-ray score``: a teacher's scores of pairs and mined n-tuples. The input layouts, the refusals and the scoring
arithmetic run in process; one cluster test scores on Ray Data and resumes."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from sentence_transformers import CrossEncoder

from sbert_ray.cli import main
from sbert_ray.data.readers import load_records
from sbert_ray.data.records import DataError
from sbert_ray.data.score_inputs import ScoreLayout, layout_of, open_score_inputs
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.teachers import load_teacher
from sbert_ray.runs.score_rows import ScoreRequest, score_rows, with_scores

NEGATIVES = 3


@pytest.fixture(scope="module")
def sentences(data_dir) -> list[str]:
    """Distinct STSb dev sentences of many lengths."""
    pairs = load_records("stsb", "dev", data_dir)[:40]
    return list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))


def n_tuples(sentences: list[str], rows: int, start: int = 0) -> pa.Table:
    """Rows as ``sbert-ray mine`` writes them: anchor, positive, negative_1..negative_n (and an id of the user's)."""
    texts = sentences[start:] + sentences[:start]
    columns = {"id": list(range(rows)), "anchor": texts[:rows], "positive": texts[rows : 2 * rows]}
    for n in range(1, NEGATIVES + 1):
        columns[f"negative_{n}"] = texts[(n + 1) * rows : (n + 2) * rows]
    return pa.table(columns)


def predicted(model: CrossEncoder, table: pa.Table, query: str, passage: str) -> np.ndarray:
    """One process's ``CrossEncoder.predict`` of the table's (query, passage) pairs."""
    pairs = list(zip(table[query].to_pylist(), table[passage].to_pylist(), strict=True))
    return model.predict(pairs, batch_size=7, show_progress_bar=False)


def cosines(encoder: SentenceEncoder, table: pa.Table, query: str, passage: str) -> np.ndarray:
    queries, passages = (encoder.encode(table[column].to_pylist(), batch_size=5) for column in (query, passage))
    return np.sum(queries * passages, axis=1) / np.linalg.norm(queries, axis=1) / np.linalg.norm(passages, axis=1)


# ------------------------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize(
    ("columns", "options", "layout"),
    [
        (["query", "passage", "label"], {}, ScoreLayout("query", ("passage",))),
        (["anchor", "positive"], {}, ScoreLayout("anchor", ("positive",))),
        (["q", "doc"], {"query_column": "q", "passage_column": "doc"}, ScoreLayout("q", ("doc",))),
        (
            ["anchor", "positive", "negative_2", "negative_1"],
            {},
            ScoreLayout("anchor", ("positive", "negative_1", "negative_2")),
        ),
        (["anchor", "positive", "negative"], {}, ScoreLayout("anchor", ("positive", "negative"))),  # mine --triplets
        (
            ["anchor", "positive", "negative_1"],
            {"passage_column": "negative_1"},
            ScoreLayout("anchor", ("negative_1",)),
        ),
    ],
)
def test_the_columns_decide_what_is_scored(columns, options, layout):
    assert layout_of("f.parquet", columns, **options) == layout


def test_score_columns_are_named_by_what_they_score():
    assert ScoreLayout("q", ("passage",)).score_columns == ("score",)
    assert ScoreLayout("anchor", ("positive", "negative_1", "negative_2")).score_columns == (
        "score_positive", "score_negative_1", "score_negative_2"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("columns", "options", "message"),
    [
        (["text", "passage"], {}, "no column 'query' or 'anchor'"),
        (["query", "body"], {}, "no column 'passage' or 'positive'"),
        (["query", "passage"], {"query_column": "question"}, "no query column 'question'"),
        (["query", "passage"], {"passage_column": "doc"}, "no passage column 'doc'"),
        (["anchor", "negative_1"], {}, "no positive column 'positive'"),
        (["anchor", "positive", "negative_1", "negative_3"], {}, "negative_2 is missing"),
        (["query", "passage", "score"], {}, "already has a column 'score'"),
    ],
)
def test_missing_columns_are_named(columns, options, message):
    with pytest.raises(DataError, match=f"^f.csv: .*{message}"):
        layout_of("f.csv", columns, **options)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_every_column_is_read_and_rows_are_numbered(tmp_path, suffix):
    table = pa.table({"id": ["7", "8", "9"], "query": ['a, "b"', "c", "d"], "passage": ["x", "y\nz", "w"]})
    if suffix == ".tsv":  # TAB-separated without quoting: no line breaks inside a value
        table = table.set_column(2, "passage", pa.array(["x", "y z", "w"]))
    path = tmp_path / f"pairs{suffix}"
    write(path, table)
    (source,) = open_score_inputs(str(path))
    assert (source.key, source.layout) == (f"pairs{suffix}", ScoreLayout("query", ("passage",)))
    read = pa.concat_tables(source.tables(2, row_column="row"))
    assert read.column_names == ["row", "id", "query", "passage"]
    assert read["row"].to_pylist() == [0, 1, 2]
    if suffix != ".jsonl":  # JSON keeps the values' own types (here text too)
        assert read.drop_columns(["row"]).to_pylist() == table.to_pylist()


def write(path, table: pa.Table) -> None:
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    elif path.suffix == ".tsv":
        rows = ["\t".join(map(str, row.values())) for row in table.to_pylist()]
        path.write_text("\n".join(["\t".join(table.column_names), *rows]) + "\n")
    else:
        pa_csv.write_csv(table, path)


def test_a_folder_gives_its_tables_in_order(tmp_path, sentences):
    for name in ("part-00001.parquet", "part-00000.parquet", "sub/part-00002.jsonl"):
        (tmp_path / "mined" / name).parent.mkdir(parents=True, exist_ok=True)
        write(tmp_path / "mined" / name, n_tuples(sentences, 3))
    (tmp_path / "mined" / "mine.json").write_text("{}")  # the manifest sbert-ray mine writes beside its shards
    (tmp_path / "mined" / "notes.txt").write_text("not a table\n")
    (tmp_path / "mined" / "_SUCCESS").write_text("")
    sources = open_score_inputs(str(tmp_path / "mined"))
    assert [source.key for source in sources] == ["part-00000.parquet", "part-00001.parquet", "sub/part-00002.jsonl"]
    assert {source.layout.score_columns for source in sources} == {
        ("score_positive", "score_negative_1", "score_negative_2", "score_negative_3")
    }


def test_a_null_text_names_its_row(tmp_path):
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"query": ["a", "b", None], "passage": ["x", "y", "z"]}), path)
    (source,) = open_score_inputs(str(path))
    with pytest.raises(DataError, match=f"^{path}, row 3: column 'query' is null"):
        list(source.tables(2))


# ------------------------------------------------------------------------------------------------ scoring


def test_cross_encoder_scores_equal_its_predict(tiny_cross_encoder_dir, sentences):
    teacher = load_teacher(str(tiny_cross_encoder_dir))
    assert teacher.kind == "cross-encoder"
    model = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu")
    rows = n_tuples(sentences, 9)
    layout = layout_of("rows", rows.column_names)
    scored = with_scores(teacher, rows, layout, batch_size=4)
    assert scored.column_names == [*rows.column_names, "score_positive", *(f"score_negative_{n}" for n in (1, 2, 3))]
    assert scored.select(rows.column_names).equals(rows)
    for passage in layout.passages:
        expected = predicted(model, rows, "anchor", passage)
        assert np.ptp(expected) > 0.1  # the scores differ from pair to pair: equality below means something
        np.testing.assert_allclose(scored[f"score_{passage}"].to_numpy(), expected, atol=1e-5, rtol=0)


def test_bi_encoder_scores_are_the_cosines_of_its_embeddings(tiny_model_dir, sentences):
    teacher = load_teacher(str(tiny_model_dir))
    assert teacher.kind == "bi-encoder"
    rows = n_tuples(sentences, 6).select(["anchor", "positive"])
    scored = with_scores(teacher, rows, layout_of("rows", rows.column_names), batch_size=4)
    expected = cosines(SentenceEncoder.load(str(tiny_model_dir)), rows, "anchor", "positive")
    np.testing.assert_allclose(scored["score"].to_numpy(), expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ refusals


def bad_inputs(tmp_path, sentences):
    """(input, what the error says besides the file name) for inputs refused before any work."""
    good = n_tuples(sentences, 4)
    (tmp_path / "folder").mkdir()
    pq.write_table(good, tmp_path / "folder" / "part-0.parquet")
    pq.write_table(good.select(["anchor", "positive"]), tmp_path / "folder" / "part-1.parquet")
    pq.write_table(good.drop_columns(["positive"]), tmp_path / "no-positive.parquet")
    (tmp_path / "header-only.csv").write_text("query,passage\n")
    (tmp_path / "not-parquet.parquet").write_text("hello")
    (tmp_path / "lines.txt").write_text("a\nb\n")
    return [
        ("no-positive.parquet", "no positive column 'positive'"),
        ("header-only.csv", "no rows to score"),
        ("not-parquet.parquet", "not a readable parquet file"),
        ("lines.txt", "scoring reads tables"),
        ("missing.csv", "no such file"),
        ("folder/part-1.parquet", "one run scores one layout"),
    ]


def test_bad_input_is_refused_naming_the_file_before_ray(
    tmp_path, tiny_cross_encoder_dir, sentences, monkeypatch, capsys
):
    monkeypatch.setattr("sbert_ray.runs.per_file.connect_ray", lambda: pytest.fail("Ray was started"))
    out = tmp_path / "out"
    for name, message in bad_inputs(tmp_path, sentences):
        spec = tmp_path / ("folder" if name.startswith("folder/") else name)
        args = ["score", "--model", str(tiny_cross_encoder_dir), "--input", str(spec), "--output", str(out)]
        assert main(args) == 2, name
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and str(tmp_path / name) in error and message in error, (name, error)
    # A model folder that is neither a cross-encoder nor a bi-encoder.
    pq.write_table(n_tuples(sentences, 4), tmp_path / "rows.parquet")
    (tmp_path / "no-model").mkdir()
    args = ["score", "--model", str(tmp_path / "no-model"), "--input", str(tmp_path / "rows.parquet")]
    assert main([*args, "--output", str(out)]) == 2
    assert f"--model {tmp_path / 'no-model'}: neither a cross-encoder" in capsys.readouterr().err
    assert not out.exists()


def test_a_rerun_with_another_teacher_is_refused_before_ray(
    tmp_path, tiny_model_dir, tiny_cross_encoder_dir, sentences, monkeypatch
):
    monkeypatch.setattr("sbert_ray.runs.per_file.connect_ray", lambda: pytest.fail("Ray was started"))
    out = tmp_path / "out"
    out.mkdir()
    settings = {"model": str(tiny_model_dir), "query_column": None, "passage_column": None}
    (out / "_sbert_ray_score.json").write_text(json.dumps(settings))
    pq.write_table(n_tuples(sentences, 4), tmp_path / "rows.parquet")
    with pytest.raises(Exception, match="holds scores made with"):
        score_rows(ScoreRequest(str(tiny_cross_encoder_dir), str(tmp_path / "rows.parquet"), out))


# ------------------------------------------------------------------------------------------------ on a cluster


def test_scores_on_ray_equal_one_process_and_a_rerun_writes_only_what_is_missing(
    local_ray, tmp_path, tiny_cross_encoder_dir, tiny_model_dir, sentences
):
    shards = {"part-00000.parquet": n_tuples(sentences, 12), "more/part-00001.parquet": n_tuples(sentences, 9, 5)}
    for name, table in shards.items():
        (tmp_path / "mined" / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp_path / "mined" / name)
    (tmp_path / "mined" / "mine.json").write_text("{}")  # mine's manifest beside its shards: not a table to score
    out = tmp_path / "scored"
    request = ScoreRequest(str(tiny_cross_encoder_dir), str(tmp_path / "mined"), out, batch_size=4, block_bytes=1024)
    result = score_rows(request)
    assert (result.rows, result.files_written, result.files_skipped) == (21, 2, 0)
    model = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu")
    for name, table in shards.items():
        scored = pq.read_table(out / f"{name}.parquet")
        assert scored.select(table.column_names).equals(table)  # the input rows, in order, every column
        for passage in ("positive", "negative_1", "negative_2", "negative_3"):
            expected = predicted(model, table, "anchor", passage)
            np.testing.assert_allclose(scored[f"score_{passage}"].to_numpy(), expected, atol=1e-5, rtol=0)

    kept = (out / "part-00000.parquet.parquet").stat().st_mtime_ns
    (out / "more" / "part-00001.parquet.parquet").unlink()
    result = score_rows(request)
    assert (result.rows, result.files_written, result.files_skipped) == (9, 1, 1)
    assert (out / "part-00000.parquet.parquet").stat().st_mtime_ns == kept  # untouched
    assert pq.read_table(out / "more" / "part-00001.parquet.parquet").select(["id"]).num_rows == 9

    # A bi-encoder teacher through the command line: pairs, scored by cosine.
    pairs = tmp_path / "pairs.csv"
    pa_csv.write_csv(n_tuples(sentences, 10).select(["anchor", "positive"]).rename_columns(["query", "passage"]), pairs)
    args = ["score", "--model", str(tiny_model_dir), "--input", str(pairs), "--output", str(tmp_path / "cosine")]
    assert main([*args, "--quiet"]) == 0
    scored = pq.read_table(tmp_path / "cosine" / "pairs.csv.parquet")
    expected = cosines(SentenceEncoder.load(str(tiny_model_dir)), scored, "query", "passage")
    np.testing.assert_allclose(scored["score"].to_numpy(), expected, atol=1e-5, rtol=0)
