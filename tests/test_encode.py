"""Batch embedding (`sbert-ray encode`): input files read as numbered rows; bad input refused, naming the file,
before Ray starts; on a local Ray cluster every input row is written exactly once, with the vector
`SentenceEncoder.encode` gives it, and no output folder appears unless it is complete."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import ray
from cluster_fixtures import NO_STATE_API
from local_cluster import BUCKET

from sbert_ray.cli import main
from sbert_ray.config import ConfigError
from sbert_ray.data.corpus import open_corpus
from sbert_ray.data.readers import load_records
from sbert_ray.data.records import DataError
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.runs.cluster import NodeKind, actors_problem
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
    [corpus] = open_corpus(str(path), "sentence")
    assert list(corpus.rows()) == list(enumerate(texts))
    tables = list(corpus.tables(rows_per_table=7))
    assert [t.num_rows for t in tables] == [7] * (len(texts) // 7) + ([len(texts) % 7] if len(texts) % 7 else [])
    assert pa.concat_tables(tables).column("text").to_pylist() == texts


def test_tables_of_long_texts_hold_fewer_rows(tmp_path, monkeypatch):
    """A table closes at ``rows_per_table`` rows or once its texts reach ``corpus.TABLE_CHARACTERS``, whichever
    comes first: the reader's memory follows the text, not the row count."""
    monkeypatch.setattr("sbert_ray.data.corpus.TABLE_CHARACTERS", 1000)
    path = tmp_path / "corpus.txt"
    texts = ["x" * 300] * 10 + ["short"] * 30
    path.write_text("\n".join(texts))
    tables = list(open_corpus(str(path))[0].tables(rows_per_table=8))
    assert [t.num_rows for t in tables] == [4, 4, 8, 8, 8, 8]  # 4 x 300 characters pass 1,000 at the 4th
    assert pa.concat_tables(tables).column("text").to_pylist() == texts
    assert pa.concat_tables(tables).column("id").to_pylist() == list(range(40))


def test_text_file_rows_are_its_non_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes("\ufefffirst\r\n\n  \nsecond \nthird".encode())
    assert list(open_corpus(str(path))[0].rows()) == [(0, "first"), (1, "second "), (2, "third")]


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
        ("a-folder.csv", "sentence", "no files found"),  # a folder is read as shards: here none
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

    monkeypatch.setattr("sbert_ray.runs.per_file.connect_ray", no_ray)
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
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_sbert_ray_encode.json", "corpus.txt.parquet"]


def test_registered_dataset_from_the_command_line(local_ray, tmp_path, tiny_model_dir, data_dir, capsys):
    out = tmp_path / "sick"
    args = ["encode", "--model", str(tiny_model_dir), "--input", "sickr:trial", "--data-dir", str(data_dir)]
    assert main([*args, "--output", str(out), "--batch-size", "16"]) == 0
    pairs = load_records("sickr", "trial", data_dir)
    texts = list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))
    assert f"wrote {len(texts)} embeddings (dimension 32) of 1 input files to {out}" in capsys.readouterr().out
    assert_embedded(out, texts, SentenceEncoder.load(str(tiny_model_dir)))
    assert sorted(p.name for p in out.iterdir()) == ["_sbert_ray_encode.json", "sickr-trial.parquet"]
    assert main([*args, "--output", str(out)]) == 0  # a rerun resumes: the complete file is kept
    assert "wrote 0 embeddings (dimension 32) of 0 input files" in capsys.readouterr().out


