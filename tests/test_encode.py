"""Batch embedding (`sbert-ray encode`): input files read as numbered rows; bad input refused, naming the file,
before Ray starts; on a local Ray cluster every input row is written exactly once, with the vector
`SentenceEncoder.encode` gives it, and no output folder appears unless it is complete."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from sbert_ray.cli import main
from sbert_ray.data.corpus import open_corpus
from sbert_ray.data.readers import load_records
from sbert_ray.data.records import DataError
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.runs.encode_corpus import EncodeRequest, encode_corpus

# Quotes, commas, a line break inside a value, non-ASCII text: what CSV quoting and the readers must keep intact.
AWKWARD = ['He said "hello", then left.', "line one\nline two", "Café, naïve, 東京", "   padded   "]


@pytest.fixture(scope="module")
def sentences(data_dir) -> list[str]:
    """Distinct STSb dev sentences of many lengths."""
    pairs = load_records("stsb", "dev", data_dir)[:120]
    return list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))


def write_table(path, texts: list[str], column: str = "sentence") -> None:
    table = pa.table({"other": list(range(len(texts))), column: texts})
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".jsonl":
        lines = [json.dumps({"other": i, column: t}) for i, t in enumerate(texts)]
        path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # a blank line is not a row
    elif path.suffix == ".tsv":
        path.write_text("\n".join([f"other\t{column}"] + [f"{i}\t{t}" for i, t in enumerate(texts)]) + "\n")
    else:
        pa_csv.write_csv(table, path)


def assert_embedded(output, texts: list[str], encoder: SentenceEncoder) -> None:
    table = pq.read_table(output).sort_by("id")
    assert table.column("id").to_pylist() == list(range(len(texts)))  # every row exactly once
    assert table.column("text").to_pylist() == texts
    assert table.schema.field("vector").type == pa.list_(pa.float32(), encoder.embedding_dim)
    vectors = np.array(table.column("vector").to_pylist(), dtype=np.float32)
    # The same float32 model in other batches (Ray Data blocks): ulps of values below ~4, so ~1e-6.
    np.testing.assert_allclose(vectors, encoder.encode(texts, batch_size=16), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_table_files_give_their_column_as_numbered_rows(tmp_path, sentences, suffix):
    texts = AWKWARD + sentences[:20] if suffix != ".tsv" else sentences[:20]  # TSV has no quoting: one line a row
    path = tmp_path / f"corpus{suffix}"
    write_table(path, texts)
    corpus = open_corpus(str(path), "sentence")
    assert list(corpus.rows()) == list(enumerate(texts))
    tables = list(corpus.tables(rows_per_table=7))
    assert [t.num_rows for t in tables] == [7] * (len(texts) // 7) + ([len(texts) % 7] if len(texts) % 7 else [])
    assert pa.concat_tables(tables).column("text").to_pylist() == texts


def test_text_file_rows_are_its_non_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes("\ufefffirst\r\n\n  \nsecond \nthird".encode())
    assert list(open_corpus(str(path)).rows()) == [(0, "first"), (1, "second "), (2, "third")]


def bad_inputs(tmp_path):
    """(input, column, what the error says besides the file name) for inputs refused before any work."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n   \n")
    (tmp_path / "header-only.csv").write_text("sentence\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "a-folder.csv").mkdir()
    (tmp_path / "not-parquet.parquet").write_text("hello")
    (tmp_path / "words.docx").write_text("hello")
    for suffix in (".csv", ".jsonl", ".parquet"):
        write_table(tmp_path / f"other-column{suffix}", ["a", "b"], column="body")
    return [
        ("empty.txt", None, "no rows"),
        ("blank.txt", None, "no rows"),
        ("header-only.csv", "sentence", "no rows"),
        ("latin1.txt", None, "line 1: not UTF-8"),
        ("missing.txt", None, "no such file"),
        ("a-folder.csv", "sentence", "directory"),
        ("not-parquet.parquet", "sentence", "not a readable parquet file"),
        ("words.docx", None, "unsupported file type"),
        ("other-column.csv", "sentence", "no column 'sentence'"),
        ("other-column.jsonl", "sentence", "line 1: no 'sentence' field"),
        ("other-column.parquet", "sentence", "no column 'sentence'"),
        ("empty.txt", "sentence", "--column is for tables"),
    ]


def test_bad_input_is_refused_naming_the_file_before_ray(tmp_path, tiny_model_dir, monkeypatch, capsys):
    def no_ray():
        raise AssertionError("Ray was started for bad input")

    monkeypatch.setattr("sbert_ray.runs.encode_corpus.connect_ray", no_ray)
    for name, column, message in bad_inputs(tmp_path):
        path = tmp_path / name
        with pytest.raises(DataError) as error:
            encode_corpus(EncodeRequest(str(tiny_model_dir), str(path), tmp_path / "out", column=column))
        assert str(path) in str(error.value) and message in str(error.value), (name, str(error.value))
    # The command line prints one line naming the file, and exits 2.
    args = ["encode", "--model", str(tiny_model_dir), "--input", str(tmp_path / "other-column.csv")]
    assert main([*args, "--column", "sentence", "--output", str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'other-column.csv'}, line 1: no column 'sentence'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_text_file_embedded_on_two_workers(local_ray, tmp_path, tiny_model_dir, sentences):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(sentences[:100] + [""] + sentences[100:]) + "\n")
    result = encode_corpus(
        EncodeRequest(str(tiny_model_dir), str(path), tmp_path / "out", batch_size=16, workers=2, block_bytes=2048)
    )
    assert result.rows == len(sentences) and result.output == str(tmp_path / "out")
    assert_embedded(tmp_path / "out", sentences, SentenceEncoder.load(str(tiny_model_dir)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]  # no staging folder left


def test_registered_dataset_from_the_command_line(local_ray, tmp_path, tiny_model_dir, data_dir, capsys):
    out = tmp_path / "sick"
    args = ["encode", "--model", str(tiny_model_dir), "--input", "sickr:trial", "--data-dir", str(data_dir)]
    assert main([*args, "--output", str(out), "--batch-size", "16"]) == 0
    pairs = load_records("sickr", "trial", data_dir)
    texts = list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))
    assert f"wrote {len(texts)} embeddings (dimension 32) to {out}" in capsys.readouterr().out
    assert_embedded(out, texts, SentenceEncoder.load(str(tiny_model_dir)))
    assert main([*args, "--output", str(out)]) == 2  # an existing output folder is never overwritten
    assert "already exists" in capsys.readouterr().err


