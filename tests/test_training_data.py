"""What a stage trains on, streamed (Ray-free here: the same functions run in Ray Data's tasks and the workers):
sources listed and read with their rows checked, tokenisation, and the windowed batches: exactly as many per
worker whatever the shard, alike in length across ranks, deterministic for a seed, no duplicate texts in a
batch, several sources mixed batch by batch, and a resume that continues with the very batches it would have
taken. Nothing dropped silently: what a pass leaves out or repeats is counted."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, DatasetSource, ScalingConfig, StageConfig, TrainConfig
from sbert_ray.data import DataError
from sbert_ray.losses.registry import OBJECTIVES
from sbert_ray.models import load_encoder
from sbert_ray.models.load import TextTokenizer, load_tokenizer
from sbert_ray.models.random_bert import random_bert
from sbert_ray.training.batches import TokenizedRows, split_batch, tokenize_table, tokenize_texts, truncated_rows
from sbert_ray.training.loop import MicroBatch
from sbert_ray.training.sources import Source, known_rows, list_files, read_tables, stage_sources
from sbert_ray.training.stream import (
    BatchPlan,
    SourceCounts,
    SourceStream,
    StageBatches,
    batch_plan,
    cut_whole_window,
    pass_batches,
    stage_steps,
)


@pytest.fixture(scope="module")
def encoder():
    return random_bert("tiny", max_seq_length=32)


@pytest.fixture(scope="module")
def tokenizer(encoder):
    return encoder.tokenizer


def tokenized(texts: list[list[str]], tokenizer, max_seq_length: int = 32, prompts=None) -> pa.Table:
    encoder = TextTokenizer(tokenizer, max_seq_length, prompts or {})
    return tokenize_table(pa.table({f"text_{k}": c for k, c in enumerate(texts)}), encoder)


def shard(tokenizer, rows: int, seed: int, table_rows: int = 50) -> list[pa.Table]:
    """A worker's stream: pairs of random lengths, in tables of ``table_rows``."""
    rng = np.random.default_rng(seed)
    words = [" ".join(["w"] * int(n)) + f" {seed} {i}" for i, n in enumerate(rng.integers(1, 25, rows))]
    table = tokenized([words, [w + " b" for w in words]], tokenizer)
    return [table.slice(i, table_rows) for i in range(0, rows, table_rows)]


def test_user_file_scores_must_lie_in_zero_to_score_max(tmp_path) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text("sentence1\tsentence2\tscore\na\tb\t3\nc\td\t100\n")
    stage = StageConfig(dataset=str(path), objective="regression", score_max=5.0)
    (source,) = stage_sources(stage, 0)
    with pytest.raises(DataError, match=rf"^{path}, line 3: score 100 is outside this data's scale \[0, 5\]$"):
        list(read_tables(source, source.files[0], stage, None))


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_in_batch_negative_objectives_train_on_anchor_positive_files_with_or_without_a_negative(tmp_path, suffix):
    """The pairs `sbert-ray mine` reads train mnrl as they are; a negative column, where the file has one, is a hard
    negative; the triplet objective still needs one and names it."""
    rows = [("a man sleeps", "a person rests", "a dog barks"), ("a cat", "an animal", "a car")]

    def write(name: str, header: tuple[str, ...]):
        path = tmp_path / f"{name}{suffix}"
        if suffix == ".jsonl":
            path.write_text("".join(json.dumps(dict(zip(header, row, strict=False))) + "\n" for row in rows))
        else:
            separator = "," if suffix == ".csv" else "\t"
            path.write_text(
                "".join(separator.join(line) + "\n" for line in [header, *(r[: len(header)] for r in rows)])
            )
        return path

    def texts(path, objective: str) -> list[list[str]]:
        stage = StageConfig(dataset=str(path), objective=objective)
        (source,) = stage_sources(stage, 0)
        (table,) = read_tables(source, source.files[0], stage, None)
        return [table.column(name).to_pylist() for name in table.column_names]

    pairs, triplets = write("pairs", ("anchor", "positive")), write("triplets", ("anchor", "positive", "negative"))
    assert texts(pairs, "mnrl") == [[r[0] for r in rows], [r[1] for r in rows]]
    assert texts(triplets, "mnrl") == [[r[k] for r in rows] for k in range(3)]
    assert texts(triplets, "triplet") == texts(triplets, "mnrl")
    refusal = "missing column 'negative'" if suffix == ".jsonl" else "no column 'negative' for negative"
    with pytest.raises(DataError, match=rf"^{pairs}, line 1: {refusal}"):
        texts(pairs, "triplet")


