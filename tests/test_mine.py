"""Hard-negative mining: the same negatives as sentence-transformers' ``mine_hard_negatives`` (Ray-free), the
settings checked, and ``sbert-ray mine`` on a cluster: n-tuples as parquet, resumed per shard, a corpus on S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import local_cluster
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import mine_hard_negatives

from sbert_ray.cli import main
from sbert_ray.config import ConfigError
from sbert_ray.data.readers import load_records
from sbert_ray.data.records import DataError
from sbert_ray.evaluation.hard_negatives import MiningPairs, MiningSettings, Texts, mine, output_columns
from sbert_ray.evaluation.retrieval import text_chunks
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.resolve import packaged_model_dir
from sbert_ray.models.teachers import load_teacher
from sbert_ray.runs import owned_paths
from sbert_ray.runs.cluster import input_errors_unwrapped
from sbert_ray.runs.corpus_embeddings import WORK_AREA, CorpusEmbeddings
from sbert_ray.runs.mine_negatives import MANIFEST, MineRequest, mine_negatives
from sbert_ray.runs.mine_negatives import _manifest as mining_manifest
from sbert_ray.runs.mining_corpus import StoredCorpus

# Our encoder and sentence-transformers' give all-MiniLM-L6-v2 vectors equal to ~1e-7 (other kernels), so cosine
# scores agree to ~1e-6, and these 200 pairs have candidates whose scores lie 1e-7 apart: such near-ties may come
# out in either order on another processor. Negatives must be the same except where they swap within a near-tie.
NEAR_TIE = 1e-5


@pytest.fixture(scope="module")
def stsb_pairs(data_dir) -> tuple[list[str], list[str]]:
    """200 STSb training pairs (sentence1 -> sentence2), with repeated anchors kept as they come."""
    pairs = load_records("stsb", "train", data_dir)[:200]
    return [p.sentence1 for p in pairs], [p.sentence2 for p in pairs]


@pytest.fixture(scope="module")
def dev_sentences(data_dir) -> list[str]:
    return [p.sentence2 for p in load_records("stsb", "dev", data_dir)[:100]]


class EncodedOnce:
    """all-MiniLM-L6-v2 in our encoder, every text encoded once up front (the cases share their texts)."""

    def __init__(self, encoder: SentenceEncoder, texts: list[str]):
        texts = list(dict.fromkeys(texts))
        self.vectors = dict(zip(texts, encoder.encode(texts, batch_size=32, convert_to="numpy"), strict=True))

    def encode(self, texts, batch_size=32, convert_to="numpy", prompt_name=None):
        return np.stack([self.vectors[text] for text in texts])

    def score(self, anchor: str, text: str) -> float:
        a, b = (torch.nn.functional.normalize(torch.as_tensor(self.vectors[t]), dim=0) for t in (anchor, text))
        return float(a @ b)


@pytest.fixture(scope="module")
def minilm(minilm_ref, stsb_pairs, dev_sentences):
    ours = EncodedOnce(SentenceEncoder.load(minilm_ref), [*stsb_pairs[0], *stsb_pairs[1], *dev_sentences])
    return ours, SentenceTransformer(str(packaged_model_dir(minilm_ref)), device="cpu")


CASES = {  # settings, and whether a separate corpus (100 STSb dev sentences) joins the positives
    "defaults": (MiningSettings(num_negatives=3), False),
    "range-margin-triplets": (
        MiningSettings(num_negatives=2, range_min=3, range_max=20, margin=0.05, output_format="triplet"),
        True,
    ),
    "relative-max": (MiningSettings(num_negatives=4, relative_margin=0.05, max_score=0.7), False),
    "min-max-corpus": (MiningSettings(num_negatives=3, min_score=0.3, max_score=0.8, range_max=12), True),
}


@pytest.mark.parametrize("settings, separate_corpus", CASES.values(), ids=CASES)
def test_same_negatives_as_sentence_transformers(
    minilm, stsb_pairs, dev_sentences, settings, separate_corpus, tmp_path_factory
):
    ours_encoder, theirs_model = minilm
    corpus = dev_sentences if separate_corpus else None
    anchors, positives = stsb_pairs  # some anchors are corpus texts too: neither miner makes one its own negative
    assert set(anchors) & {*positives, *(corpus or ())}
    pairs = MiningPairs.build(anchors, positives, corpus or ())
    # small chunks: the corpus is searched in 4 chunks and their top k merged
    negatives = mine(ours_encoder, pairs, settings, batch_size=32, query_chunk=50, corpus_chunk=100)
    ours = output_columns(pairs, negatives, settings)

    theirs = mine_hard_negatives(
        Dataset.from_dict({"anchor": anchors, "positive": positives}),
        theirs_model,
        corpus=corpus,
        range_min=settings.range_min,
        range_max=settings.range_max,
        max_score=settings.max_score,
        min_score=settings.min_score,
        absolute_margin=settings.margin,
        relative_margin=settings.relative_margin,
        num_negatives=settings.num_negatives,
        sampling_strategy="top",
        output_format=settings.output_format,
        batch_size=32,
        verbose=False,
        cache_folder=str(tmp_path_factory.getbasetemp() / "st-embeddings"),  # encoded once for every case
    ).to_dict()
    assert list(theirs) == list(ours)
    ours_rows, theirs_rows = _rows(ours), _rows(theirs)
    assert len(ours_rows) > 150  # enough mined to compare something
    assert [row[:2] for row in ours_rows] == [row[:2] for row in theirs_rows]  # the same (anchor, positive) rows
    for mine_row, their_row in zip(ours_rows, theirs_rows, strict=True):
        for ours_text, theirs_text in zip(mine_row[2:], their_row[2:], strict=True):
            if ours_text != theirs_text:  # only a near-tie may swap
                anchor = mine_row[0]
                gap = abs(ours_encoder.score(anchor, ours_text) - ours_encoder.score(anchor, theirs_text))
                assert gap < NEAR_TIE, (anchor, ours_text, theirs_text)


def _rows(columns: dict[str, list[str]]) -> list[tuple[str, ...]]:
    return list(zip(*columns.values(), strict=True))


@pytest.mark.parametrize(
    "filters", [{"max_score": 0.9, "min_score": 0.2, "relative_margin": 0.05}, {}], ids=["filters", "no-filter"]
)
def test_rescored_negatives_and_scores_equal_sentence_transformers(
    minilm, stsb_pairs, tiny_cross_encoder_dir, tmp_path_factory, filters
):
    """A cross-encoder rescores the candidates and positives, and every filter uses its scores: max_score drops
    what it finds relevant, min_score what it finds unrelated, relative_margin compares with its positive score.
    Without a filter the teacher still ranks the candidates and gives the scores (sentence-transformers 6.3
    rescores whenever it has a cross-encoder): the teacher's scores that distillation reads."""
    settings = MiningSettings(num_negatives=2, rescored=True, output_scores=True, **filters)
    ours_encoder, theirs_model = minilm
    teacher = load_teacher(str(tiny_cross_encoder_dir))
    anchors, positives = stsb_pairs[0][:120], stsb_pairs[1][:120]
    pairs = MiningPairs.build(anchors, positives)
    rescore = lambda queries, texts: teacher.score(queries, [texts], 32)[0]  # noqa: E731
    ours = output_columns(
        pairs, mine(ours_encoder, pairs, settings, query_chunk=50, corpus_chunk=100, rescore=rescore), settings
    )

    theirs = mine_hard_negatives(
        Dataset.from_dict({"anchor": anchors, "positive": positives}),
        theirs_model,
        cross_encoder=teacher.model,
        max_score=settings.max_score,
        min_score=settings.min_score,
        relative_margin=settings.relative_margin,
        num_negatives=settings.num_negatives,
        range_max=settings.range_max,
        output_format="n-tuple",
        output_scores=True,
        batch_size=32,
        verbose=False,
        cache_folder=str(tmp_path_factory.getbasetemp() / "st-embeddings"),
    ).to_dict()
    n = settings.num_negatives
    negatives = [f"negative_{i}" for i in range(1, n + 1)]
    assert list(theirs) == ["anchor", "positive", *negatives, "scores"]
    assert len(ours["anchor"]) > 20  # enough mined to compare something
    assert (ours["anchor"], ours["positive"]) == (theirs["anchor"], theirs["positive"])
    ours_scores = np.array([ours[f"score_{name}"] for name in ("positive", *negatives)]).T
    theirs_scores = np.array(theirs["scores"])
    # Each pair scored alone (ours in other batches): float32 BERT and a sigmoid, so ~1e-6.
    np.testing.assert_allclose(ours_scores, theirs_scores, atol=1e-5, rtol=0)
    if filters:
        assert settings.min_score <= theirs_scores[:, 1:].min() and theirs_scores[:, 1:].max() <= settings.max_score
    for name in negatives:
        for anchor, ours_text, theirs_text, score in zip(
            ours["anchor"], ours[name], theirs[name], ours[f"score_{name}"], strict=True
        ):
            if ours_text != theirs_text:  # only a near-tie may swap
                their_score = teacher.score([anchor], [[theirs_text]], 1)[0, 0]
                assert abs(score - their_score) < NEAR_TIE, (anchor, ours_text, theirs_text)