@pytest.mark.cluster
def test_a_bad_row_midway_names_its_line_and_leaves_no_output(local_ray, tmp_path, tiny_model_dir, sentences, capfd):
    """Found by the Ray Data read task: our one line on the command line, not Ray's traceback around it. The
    command also removes the staging folder a killed run left in its output."""
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": s}) for s in sentences[:150]] + ['{"text": null}']
    path.write_text("\n".join(lines) + "\n")
    message = f"{path}, line 151: 'text' is NoneType, not text"
    with pytest.raises(DataError) as raised:
        encode_corpus(EncodeRequest(str(tiny_model_dir), str(path), tmp_path / "out", batch_size=16, block_bytes=2048))
    assert type(raised.value) is DataError and str(raised.value) == message
    capfd.readouterr()
    left = tmp_path / "out" / ".partial-0123456789ab" / "parts"  # as a killed run leaves its staging folder
    left.mkdir(parents=True)
    (left / "a.jsonl-00000.parquet").write_bytes(b"part")
    argv = ["encode", "--model", str(tiny_model_dir), "--input", str(path), "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.endswith(f"sbert-ray encode: error: {message}\n") and err.count(message) == 1
    assert "Traceback" not in err and "Exception occurred" not in err
    # no output, no staging: neither this run's nor the one a killed run left
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["_sbert_ray_encode.json"]


def shards(folder, sentences: list[str]) -> dict[str, list[str]]:
    """Three shards of a corpus in two formats, one in a subfolder: {key: texts}."""
    (folder / "more").mkdir(parents=True)
    texts = {"a.jsonl": sentences[:50], "b.parquet": sentences[50:120], "more/c.jsonl": sentences[120:]}
    for key, shard in texts.items():
        write_table(folder / key, shard, column="text")
    (folder / "_SUCCESS").write_text("")  # hidden files are not data
    return texts


def assert_shards_embedded(read_table, texts: dict[str, list[str]], encoder: SentenceEncoder) -> None:
    for key, shard in texts.items():
        table = read_table(f"{key}.parquet")
        assert table.column("file").to_pylist() == [key] * len(shard)
        assert table.column("id").to_pylist() == list(range(len(shard)))  # rows in file order, each once
        assert table.column("text").to_pylist() == shard
        vectors = np.array(table.column("vector").to_pylist(), dtype=np.float32)
        # The same float32 model in other batches (Ray Data blocks): ulps of values below ~4, so ~1e-6.
        np.testing.assert_allclose(vectors, encoder.encode(shard, batch_size=16), atol=1e-5, rtol=1e-5)


def test_a_folder_of_shards_gives_one_file_each_and_a_rerun_writes_only_what_is_missing(
    local_ray, tmp_path, tiny_model_dir, sentences
):
    texts = shards(tmp_path / "corpus", sentences)
    out = tmp_path / "out"
    request = EncodeRequest(str(tiny_model_dir), str(tmp_path / "corpus"), out, batch_size=16, block_bytes=2048)
    result = encode_corpus(request)
    assert (result.rows, result.files_written, result.files_skipped) == (len(sentences), 3, 0)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "_sbert_ray_encode.json", "a.jsonl.parquet", "b.parquet.parquet", "more", "more/c.jsonl.parquet"
    ]  # fmt: skip
    assert_shards_embedded(lambda name: pq.read_table(out / name), texts, SentenceEncoder.load(str(tiny_model_dir)))

    kept = {name: (out / name).stat().st_mtime_ns for name in ("a.jsonl.parquet", "more/c.jsonl.parquet")}
    (out / "b.parquet.parquet").unlink()
    result = encode_corpus(request)
    assert (result.rows, result.files_written, result.files_skipped) == (70, 1, 2)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # untouched
    assert pq.read_table(out / "b.parquet.parquet").column("text").to_pylist() == texts["b.parquet"]


def test_more_gpu_replicas_than_the_cluster_has_are_refused_at_once(local_ray, tmp_path, tiny_model_dir):
    path = tmp_path / "corpus.txt"
    path.write_text("one sentence\n")
    request = EncodeRequest(str(tiny_model_dir), str(path), tmp_path / "out", workers=2, device="cuda")
    with pytest.raises(
        ConfigError,
        match=r"--workers 2 encoder replicas: 2 of 1 CPU, 1 GPU each, but this cluster "
        r"can hold at most 0 \(its nodes: 1 x 2 CPU\)",
    ):
        encode_corpus(request)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["_sbert_ray_encode.json"]  # claimed, nothing written


def test_a_rerun_with_another_model_is_refused_before_ray(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr("sbert_ray.runs.per_file.connect_ray", lambda: pytest.fail("Ray was started"))
    path, out = tmp_path / "corpus.txt", tmp_path / "out"
    path.write_text("one sentence\n")
    out.mkdir()
    (out / "_sbert_ray_encode.json").write_text(
        json.dumps({"model": "another-model", "column": None, "prompt_name": None})
    )
    with pytest.raises(ConfigError, match=r"holds embeddings made with \{'model': 'another-model'"):
        encode_corpus(EncodeRequest(str(tiny_model_dir), str(path), out))
    assert [p.name for p in out.iterdir()] == ["_sbert_ray_encode.json"]


def test_replicas_are_counted_against_every_node_kind():
    kinds = [NodeKind({"CPU": 8, "GPU": 2}, 2), NodeKind({"CPU": 4}, 3)]
    gpu, cpu = {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 0}
    assert actors_problem(kinds, gpu, 4, "--workers 4") is None
    assert actors_problem(kinds, gpu, 5, "--workers 5") == (
        "--workers 5: 5 of 1 CPU, 1 GPU each, but this cluster can hold at most 4 (its nodes: 2 x 8 CPU, 2 GPU, "
        "3 x 4 CPU)"
    )
    assert actors_problem(kinds, cpu, 28, "w") is None and "at most 28" in actors_problem(kinds, cpu, 29, "w")
    assert actors_problem([NodeKind({"CPU": 4, "GPU": 1}, math.inf)], gpu, 1000, "w") is None  # may grow
    assert actors_problem([], gpu, 1000, "w") is None  # unknown: a cluster we joined without its maximum


@pytest.mark.cluster
def test_shards_on_object_storage_are_read_and_written_there(s3_server, tmp_path, tiny_model_dir, sentences):
    """Input and output under s3:// prefixes; the cluster's processes reach the object store as cloud nodes do."""
    client = s3_server.client()
    texts = shards(tmp_path / "corpus", sentences)
    for path in (tmp_path / "corpus").rglob("*.*"):
        client.upload_file(str(path), BUCKET, f"encode-in/{path.relative_to(tmp_path / 'corpus')}")
    with ray_with_env(s3_server.env):
        request = EncodeRequest(str(tiny_model_dir), f"s3://{BUCKET}/encode-in", f"s3://{BUCKET}/encode-out")
        assert encode_corpus(request).files_written == 3
    objects = client.list_objects_v2(Bucket=BUCKET, Prefix="encode-out/")["Contents"]
    # No staging objects left; "encode-out/" itself may remain as the empty marker pyarrow keeps for a folder.
    keys = sorted(o["Key"] for o in objects if not o["Key"].endswith("/"))
    assert keys == ["encode-out/_sbert_ray_encode.json"] + [f"encode-out/{key}.parquet" for key in texts]

    def read_table(name: str) -> pa.Table:
        return pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=f"encode-out/{name}")["Body"].read()))

    assert_shards_embedded(read_table, texts, SentenceEncoder.load(str(tiny_model_dir)))