def test_shards_are_listed_from_folders_and_globs_and_parquet_carries_mined_negatives(tmp_path) -> None:
    for i in range(3):
        rows = {"anchor": [f"a{i}{j}" for j in range(4)], "positive": [f"p{i}{j}" for j in range(4)]}
        rows |= {"negative_1": [f"n{i}{j}" for j in range(4)], "negative_2": [f"m{i}{j}" for j in range(4)]}
        pq.write_table(pa.table(rows), tmp_path / f"part-{i}.parquet")
    assert list_files(str(tmp_path), "k") == [str(tmp_path / f"part-{i}.parquet") for i in range(3)]
    assert list_files(str(tmp_path / "part-[12].parquet"), "k") == [str(tmp_path / f"part-{i}.parquet") for i in (1, 2)]
    stage = StageConfig(dataset=str(tmp_path), objective="mnrl")
    (source,) = stage_sources(stage, 0)
    table = pa.concat_tables(t for f in source.files for t in read_tables(source, f, stage, None))
    assert table.column_names == ["text_0", "text_1", "text_2", "text_3"]  # anchor, positive, 2 negatives
    assert table.column("text_3").to_pylist()[:2] == ["m00", "m01"] and table.num_rows == 12
    (tmp_path / "notes.csv").write_text("x\n")
    with pytest.raises(ConfigError, match="stages.0.dataset: .* mixes file types"):
        stage_sources(stage, 0)
    with pytest.raises(ConfigError, match=r"stages.0.dataset: .*missing.parquet does not exist"):
        stage_sources(StageConfig(dataset=str(tmp_path / "missing.parquet")), 0)


def test_truncated_texts_are_counted(tokenizer) -> None:
    # 3 word pieces + [CLS] + [SEP]: "a b c" is 5 tokens, so max_length 5 keeps it whole and 4 cuts it.
    texts = ["a b c", "a b", "a b c d e f", "a"]
    for max_length, expected in ((5, 1), (4, 2), (8, 0)):
        ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        assert truncated_rows(tokenizer, (texts,), ids, max_length).sum() == expected
    table = tokenized([texts, ["x " * 10] * 4], tokenizer, max_seq_length=5)
    assert table.column("truncated").to_pylist() == [1, 1, 2, 1]


def test_rows_tokenised_without_pyarrow_are_the_arrow_streams_and_cut_and_join_alike(tokenizer) -> None:
    """A worker without Ray tokenises to numpy rows (``tokenize_texts``); Ray Data's stream carries the same rows as
    Arrow tables (``tokenize_table``, read back by ``from_arrow``). Windows join and carry rows (``concat``,
    ``take``) as the tables did."""
    texts = [["a cat sat", "x " * 40, "a dog"], ["a mat", "y", "a log"]]
    labels = np.array([0.1, 0.5, 0.9], dtype=np.float32)
    encoder = TextTokenizer(tokenizer, 16, {})
    rows = tokenize_texts(texts, labels, encoder)
    table = pa.table({"text_0": texts[0], "text_1": texts[1], "label": labels})
    arrow = TokenizedRows.from_arrow(tokenize_table(table, encoder))

    def listed(r: TokenizedRows) -> list:
        ids = [[c.ids[c.offsets[i] : c.offsets[i + 1]].tolist() for i in range(len(r))] for c in r.columns]
        return [ids, [h.tolist() for h in r.hashes], r.lengths.tolist(), r.labels.tolist(), r.truncated.tolist()]

    assert listed(rows) == listed(arrow) and rows.truncated.tolist() == [0, 1, 0]
    joined = TokenizedRows.concat([rows.take([2]), rows.take([0, 1])])
    assert listed(joined) == listed(rows.take([2, 0, 1]))
    assert listed(joined.take([1, 2, 0])) == listed(rows)


def test_the_anchor_gets_the_query_prompt_and_the_other_columns_the_document_prompt(tokenizer) -> None:
    """As sentence-transformers' encode_query / encode_document put them; the hashes stay those of the texts."""
    prompts = {"query": "query: ", "passage": "passage: "}
    table = tokenized([["a cat"], ["a dog"]], tokenizer, prompts=prompts)
    expected = [tokenizer(["query: a cat"])["input_ids"][0], tokenizer(["passage: a dog"])["input_ids"][0]]
    assert [table.column(f"ids_{k}").to_pylist()[0] for k in (0, 1)] == expected
    assert (
        table.column("hash_0").to_pylist() == tokenized([["a cat"], ["a dog"]], tokenizer).column("hash_0").to_pylist()
    )