def test_random_sampling_draws_from_the_window_in_score_order(tiny_model_dir, stsb_pairs):
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    pairs = MiningPairs.build(*stsb_pairs)
    top = mine(encoder, pairs, MiningSettings(num_negatives=8, range_max=8))
    drawn = [
        mine(encoder, pairs, MiningSettings(num_negatives=3, range_max=8, sampling="random", seed=s)) for s in (1, 1, 2)
    ]
    assert drawn[0] == drawn[1] and drawn[0].rows != drawn[2].rows  # seeded: reproducible, and really random
    for window, rows, scores in zip(top.rows, drawn[0].rows, drawn[0].scores, strict=True):
        assert set(rows) <= set(window) and len(rows) == min(3, len(window))
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_negatives": 0}, "num_negatives must be at least 1"),
        ({"range_min": -1}, "range_min must be >= 0"),
        ({"range_min": 5, "range_max": 6, "num_negatives": 2}, "fewer than num_negatives=2"),
        ({"margin": float("nan")}, "margin must be a finite number"),
        ({"sampling": "best"}, "sampling must be top or random"),
    ],
)
def test_bad_settings_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        MiningSettings(**options)


# --- sbert-ray mine ---------------------------------------------------------------------------------------------


@pytest.fixture
def pairs_file(tmp_path, stsb_pairs) -> Path:
    """60 STSb pairs as JSON lines with sentence-transformers-style column names of the user's choosing."""
    path = tmp_path / "pairs.jsonl"
    rows = zip(stsb_pairs[0][:60], stsb_pairs[1][:60], strict=True)
    path.write_text("".join(json.dumps({"query": a, "answer": p}) + "\n" for a, p in rows))
    return path