@contextlib.contextmanager
def ray_with_env(env: dict[str, str]):
    """This process and a fresh local cluster with ``env`` (the session's cluster is stopped; the next test that asks
    for ``local_ray`` starts it anew)."""
    ray.shutdown()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        runtime_env = {"env_vars": {**env, **NO_STATE_API}}
        ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=runtime_env)
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture
def prompted_model(tiny_model_dir, tmp_path):
    encoder = SentenceEncoder.load(str(tiny_model_dir), prompts={"query": "query: ", "document": "passage: "})
    encoder.save(tmp_path / "prompted")
    return tmp_path / "prompted", encoder


def test_an_unknown_prompt_name_is_refused_before_ray(prompted_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sbert_ray.runs.per_file.connect_ray", lambda: pytest.fail("Ray was started"))
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


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_whole_rows_are_every_column_of_a_table_with_its_id(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    texts = [text.replace("\n", " ") for text in AWKWARD]  # TSV has no quoting
    write_table(path, texts)
    (corpus,) = open_corpus(str(path), "sentence")
    tables = list(corpus.whole_rows(3, "row"))
    assert [t.num_rows for t in tables] == [3, 1]
    whole = pa.concat_tables(tables)
    assert whole.column_names == ["row", "other", "sentence"] and whole.column("row").to_pylist() == [0, 1, 2, 3]
    assert whole.column("sentence").to_pylist() == texts
    assert [str(v) for v in whole.column("other").to_pylist()] == ["0", "1", "2", "3"]  # CSV/TSV values as text


def test_keep_columns_refuses_what_has_no_columns_or_a_vector_already_before_ray(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "corpus.txt").write_text("a sentence\n")
    pq.write_table(pa.table({"text": ["a dog"], "vector": [[1.0]]}), tmp_path / "encoded.parquet")
    for name, message in [
        ("corpus.txt", "--keep-columns keeps the columns of table files (.csv, .tsv, .jsonl, .parquet)"),
        ("encoded.parquet", "already has a column 'vector', where the embeddings would go"),
    ]:
        args = ["encode", "--model", str(tiny_model_dir), "--input", str(tmp_path / name), "--keep-columns"]
        assert main([*args, "--output", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"sbert-ray encode: error: {tmp_path / name}: {message}\n"
    assert not (tmp_path / "out").exists()


def test_keep_columns_writes_each_row_beside_its_vector_as_objective_mse_reads_it(
    local_ray, tmp_path, tiny_model_dir, sentences
):
    """The teacher as a stage of multilingual distillation: its vectors of one column written beside the row's
    other columns (an ``id`` of the input's own among them), which a stage of objective mse reads as (text,
    translation) with the vector as the label; the teacher's size is known before the cluster from the first row."""
    from sbert_ray.config import StageConfig
    from sbert_ray.training.sources import read_tables, stage_sources, teacher_dimension

    rows = pa.table({"id": list(range(40, 0, -1)), "english": sentences[:40], "translation": sentences[40:80]})
    pq.write_table(rows, tmp_path / "parallel.parquet")
    out = tmp_path / "teacher"
    args = ["encode", "--model", str(tiny_model_dir), "--input", str(tmp_path / "parallel.parquet"), "--column"]
    assert main([*args, "english", "--keep-columns", "--output", str(out), "--batch-size", "8"]) == 0
    table = pq.read_table(out / "parallel.parquet.parquet")
    assert table.drop_columns(["vector"]).equals(rows)  # every row once, in file order, as it came
    vectors = np.array(table.column("vector").to_pylist(), dtype=np.float32)
    expected = SentenceEncoder.load(str(tiny_model_dir)).encode(sentences[:40], batch_size=16)
    np.testing.assert_allclose(vectors, expected, atol=1e-5, rtol=1e-5)  # as assert_embedded

    stage = StageConfig(dataset=str(out), objective="mse", columns={"text": "english"})
    (source,) = stage_sources(stage, 0)
    assert teacher_dimension(source, stage) == 32
    (read,) = read_tables(source, source.files[0], stage, None)
    assert read.column("text_0").to_pylist() == sentences[:40]
    assert read.column("text_1").to_pylist() == sentences[40:80]
    np.testing.assert_array_equal(np.array(read.column("label").to_pylist(), dtype=np.float32), vectors)