@pytest.mark.parametrize("rows", [230, 400, 1000])  # a short shard, the expected one, a long one
def test_every_pass_gives_exactly_its_batches_whatever_the_shard(tokenizer, rows) -> None:
    plan = BatchPlan(batch_size=8, world_size=2, rank=0, seed=1, window_batches=5)
    per_pass = plan.units_per_pass(800)  # 800 rows over 2 workers: 50 batches each
    counts = SourceCounts()
    batches = list(pass_batches(shard(tokenizer, rows, seed=0), per_pass, plan, (1, 0, 0), counts))
    assert len(batches) == per_pass == 50
    seen = [i for rows_, batch in batches for i in rows_.hashes[0][batch]]
    # A short shard repeats its first (whole) batches to fill the pass; a long one leaves its surplus unseen.
    assert counts.unseen == max(0, rows - 400) and counts.repeated == 8 * max(0, per_pass - -(-rows // 8))
    assert len(seen) == min(rows, 400) + counts.repeated


def test_the_ranks_batches_of_a_step_are_alike_in_length_and_deterministic(tokenizer) -> None:
    plans = [BatchPlan(batch_size=8, world_size=2, rank=r, seed=3, window_batches=10) for r in range(2)]
    runs = [
        [b for _, b in pass_batches(shard(tokenizer, 400, seed=r), 50, p, (3, 0, 0), SourceCounts())]
        for r, p in enumerate(plans)
    ]
    widths = [[int(rows.lengths[b].max()) for rows, b in pass_batches(shard(tokenizer, 400, seed=r), 50, p,
               (3, 0, 0), SourceCounts())] for r, p in enumerate(plans)]  # fmt: skip
    assert np.corrcoef(widths[0], widths[1])[0, 1] > 0.9  # step k: similar lengths on both ranks
    again = [b for _, b in pass_batches(shard(tokenizer, 400, seed=0), 50, plans[0], (3, 0, 0), SourceCounts())]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], again, strict=True))
    other = [b for _, b in pass_batches(shard(tokenizer, 400, seed=0), 50, plans[0], (4, 0, 0), SourceCounts())]
    assert not all(np.array_equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_no_text_appears_twice_in_a_batch_and_every_row_is_trained_once(tokenizer) -> None:
    """A brute-force check: many repeated anchors (NLI premises recur) and a positive equal to another's anchor."""
    rng = np.random.default_rng(0)
    anchors = [f"premise {int(i)}" for i in rng.integers(0, 30, 300)]
    positives = [f"hypothesis {i}" if i % 7 else f"premise {i % 30}" for i in range(300)]
    table = tokenized([anchors, positives], tokenizer)
    plan = BatchPlan(batch_size=8, world_size=1, rank=0, seed=0, window_batches=4, no_duplicates=True)
    counts = SourceCounts()
    batches = list(pass_batches([table], plan.units_per_pass(300), plan, (0, 0, 0), counts))
    for rows, batch in batches[: len(batches) - 0]:
        texts = [h for column in rows.hashes for h in column[batch]]
        assert len(texts) == len(set(texts))
    trained = sorted((rows.hashes[0][i], rows.hashes[1][i]) for rows, batch in batches for i in batch)
    assert counts.deferred_duplicates > 0
    expected = sorted(zip(table.column("hash_0").to_pylist(), table.column("hash_1").to_pylist(), strict=True))
    assert len(trained) - counts.repeated + counts.unseen == 300
    assert set(trained) <= set(expected)


def test_a_whole_window_of_a_prepared_share_gives_its_batches_without_duplicates(tokenizer) -> None:
    """Exactly ``window_batches`` duplicate-free batches from a window of as many batches' rows, nothing carried
    over (a resume finds the window from the position alone): anchors that recur wait for another batch of the
    window; rows that fit no whole batch of it (one anchor in every row) fill the missing batches as far as they go
    without a duplicate, the rest counted unseen."""
    plan = BatchPlan(batch_size=8, world_size=1, rank=0, seed=0, window_batches=4, no_duplicates=True)
    positives = [f"hypothesis {i}" for i in range(32)]
    for anchors, unseen in [([f"premise {i % 16}" for i in range(32)], 0), (["one premise"] * 32, 28)]:
        rows = TokenizedRows.from_arrow(tokenized([anchors, positives], tokenizer))
        counts = SourceCounts()
        batches = cut_whole_window(rows, plan, (0, 0, 0, 0), counts)
        assert len(batches) == 4 and counts.unseen == unseen and counts.deferred_duplicates > 0
        for batch in batches:
            texts = [h for column in rows.hashes for h in column[batch]]
            assert len(texts) == len(set(texts))
        placed = np.concatenate(batches).tolist()
        assert len(placed) == len(set(placed)) == 32 - unseen


def collate(batch):
    rows, index = batch
    return (
        [{"input_ids": torch.from_numpy(rows.hashes[0][index])}],
        None,
        [torch.from_numpy(h[index]) for h in rows.hashes],
        None,
    )


def sources(tokenizer, sizes=(160, 80), weights=(1.0, 2.0)) -> list[SourceStream]:
    tables = {n: shard(tokenizer, n, seed=n) for n in sizes}
    return [SourceStream(f"s{n}", n, w, lambda key, n=n: tables[n]) for n, w in zip(sizes, weights, strict=True)]


def test_several_sources_mix_batch_by_batch_and_a_resume_continues_with_the_same_batches(tokenizer) -> None:
    plan = BatchPlan(batch_size=8, world_size=1, rank=0, seed=0, window_batches=3)
    streams = sources(tokenizer)  # 20 and 10 batches a pass; weight 2 draws the second twice over: 40 an epoch
    whole = StageBatches(streams, plan, 40, epoch=0, position=0, collate=collate)
    taken = list(itertools.islice(whole, 100))
    origin = [{int(h) for h in b.text_hashes[0]} for b in taken]
    own = [{int(h) for t in s.open_pass((0, 0, 0)) for h in t.column("hash_0").to_pylist()} for s in streams]
    drawn = [next(j for j, hashes in enumerate(own) if o <= hashes) for o in origin]  # each batch: one source
    assert drawn[:40].count(0) == 20 and drawn[:40].count(1) == 20
    assert whole.metrics()["data/s160/samples"] == 8 * drawn.count(0)
    resumed = StageBatches(streams, plan, 40, epoch=1, position=13, collate=collate)
    for before, after in zip(taken[53:], resumed, strict=False):
        assert (before.epoch, before.position) == (after.epoch, after.position)
        assert torch.equal(before.text_hashes[0], after.text_hashes[0])
    robin = StageBatches(streams, BatchPlan(8, 1, 0, 0, 3, sampling="round_robin"), 20, 0, 0, collate)
    assert len(list(itertools.islice(robin, 20))) == 20


def test_a_stage_gives_either_dataset_or_datasets_with_name_or_path() -> None:
    with pytest.raises(ConfigError, match=r"stages.0.datasets.0: give either name or path, not both"):
        TrainConfig(stages=[StageConfig(datasets=[DatasetSource(name="stsb", path="x.csv")])]).validate()
    with pytest.raises(ConfigError, match=r"stages.0.datasets.1.weight must be > 0"):
        TrainConfig(
            stages=[StageConfig(datasets=[DatasetSource(name="stsb"), DatasetSource(name="x", weight=0)])]
        ).validate()


def test_a_hub_dataset_streams_from_its_files_or_a_local_mirror_of_them(tmp_path, monkeypatch) -> None:
    """sentence-transformers/all-nli's layout on the Hub (triplet/train-00000-of-00001.parquet: anchor, positive,
    negative), read through $SBERT_RAY_HUB_MIRROR as a cluster without internet would."""
    folder = tmp_path / "sentence-transformers" / "all-nli" / "triplet"
    folder.mkdir(parents=True)
    rows = {"anchor": ["a man sleeps", "a dog"], "positive": ["a person rests", "an animal"], "negative": ["x", "y"]}
    pq.write_table(pa.table(rows), folder / "train-00000-of-00001.parquet")
    monkeypatch.setenv("SBERT_RAY_HUB_MIRROR", str(tmp_path))
    stage = StageConfig(dataset="hf://datasets/sentence-transformers/all-nli/triplet/train-*.parquet", objective="mnrl")
    (source,) = stage_sources(stage, 0)
    assert source.files == (str(folder / "train-00000-of-00001.parquet"),)
    (table,) = read_tables(source, source.files[0], stage, None)
    assert table.column("text_2").to_pylist() == ["x", "y"] and table.num_rows == 2


def test_bad_parquet_shards_are_refused_from_their_footers_before_ray(tmp_path, tiny_train_config, capsys) -> None:
    """What parquet footers tell is checked before Ray, by `sbert-ray train` as the user runs it: a shard without a
    column the objective needs, a missing or blank text (row-group statistics point at the row group; only that
    column of it is read), an empty or corrupt file, each one line naming the key, the file and the row. Shards
    whose statistics show no such text are not read."""
    ones, twos = [f"a {i}" for i in range(40)], [f"b {i}" for i in range(40)]
    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"sentence1": ones, "sentence2": twos, "score": [2.5] * 40}), folder / "part-0.parquet")
    bad = folder / "part-1.parquet"
    blank, null = twos[:23] + ["  "] + twos[24:], ones[:31] + [None] + ones[32:]
    cases = [
        (lambda: write_scored({"sentence1": ones, "sentence2": blank}, bad), ", row 24: column 'sentence2' is empty"),
        (lambda: write_scored({"sentence1": null, "sentence2": twos}, bad), ", row 32: column 'sentence1' is empty"),
        (lambda: write_scored({"sentence1": ones, "text": twos}, bad), ": no column 'sentence2'"),
        (lambda: bad.write_bytes(b""), ": not a readable parquet file (Parquet file size is 0 bytes)"),
        (lambda: bad.write_bytes(b"PAR1" + b"x" * 64), ": not a readable parquet file (Parquet magic bytes not found"),
    ]
    config = tiny_train_config()
    for write, message in cases:
        write()
        assert main(["train", str(config), f"stages.0.dataset={folder}", "stages.0.limit=null"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"sbert-ray train: error: stages.0.dataset: {bad}{message}") and err.count("\n") == 1
    bad.unlink()
    stage = StageConfig(dataset=str(folder))
    (source,) = stage_sources(stage, 0)
    assert known_rows(source, stage, None) == 40
    # Footers are read at once and reported in file order: of two bad shards among eight, the first is named.
    for i in range(1, 8):
        shutil.copy(folder / "part-0.parquet", folder / f"part-{i}.parquet")
    (folder / "part-3.parquet").write_bytes(b"PAR1" + b"x" * 64)
    (folder / "part-7.parquet").write_bytes(b"")  # fails fastest
    (source,) = stage_sources(stage, 0)
    with pytest.raises(DataError, match=r"part-3\.parquet: not a readable parquet file"):
        known_rows(source, stage, None)


def write_scored(columns: dict[str, list], path) -> None:
    pq.write_table(pa.table({**columns, "score": [2.5] * 40}), path, row_group_size=10)


@pytest.mark.parametrize("name", ["random:tiny", "sentence-transformers/all-MiniLM-L6-v2"])
def test_the_tokenise_stage_loads_no_weights_and_tokenises_as_the_encoder(name) -> None:
    """Ray Data's tokenise tasks load the tokenizer alone (``load_tokenizer``), with the prompts the encoder has
    (the saved ones, or the config's in their place): the same token ids as with the whole encoder."""
    table = pa.table({"text_0": ["A man plays a guitar.", "x " * 40], "text_1": ["Someone plays music.", "y"]})
    for prompts in (None, {"query": "query: ", "document": "passage: "}):
        whole = load_encoder(name, max_seq_length=24, prompts=prompts)
        alone = load_tokenizer(name, max_seq_length=24, prompts=prompts)
        assert tokenize_table(table, alone).equals(tokenize_table(table, whole))


# --- elastic runs: the global batch and the data order at any world size ----------------------------------------


@pytest.mark.parametrize("objective", ["regression", "mnrl"])
@pytest.mark.parametrize(
    "batch_size, accumulation, most", [(8, 1, 2), (24, 2, 4), (840, 1, 8), (16, 1, 4), (14, 2, 4), (1024, 1, 64)]
)
def test_the_global_batch_is_the_configured_one_at_every_world_size(objective, batch_size, accumulation, most):
    """The rule of ``split_batch``: every optimizer step holds ``batch_size`` examples at any live world size, the
    ranks' shares of a global micro-batch differing by at most one (the first ranks the larger); with in-batch
    negatives each micro-batch gathered over the workers is the configured global micro-batch (the negatives an
    anchor meets), else no worker's micro-batch grows past the largest at the most workers (its memory)."""
    stage = StageConfig(objective=objective, batch_size=batch_size, grad_accum_steps=accumulation)
    TrainConfig(stages=[stage], scaling=ScalingConfig(num_workers=[1, most])).validate()
    unit = batch_size // accumulation
    largest = -(-unit // most)
    for workers in range(1, most + 1):
        split = split_batch(stage, most, workers, OBJECTIVES[objective].in_batch_negatives)
        assert sum(split.shares) * accumulation == batch_size and len(split.shares) == workers
        assert list(split.shares) == sorted(split.shares, reverse=True) and split.shares[0] - split.shares[-1] <= 1
        if objective == "mnrl":
            assert split.chunks == 1 and split.accumulation == accumulation
        else:
            micro_batches = [len(part) for share in split.shares for part in np.array_split(range(share), split.chunks)]
            assert max(micro_batches) <= largest and split.chunks * accumulation == split.accumulation
    assert split_batch(stage, most, most, False) == split_batch(stage, most, most, True)  # at the most: as set
    assert split_batch(StageConfig(batch_size=16), 4, 3, False).shares == (6, 5, 5)  # the rule the docs give


def dealt_stream(blocks: list[pa.Table], plan: BatchPlan, position: int) -> StageBatches:
    """A worker's stream of 800 rows in blocks of 50 dealt to the workers as Ray Data's streaming_split deals
    blocks (round robin, equal rows), from ``position`` of the first epoch (50 global micro-batches)."""
    rows = 800 // plan.world_size
    mine = pa.concat_tables(blocks[plan.rank :: plan.world_size]).slice(0, rows)
    source = SourceStream("s", 800, 1.0, lambda key: [mine.slice(i, 50) for i in range(0, rows, 50)])
    return StageBatches([source], plan, 50, epoch=0, position=position, collate=collate)


def trained(batches: Iterable[MicroBatch]) -> list[int]:
    return [int(h) for batch in batches for h in batch.text_hashes[0]]


def test_a_resize_keeps_the_step_count_and_continues_the_pass_from_the_saved_position(tokenizer) -> None:
    """800 rows in 16 blocks of 50, dealt to the workers as Ray Data's streaming_split deals blocks (round robin,
    equal rows). A 2-worker run takes 17 of the 50 steps of a pass, then 1 worker resumes from that position: the
    step count is the same, the resumed worker goes on in the same pass and the pass ends on time, and the rows
    the two runs trained differ from one pass of every row only inside the windows the resize cut (the batches
    of a window are shuffled, so where a worker stood inside its window is not a set of rows the other world's
    windows share): at most one window of each world's rows are trained twice or not at all."""
    blocks = shard(tokenizer, 800, seed=7)
    every_row = {int(h) for table in blocks for h in table.column("hash_0").to_pylist()}
    stage = StageConfig(objective="regression", batch_size=16, window_batches=5)
    plans = {w: [batch_plan(stage, 0, 0, w, rank, max_workers=2) for rank in range(w)] for w in (1, 2)}
    steps = {w: stage_steps([800], [1.0], stage, plans[w][0]) for w in (1, 2)}
    assert steps[1] == steps[2] == (50, 50)
    assert (plans[1][0].batch_size, plans[1][0].chunks, plans[2][0].batch_size) == (16, 2, 8)

    before = [trained(itertools.islice(dealt_stream(blocks, plan, 0), 17)) for plan in plans[2]]
    resumed = list(itertools.takewhile(lambda b: b.epoch == 0, dealt_stream(blocks, plans[1][0], position=17)))
    assert len(resumed) == (50 - 17) * 2 and resumed[-1].position == 50  # 2 micro-batches a step, to the pass end
    assert sum(len(b) for b in before) == 17 * 16 and all(b.size == 8 for b in resumed)
    seen = before[0] + before[1] + trained(resumed)
    window_rows = stage.window_batches * stage.batch_size  # rows of a window, all workers together, at any size
    twice, never = len(seen) - len(set(seen)), len(every_row - set(seen))
    assert twice == never <= 2 * window_rows  # each row trained twice took the place of one never trained
    assert twice > 0  # (the bound is not vacuous: the cut windows do differ)


def test_an_uneven_split_gives_every_step_the_global_batch_and_resumes_after_a_resize(tokenizer) -> None:
    """An elastic [3, 4] run at global batch 16 (the old rule refused it): 4 workers take 17 steps of 4 rows each,
    then 3 resume from that position with 6, 5 and 5 rows a step, each in two micro-batches (regression: none
    larger than the 4 rows of a micro-batch at the most workers, so 3+3, 3+2 and 3+2). Every step holds
    16 rows of the pass (but where a shard ends short), the resumed ranks end the pass together, and the rows the uneven
    shares repeat or leave unseen (equal shards, shares one row apart) stay within one row per rank and step."""
    blocks = shard(tokenizer, 800, seed=7)
    stage = StageConfig(objective="regression", batch_size=16, window_batches=5)
    plans = {w: [batch_plan(stage, 0, 0, w, rank, max_workers=4) for rank in range(w)] for w in (3, 4)}
    assert stage_steps([800], [1.0], stage, plans[3][0]) == stage_steps([800], [1.0], stage, plans[4][0]) == (50, 50)
    assert [p.batch_size for p in plans[3]] == [6, 5, 5] and {p.chunks for p in plans[3]} == {2}
    before = [list(itertools.islice(dealt_stream(blocks, plan, 0), 17)) for plan in plans[4]]
    streams = [dealt_stream(blocks, plan, 17) for plan in plans[3]]
    resumed = [list(itertools.takewhile(lambda b: b.epoch == 0, stream)) for stream in streams]
    assert [[b.size for b in rank[:2]] for rank in resumed] == [[3, 3], [3, 2], [3, 2]]
    steps = [sum(b.size for rank in resumed for b in rank if b.position == p) for p in range(18, 51)]
    # Rank 0's 266 rows end in a short batch (2 of its 6, then it repeats its pass's first batches): one step short.
    assert sorted(steps) == [12] + [16] * 32 and all(rank[-1].position == 50 for rank in resumed)
    assert all(sum(b.size for rank in before for b in rank if b.position == p) == 16 for p in range(1, 18))
    counts = [stream.counts[0] for stream in streams]
    assert counts[0].repeated > 0 and counts[0].repeated <= 50 and all(c.unseen <= 50 for c in counts[1:])


def test_a_teachers_scores_are_read_beside_the_negatives_and_a_missing_one_is_refused_before_ray(
    tmp_path, tiny_train_config, capsys, tokenizer
) -> None:
    """margin_mse / distill_kl read ``score_positive`` and ``score_<negative column>`` as each row's label, in the
    order of the texts; a source without one, a missing score, or a csv are refused naming the column, row or file,
    as one line of ``sbert-ray train`` before Ray."""
    from sbert_ray.cli import main

    rows = {"anchor": ["q1", "q2"], "positive": ["p1", "p2"], "negative_1": ["n1", "n2"], "negative_2": ["m1", "m2"]}
    scores = {"score_negative_2": [-3, -4], "score_positive": [9.5, 8.0], "score_negative_1": [1.0, 2.5]}
    path = tmp_path / "mined.parquet"
    pq.write_table(pa.table(rows | scores), path)
    stage = StageConfig(dataset=str(path), objective="margin_mse")
    (source,) = stage_sources(stage, 0)
    (table,) = read_tables(source, source.files[0], stage, None)
    assert table.column("label").to_pylist() == [[9.5, 1.0, -3.0], [8.0, 2.5, -4.0]]
    assert table.column("text_3").to_pylist() == ["m1", "m2"]
    tokens = tokenize_table(table, TextTokenizer(tokenizer, 8, {}))
    assert TokenizedRows.from_arrow(tokens).labels.tolist() == [[9.5, 1.0, -3.0], [8.0, 2.5, -4.0]]

    pq.write_table(pa.table(rows | scores | {"score_negative_1": [1.0, None]}), path)
    with pytest.raises(DataError, match=rf"^{path}, row 2: column 'score_negative_1' is not a finite number$"):
        list(read_tables(source, source.files[0], stage, None))

    triplets = {"anchor": ["q1"], "positive": ["p1"], "negative": ["n1"], "score_positive": [9.0]}
    pq.write_table(pa.table(triplets), path)
    csv = tmp_path / "mined.csv"
    csv.write_text("anchor,positive,negative,score_positive,score_negative\nq1,p1,n1,9,1\n")
    for dataset, message in [
        (path, "no column 'score_negative'"),
        (csv, "trains on a teacher's scores, read from parquet"),
    ]:
        overrides = [f"stages.0.dataset={dataset}", "stages.0.objective=margin_mse", "stages.0.limit=null"]
        code = main(["train", str(tiny_train_config()), *overrides])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("sbert-ray train: error: ") and err.count("\n") == 1, err
        assert f"{dataset}: " in err and message in err, err


def test_a_teachers_embeddings_are_read_beside_the_texts_and_refused_before_ray_where_they_do_not_fit(
    tmp_path, tiny_train_config, capsys, tokenizer
) -> None:
    """mse reads ``text`` (and ``translation`` where there is one) with the teacher's ``vector`` of the text as each
    row's label; a vector missing, of another length or not finite is refused naming its row, and a source without
    the column, a csv, a teacher of another size than the model or matryoshka_dims as one line of ``sbert-ray
    train`` before Ray, naming the column, file, both sizes or the key."""
    rows = {"text": ["a dog", "a cat"], "translation": ["ein Hund", "eine Katze"]}
    path = tmp_path / "teacher.parquet"
    pq.write_table(pa.table(rows | {"vector": [[0.5, 1.0, -2.0], [3.0, 0.0, 1.5]]}), path)
    stage = StageConfig(dataset=str(path), objective="mse")
    (source,) = stage_sources(stage, 0)
    (table,) = read_tables(source, source.files[0], stage, None)
    assert table.column("text_1").to_pylist() == ["ein Hund", "eine Katze"]
    tokens = tokenize_table(table, TextTokenizer(tokenizer, 8, {}))
    assert TokenizedRows.from_arrow(tokens).labels.tolist() == [[0.5, 1.0, -2.0], [3.0, 0.0, 1.5]]
    fixed_size = pa.array([[1.0, 2.0]], pa.list_(pa.float32(), 2))  # as encode writes it
    pq.write_table(pa.table({"sentence": ["a dog"], "teacher": fixed_size}), path)
    renamed = StageConfig(dataset=str(path), objective="mse", columns={"text": "sentence", "vector": "teacher"})
    (renamed_source,) = stage_sources(renamed, 0)
    (table,) = read_tables(renamed_source, str(path), renamed, None)
    assert table.column_names == ["text_0", "label"] and table.column("label").to_pylist() == [[1.0, 2.0]]

    for vectors, message in [
        ([[1.0, 2.0, 3.0], None], "row 2: column 'vector' holds no embedding, the file's row 1 3 values"),
        ([[1.0, 2.0, 3.0], [1.0, 2.0]], "row 2: column 'vector' holds 2 values, the file's row 1 3 values"),
        ([[1.0, 2.0, 3.0], [1.0, float("nan"), 2.0]], "row 2: column 'vector' holds a value that is not a finite"),
    ]:
        pq.write_table(pa.table(rows | {"vector": vectors}), path)
        with pytest.raises(DataError, match=rf"^{path}, {message}"):
            list(read_tables(source, source.files[0], stage, None))

    model_size = 32  # random:tiny's hidden size
    right_size = [[0.0] * model_size] * 2
    csv = tmp_path / "teacher.csv"
    csv.write_text("text,vector\na dog,0.5\n")
    cases = [
        ({"text": ["a dog", "a cat"], "embedding": right_size}, path, [], "no column 'vector'"),
        (None, csv, [], "trains on a teacher's embeddings, read from parquet"),
        (rows | {"vector": [[0.5, 1.0, -2.0]] * 2}, path, [], "the teacher's embeddings have 3 dimensions and the "
         f"model's {model_size}; objective 'mse' needs one size"),
        (rows | {"vector": right_size}, path, ["stages.0.matryoshka_dims=[32,16]"], "stages.0.matryoshka_dims: "
         "objective 'mse' regresses the whole embedding onto a teacher's"),
    ]  # fmt: skip
    for columns, dataset, more, message in cases:
        if columns:
            pq.write_table(pa.table(columns), dataset)
        overrides = [f"stages.0.dataset={dataset}", "stages.0.objective=mse", "stages.0.limit=null", *more]
        code = main(["train", str(tiny_train_config()), *overrides])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("sbert-ray train: error: ") and err.count("\n") == 1, err
        assert message in err and (more or f"stages.0.dataset: {dataset}: " in err), err


def test_a_read_task_carries_its_own_file_whatever_the_source_holds() -> None:
    """Each read task's arguments are the same size for a source of 10 or 2,000 files (2,000 tasks carrying the
    whole list would pickle 4 million paths): the task's file. (A prepared source has no read tasks: each worker
    reads its shards, ``training.prepared_reads``.)"""
    import ray.cloudpickle

    from sbert_ray.training.stage_data import _SourceFiles

    largest = {}
    for count in (10, 2000):
        files = tuple(f"/data/x/part-{i:05d}.parquet" for i in range(count))
        source = Source("stages.0.dataset", "/data/x", "train", files)
        tasks = _SourceFiles(source, StageConfig(), None).get_read_tasks(1)
        assert len(tasks) == count
        largest[count] = max(len(ray.cloudpickle.dumps(task)) for task in tasks)
    assert largest[2000] == largest[10]