@pytest.mark.cluster
def test_a_bad_row_midway_names_its_line_and_leaves_no_output(local_ray, tmp_path, tiny_model_dir, sentences, capfd):
    """Found by the Ray Data read task: our one line on the command line, not Ray's traceback around it."""
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": s}) for s in sentences[:150]] + ['{"text": null}']
    path.write_text("\n".join(lines) + "\n")
    message = f"{path}, line 151: 'text' is NoneType, not text"
    with pytest.raises(DataError) as raised:
        encode_corpus(EncodeRequest(str(tiny_model_dir), str(path), tmp_path / "out", batch_size=16, block_bytes=2048))
    assert type(raised.value) is DataError and str(raised.value) == message
    capfd.readouterr()
    argv = ["encode", "--model", str(tiny_model_dir), "--input", str(path), "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.endswith(f"sbert-ray encode: error: {message}\n") and err.count(message) == 1
    assert "Traceback" not in err and "Exception occurred" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # neither output nor staging folder


@pytest.fixture
def prompted_model(tiny_model_dir, tmp_path):
    encoder = SentenceEncoder.load(str(tiny_model_dir), prompts={"query": "query: ", "document": "passage: "})
    encoder.save(tmp_path / "prompted")
    return tmp_path / "prompted", encoder


def test_an_unknown_prompt_name_is_refused_before_ray(prompted_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sbert_ray.runs.encode_corpus.connect_ray", lambda: pytest.fail("Ray was started"))
    (tmp_path / "corpus.txt").write_text("a sentence\n")
    args = ["encode", "--model", str(prompted_model[0]), "--input", str(tmp_path / "corpus.txt")]
    assert main([*args, "--output", str(tmp_path / "out"), "--prompt-name", "passage"]) == 2
    assert "--prompt-name: unknown prompt name 'passage'; the model's prompts: 'query', 'document'" in (
        capsys.readouterr().err
    )


def test_prompt_name_puts_the_prompt_before_every_text(local_ray, prompted_model, tmp_path, sentences):
    (tmp_path / "corpus.txt").write_text("\n".join(sentences[:40]) + "\n")
    args = ["encode", "--model", str(prompted_model[0]), "--input", str(tmp_path / "corpus.txt")]
    assert main([*args, "--output", str(tmp_path / "out"), "--prompt-name", "document", "--batch-size", "16"]) == 0
    vectors = np.array(pq.read_table(tmp_path / "out").sort_by("id").column("vector").to_pylist(), dtype=np.float32)
    expected = prompted_model[1].encode(sentences[:40], batch_size=16, prompt_name="document")
    np.testing.assert_allclose(vectors, expected, atol=1e-5, rtol=1e-5)  # as assert_embedded
    assert np.abs(vectors - prompted_model[1].encode(sentences[:40])).max() > 1e-3  # the prompt made a difference