def mine_command(model, pairs_file, output, *options) -> list[str]:
    return ["mine", "--model", str(model), "--pairs", str(pairs_file), "--output", str(output), "--quiet",
            "--anchor-column", "query", "--positive-column", "answer", *options]  # fmt: skip


def test_mine_writes_parquet_shards_and_a_rerun_resumes(local_ray, tiny_model_dir, pairs_file, tmp_path, capsys):
    """Three shards mined on two encoder actors: the same rows as the Ray-free miner in one process; a
    rerun keeps the complete shards untouched and mines only the missing one; other settings are refused."""
    output = tmp_path / "mined"
    options = ("--shard-size", "20", "--num-negatives", "2", "--batch-size", "8", "--range-min", "1")
    assert main(mine_command(tiny_model_dir, pairs_file, output, *options, "--workers", "2")) == 0
    shards = sorted(output.glob("part-*.parquet"))
    assert [p.name for p in shards] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    mined = pa.concat_tables([pq.read_table(p) for p in shards]).to_pydict()

    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    pairs = MiningPairs.build([r["query"] for r in rows], [r["answer"] for r in rows])
    settings = MiningSettings(num_negatives=2, range_min=1)
    expected = output_columns(pairs, mine(SentenceEncoder.load(str(tiny_model_dir)), pairs, settings), settings)
    assert mined == expected and len(mined["anchor"]) > 40
    assert "(embedded once, in 1 chunks)" in capsys.readouterr().out

    # The corpus in chunks of 16, embedded once for the three shards (the chunks come back from the actors in any
    # order): the rows of the Ray-free miner searching the same chunks.
    chunked = MineRequest(
        str(tiny_model_dir), str(pairs_file), tmp_path / "chunked", settings, "query", "answer", batch_size=8,
        workers=2, shard_size=20, corpus_chunk=16,
    )  # fmt: skip
    result = mine_negatives(chunked)
    assert result.shards_written == 3 and result.corpus_chunks_embedded == -(-len(pairs.corpus) // 16) > 2
    one_process = mine(SentenceEncoder.load(str(tiny_model_dir)), pairs, settings, batch_size=8, corpus_chunk=16)
    written = pa.concat_tables([pq.read_table(p) for p in sorted(Path(chunked.output).glob("*.parquet"))])
    assert written.to_pydict() == output_columns(pairs, one_process, settings)

    kept = shards[0].stat().st_mtime_ns
    shards[1].unlink()
    capsys.readouterr()
    assert main(mine_command(tiny_model_dir, pairs_file, output, *options)) == 0  # one worker: the same shards
    printed = capsys.readouterr().out
    assert "shard 1/3" in printed and "complete from an earlier run" in printed and "1 shards" in printed
    assert shards[0].stat().st_mtime_ns == kept
    assert pa.concat_tables([pq.read_table(p) for p in shards]).to_pydict() == mined

    other = mine_command(tiny_model_dir, pairs_file, output, *options[:-1], "0")  # range_min 0: other settings
    assert main(other) == 2
    assert "holds shards mined with other settings" in capsys.readouterr().err

    # The anchors as the corpus, and a max_score that leaves nothing: no 0-row shard (training would refuse it),
    # one line saying what the filters dropped, the anchors themselves among it.
    empty = tmp_path / "nothing-left"
    corpus = ("--corpus", str(pairs_file), "--corpus-column", "query", "--max-score", "-1")
    assert main(mine_command(tiny_model_dir, pairs_file, empty, *options, *corpus)) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sbert-ray mine: error:")]
    assert error.startswith("sbert-ray mine: error: part-00000.parquet: none of its 20 anchors has 2 negatives left")
    assert f"anchor {len(set(pairs.queries[:20]))}," in error
    assert not list(empty.glob("*.parquet"))


def test_rescoring_runs_on_the_encoder_actors(local_ray, tiny_model_dir, tiny_cross_encoder_dir, pairs_file, tmp_path):
    """--rescore-with on two encoder actors, two shards: the negatives of the Ray-free miner with the teacher in
    this process, and its scores to float32 noise (the actors score pieces of the pairs, batched by length within
    each piece); the corpus embeddings' work area is gone once every shard is written."""
    settings = MiningSettings(num_negatives=2, max_score=0.9, rescored=True, output_scores=True)
    request = MineRequest(
        str(tiny_model_dir), str(pairs_file), tmp_path / "rescored", settings, "query", "answer", batch_size=8,
        workers=2, shard_size=30, rescore_with=str(tiny_cross_encoder_dir),
    )  # fmt: skip
    assert mine_negatives(request).shards_written == 2
    written = pa.concat_tables([pq.read_table(p) for p in sorted(Path(request.output).glob("*.parquet"))]).to_pydict()
    assert not (Path(request.output) / WORK_AREA).exists()

    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    pairs = MiningPairs.build([r["query"] for r in rows], [r["answer"] for r in rows])
    teacher = load_teacher(str(tiny_cross_encoder_dir))
    rescore = lambda queries, texts: teacher.score(queries, [texts], 8)[0]  # noqa: E731
    negatives = mine(SentenceEncoder.load(str(tiny_model_dir)), pairs, settings, batch_size=8, rescore=rescore)
    expected = output_columns(pairs, negatives, settings)
    assert len(written["anchor"]) > 40 and negatives.dropped["max_score"] > 0  # the teacher's scores filtered
    for name, values in expected.items():
        if name.startswith("score_"):
            np.testing.assert_allclose(written[name], values, atol=1e-5, rtol=0)
        else:
            assert written[name] == values, name


def test_a_stored_corpus_has_the_rows_and_texts_of_the_one_in_process(local_ray):
    """Blocks with repeats within and across them (one empty), in chunks of 4 that span blocks: the rows of
    ``dict.fromkeys``, looked up and taken as ``Texts`` does; a null text is a DataError naming its source."""
    blocks = [["a", "b", "a"], [], ["c", "b", "d", "e"], ["f", "g", "a", "h", "i"]]
    stored = StoredCorpus.store([(ray.put(pa.table({"text": block})), "block") for block in blocks], chunk=4)
    in_process = Texts(dict.fromkeys(text for block in blocks for text in block))
    assert len(stored) == len(in_process) == 9
    assert [ray.get(ref).to_pylist() for ref in stored.chunks] == [in_process[i : i + 4] for i in range(0, 9, 4)]
    asked = ["h", "a", "zz", "c", "a"]
    assert stored.rows_of(asked) == in_process.rows_of(asked) == [7, 0, -1, 2, 0]
    rows = [8, 0, 3, 3, 5, 1]
    assert stored.take(rows) == in_process.take(rows)
    with pytest.raises(DataError, match="s3://corpus/: a null where text should be"), input_errors_unwrapped():
        StoredCorpus.store([(ray.put(pa.table({"text": ["a", None]})), "s3://corpus/")], chunk=4)


class InProcess:
    """``RayEncoder.map_unordered`` in this process, the results in reverse order (workers finish in any order)."""

    def __init__(self, encoder: SentenceEncoder):
        self.encoder = encoder

    def map_unordered(self, function, items, *shared):
        return reversed([function(self.encoder, *item, *shared) for item in items])


def test_corpus_embeddings_are_written_once_and_resumed(tiny_model_dir, dev_sentences, tmp_path):
    """Each chunk's file holds the embeddings a search of that chunk computes; a rerun encodes only the chunks
    whose files are missing, and one with another batch size (other padding, other last bits) all of them."""
    encoder, texts = SentenceEncoder.load(str(tiny_model_dir)), dev_sentences[:50]
    chunk_texts = lambda start, stop: pa.array(texts[start:stop])  # noqa: E731
    stored = CorpusEmbeddings.open(tmp_path, len(texts), 16, 8)
    assert stored.embed(InProcess(encoder), chunk_texts, 8) == 4
    for (embeddings, rows), (chunk, chunk_rows) in zip(stored.chunks(), text_chunks(texts, 16), strict=True):
        assert torch.equal(rows, chunk_rows)
        np.testing.assert_array_equal(embeddings, encoder.encode(chunk, batch_size=8, convert_to="numpy"))

    kept = stored.path(0, 16).stat().st_mtime_ns
    stored.path(16, 32).unlink()  # a run stopped before this chunk's file was written
    assert CorpusEmbeddings.open(tmp_path, len(texts), 16, 8).embed(InProcess(encoder), chunk_texts, 8) == 1
    assert stored.path(0, 16).stat().st_mtime_ns == kept and stored.path(16, 32).exists()
    assert CorpusEmbeddings.open(tmp_path, len(texts), 16, 4).embed(InProcess(encoder), chunk_texts, 4) == 4

    owned_paths.remove_work_area(tmp_path, WORK_AREA)
    assert not stored.folder.exists() and tmp_path.is_dir()


def blank_anchor(folder: Path) -> str:
    """Pairs whose second anchor is white space, which training refuses."""
    path = folder / "blank.jsonl"
    path.write_text("".join(json.dumps({"query": q, "answer": "an answer"}) + "\n" for q in ("a question", " ")))
    return str(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda cmd, tmp: cmd + ["--anchor-column", "question"], "no 'question' field"),
        (lambda cmd, tmp: cmd + ["--corpus", str(tmp / "missing.parquet")], "missing.parquet: no such file"),
        (lambda cmd, tmp: cmd + ["--range-min", "4", "--range-max", "5"], "fewer than num_negatives=3"),
        (lambda cmd, tmp: cmd[:6] + [str(tmp)] + cmd[7:], "is not a mining output of sbert-ray"),
        (lambda cmd, tmp: cmd[:4] + [blank_anchor(tmp)] + cmd[5:], "blank.jsonl, row 2: column 'query' is empty"),
        (lambda cmd, tmp: cmd + ["--rescore-with", str(tmp)], "neither a cross-encoder"),
    ],
    ids=["column", "corpus", "range", "output", "blank", "teacher"],
)
def test_bad_input_is_one_line_before_ray(tiny_model_dir, pairs_file, tmp_path, capsys, change, message):
    (tmp_path / "notes.txt").write_text("someone's file\n")
    command = change(mine_command(tiny_model_dir, pairs_file, tmp_path / "out"), tmp_path)
    assert main(command) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("sbert-ray mine: error:") and message in error and "\n" not in error


def test_a_corpus_on_object_storage_stays_off_the_driver(
    token_head, s3_server, tiny_model_dir, pairs_file, data_dir, tmp_path
):
    """`sbert-ray mine` as a user runs it, its corpus under an s3:// prefix, read by Ray Data on the cluster in file
    order and deduplicated there: two parquet files of 80 STSb sentences, five of them twice, give the negatives of
    the Ray-free miner given those texts. 1,000 texts of ~20 kB more (20 MB) leave the driver's private memory
    (RssAnon: the object store's pages are Ray's shared memory) within a quarter of that: the texts never reach it."""
    s3, env = s3_server.client(), {**os.environ, **token_head.env, **s3_server.env, "RAY_ADDRESS": token_head.gcs}

    def upload(prefix: str, parts: dict[str, list[str]]) -> str:
        for name, texts in parts.items():
            pq.write_table(pa.table({"sentence": texts}), tmp_path / name)
            s3.upload_file(str(tmp_path / name), local_cluster.BUCKET, f"{prefix}/{name}")
        return f"s3://{local_cluster.BUCKET}/{prefix}/"

    def mine_on_cluster(corpus: str, output: Path) -> int:
        """The driver's peak private memory, in bytes, sampled every 20 ms."""
        command = mine_command(tiny_model_dir, pairs_file, output, "--corpus", corpus, "--corpus-column", "sentence")
        with (tmp_path / f"{output.name}.log").open("w") as log:
            driver = subprocess.Popen(
                [sys.executable, "-m", "sbert_ray.cli", *command, "--num-negatives", "2", "--triplets"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            peak = 0
            while driver.poll() is None:
                peak = max(peak, private_memory(driver.pid))
                time.sleep(0.02)
        assert driver.returncode == 0, (tmp_path / f"{output.name}.log").read_text()[-3000:]
        return peak

    sentences = [p.sentence2 for p in load_records("stsb", "dev", data_dir)[:80]]
    small = upload("mine-corpus", {"a.parquet": sentences[:50], "b.parquet": sentences[50:] + sentences[:5]})
    small_peak = mine_on_cluster(small, tmp_path / "mined")
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    pairs = MiningPairs.build([r["query"] for r in rows], [r["answer"] for r in rows], sentences + sentences[:5])
    settings = MiningSettings(num_negatives=2, output_format="triplet")
    expected = output_columns(pairs, mine(SentenceEncoder.load(str(tiny_model_dir)), pairs, settings), settings)
    assert pq.read_table(tmp_path / "mined" / "part-00000.parquet").to_pydict() == expected
    assert set(expected["negative"]) & set(sentences)  # the corpus did supply negatives

    words = np.random.default_rng(0).choice(" ".join(sentences).split(), size=(1000, 4000))
    long_texts = [" ".join(row) for row in words]
    large = upload("mine-large-corpus", {f"{i}.parquet": long_texts[i::4] for i in range(4)} | {"z.parquet": sentences})
    added = sum(map(len, long_texts))
    assert added > 18e6
    large_peak = mine_on_cluster(large, tmp_path / "mined-large")
    print(f"driver RssAnon peaks: {small_peak / 1e6:.1f} MB, {large_peak / 1e6:.1f} MB with {added / 1e6:.1f} MB more")
    assert large_peak - small_peak < added / 4


def private_memory(pid: int) -> int:
    """A process's anonymous resident memory (RssAnon), 0 once it is gone (or a zombie, which has none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def test_an_anchor_is_never_its_own_negative_and_is_counted(tiny_model_dir, stsb_pairs):
    """A corpus that holds the anchors: each anchor's best candidate is itself (score 1), dropped and counted."""
    anchors, positives = stsb_pairs[0][:30], stsb_pairs[1][:30]
    pairs = MiningPairs.build(anchors, positives, corpus=anchors)
    negatives = mine(SentenceEncoder.load(str(tiny_model_dir)), pairs, MiningSettings(num_negatives=2))
    assert negatives.dropped["anchor"] == len(pairs.queries)
    for query, rows in zip(pairs.queries, negatives.rows, strict=True):
        assert len(rows) == 2 and query not in [pairs.corpus[row] for row in rows]


def test_approximate_search_finds_most_of_the_exact_negatives(tiny_model_dir, stsb_pairs, dev_sentences):
    """faiss HNSW per corpus chunk (the optional extra, which the dev extra installs): most of the exact negatives,
    each with its exact score."""
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    pairs = MiningPairs.build(*stsb_pairs, dev_sentences)
    settings = MiningSettings(num_negatives=5)
    exact = mine(encoder, pairs, settings, corpus_chunk=100)
    approximate = mine(encoder, pairs, settings, corpus_chunk=100, approximate=True)
    found = sum(len(set(a) & set(e)) for a, e in zip(approximate.rows, exact.rows, strict=True))
    assert found >= 0.9 * sum(map(len, exact.rows))
    scores = {
        (q, row): s
        for q, (rows, ss) in enumerate(zip(exact.rows, exact.scores, strict=True))
        for row, s in zip(rows, ss, strict=True)
    }
    common = [
        (scores[q, row], s)
        for q, (rows, ss) in enumerate(zip(approximate.rows, approximate.scores, strict=True))
        for row, s in zip(rows, ss, strict=True)
        if (q, row) in scores
    ]
    assert common and all(abs(a - b) < 1e-5 for a, b in common)  # HNSW ranks by the same inner products


def test_an_approximate_output_resumes_only_with_the_corpus_chunks_it_was_mined_with(
    tiny_model_dir, pairs_file, tmp_path
):
    """HNSW searches each corpus chunk apart, so shards mined with other chunks would hold other negatives: a rerun
    into an approximate output with another chunk size is refused, naming it, before Ray starts. The exact search's
    negatives do not depend on the chunks, nor does its output."""
    output = tmp_path / "out"

    def request(chunk: int, approximate: bool = True) -> MineRequest:
        return MineRequest(str(tiny_model_dir), str(pairs_file), output, anchor_column="query",
                           positive_column="answer", corpus_chunk=chunk, approximate=approximate)  # fmt: skip

    owned_paths.claim_output(str(output), MANIFEST, mining_manifest(request(16)), "not ours")
    with pytest.raises(ConfigError, match=r"holds shards mined with other corpus_chunk \(mine.json\)"):
        mine_negatives(request(32))
    assert not ray.is_initialized()
    assert mining_manifest(request(16, approximate=False)) == mining_manifest(request(32, approximate=False))


def test_approximate_search_without_faiss_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "faiss" else object())
    with pytest.raises(ConfigError, match="approximate search needs faiss"):
        MineRequest("random:tiny", "pairs.jsonl", tmp_path / "out", approximate=True)
