"""Prepared training sources (``sbert-ray prepare``, ``data.prepared``): training reads their shards as they are, to
the same examples as the raw source gives, each rank its own share of each pass (a function of the pass key, the
world sizes and the rank), a resume only from the window it stands in; a manifest made for another tokenizer,
length or prompts is refused before Ray, naming each difference. The one prepare run on the local cluster checks
that its shards hold what training would compute, that two workers' shares read in Ray tasks are those read in
process, and that a rerun writes only what is missing."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import pickle
import threading
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, EvalConfig, ModelConfig, StageConfig, TrainConfig
from sbert_ray.data.prepared import (
    MANIFEST,
    PREPARE_MARKER,
    Manifest,
    Shard,
    prepared_settings,
    read_manifest,
    tokenizer_fingerprint,
)
from sbert_ray.models import load_encoder
from sbert_ray.models.cross_encoder import CrossEncoderModel
from sbert_ray.models.load import load_tokenizer
from sbert_ray.runs.prepare_source import PrepareRequest, prepare_source, shard_inputs
from sbert_ray.training.batches import tokenize_table
from sbert_ray.training.prepared_reads import PreparedPasses
from sbert_ray.training.sources import Source, column_roles, pass_reads, read_tables, reading, stage_sources
from sbert_ray.training.stage_data import count_stages, source_stream, stage_datasets
from sbert_ray.training.stream import (
    SourceCounts,
    StageBatches,
    batch_plan,
    local_sources,
    share_batches,
    stage_steps,
)

ROWS_PER_FILE = (150, 130)  # two input files: two shards
ROWS_PER_GROUP = 64
MAX_SEQ_LENGTH = 16  # short enough that some STSb sentences are truncated


@pytest.fixture(scope="module")
def raw_folder(tmp_path_factory, data_dir):
    """Two csv shards of STSb training pairs (sentence1, sentence2, score)."""
    folder = tmp_path_factory.mktemp("raw")
    lines = (data_dir / "stsb" / "sts-train.csv").read_text().splitlines()
    rows = iter(line.split("\t")[4:7] for line in lines)
    for index, count in enumerate(ROWS_PER_FILE):
        with open(folder / f"part-{index}.csv", "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["score", "sentence1", "sentence2"])
            writer.writerows(itertools.islice(rows, count))
    return folder


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    return load_encoder(str(tiny_model_dir), max_seq_length=MAX_SEQ_LENGTH)


def write_prepared(raw, output, stage: StageConfig, encoder, model: str, rows_per_group=ROWS_PER_GROUP) -> None:
    """A prepared folder written in this process: each input file's tables tokenised as the training stream does,
    in row groups of ``rows_per_group``, and its manifest (the cluster test shows prepare writes the same shards)."""
    (source,) = stage_sources(dataclasses.replace(stage, dataset=str(raw)), 0)
    output.mkdir()
    shards = []
    for item in shard_inputs(source.files):
        table = pa.concat_tables(tokenize_table(t, encoder) for t in read_tables(source, item.uri, stage, None))
        pq.write_table(table, output / f"{item.key}.parquet", row_group_size=rows_per_group)
        groups = [min(rows_per_group, table.num_rows - start) for start in range(0, table.num_rows, rows_per_group)]
        shards.append(Shard(f"{item.key}.parquet", table.num_rows, tuple(groups)))
    settings = prepared_settings(
        encoder.tokenizer, encoder.max_seq_length, encoder.prompts, reading(stage), encoder.joins_pairs
    )
    roles = column_roles(stage, 2)
    manifest = Manifest(str(output), settings, str(raw), model, {}, roles, rows_per_group, tuple(shards))
    (output / MANIFEST).write_text(json.dumps(manifest.to_json()))


def train_config(dataset, model: str, shuffle_files: bool = True, batch_size=8, **model_settings) -> TrainConfig:
    stage = StageConfig(
        dataset=str(dataset), batch_size=batch_size, window_batches=4, epochs=2, shuffle_files=shuffle_files
    )
    return TrainConfig(
        name="prepared",
        model=ModelConfig(name=model, max_seq_length=MAX_SEQ_LENGTH, **model_settings),
        stages=[stage],
        evaluation=EvalConfig(final_tasks=[]),
    )


def micro_batches(config: TrainConfig, encoder, count: int, epoch: int = 0, position: int = 0) -> list:
    """The first ``count`` micro-batches of the stage's one worker (``config.seed``) from (``epoch``, ``position``)
    on, across the epoch boundary."""
    return list(itertools.islice(rank_stream(config, encoder, 1, 0, epoch, position), count))


def rank_stream(config: TrainConfig, encoder, world_size: int, rank: int, epoch=0, position=0, max_workers=None):
    """Rank ``rank``'s micro-batches of ``world_size`` live workers (of ``max_workers`` planned) from (``epoch``,
    ``position``) on, as a Train worker takes them (``StageBatches``)."""
    stage = config.stages[0]
    sources = local_sources(config, 0, encoder)
    plan = batch_plan(stage, 0, seed=config.seed, world_size=world_size, rank=rank, max_workers=max_workers)
    per_epoch, _ = stage_steps([s.rows for s in sources], [s.weight for s in sources], stage, plan)

    def collate(batch):
        rows, index = batch
        return rows.collate(index, pad_token_id=0, pad_left=False, device=torch.device("cpu"))

    return StageBatches(sources, plan, per_epoch, epoch, position, collate)


def rank_rows(stream: StageBatches, count: int) -> list[tuple[int, int]]:
    """The (text hashes of the) examples of ``stream``'s next ``count`` micro-batches, in order."""
    return [tuple(map(int, row)) for m in itertools.islice(stream, count) for row in zip(*m.text_hashes, strict=True)]


def trained_rows(batches: list, epoch: int) -> list[tuple]:
    """Every example the micro-batches of ``epoch`` train on, as (text hashes, token ids per text, label), sorted."""
    rows = []
    for batch in (b for b in batches if b.epoch == epoch):
        ids = [
            [tuple(row[mask.bool()].tolist()) for row, mask in zip(f["input_ids"], f["attention_mask"], strict=True)]
            for f in batch.features
        ]
        hashes = [h.tolist() for h in batch.text_hashes]
        rows += zip(*hashes, *ids, batch.labels.tolist(), strict=True)
    return sorted(rows)


def test_a_prepared_source_trains_on_the_examples_of_its_raw_source(raw_folder, encoder, tiny_model_dir, tmp_path):
    """Token ids, text hashes and labels of every example of two epochs are equal, read from the raw csv shards
    (tokenised in the loop) or from their prepared shards (read as they are); the batches differ (a prepared
    source's windows are cut at whole windows of rows, a raw one's where its tables end), the steps do not."""
    stage = StageConfig(dataset=str(raw_folder))
    prepared = tmp_path / "prepared"
    write_prepared(raw_folder, prepared, stage, encoder, str(tiny_model_dir))
    (source,) = stage_sources(StageConfig(dataset=str(prepared)), 0)
    assert source.manifest is not None and source.manifest.rows == sum(ROWS_PER_FILE)

    count = 2 * -(-sum(ROWS_PER_FILE) // 8)  # two epochs of batches of 8
    raw = micro_batches(train_config(raw_folder, str(tiny_model_dir), shuffle_files=False), encoder, count)
    read = micro_batches(train_config(prepared, str(tiny_model_dir), shuffle_files=False), encoder, count)
    assert len(raw) == len(read) == count and {b.epoch for b in raw} == {0, 1}
    assert [(a.epoch, a.position, a.size) for a in raw] == [(b.epoch, b.position, b.size) for b in read]
    for epoch in (0, 1):
        assert len(trained_rows(read, epoch)) == sum(ROWS_PER_FILE)
        assert trained_rows(raw, epoch) == trained_rows(read, epoch)


def test_each_pass_reads_the_files_and_row_groups_in_an_order_seeded_by_seed_source_and_pass() -> None:
    """``pass_reads``: every pass reads each shard once and each of its row groups once, in an order that differs
    from pass to pass, seed to seed and source to source, and is the same for the same key; ``shuffle_files: false``
    keeps the listed order. Eight shards of four row groups: 8! x 24^8 orders, so no two keys meet by chance."""
    shards = tuple(Shard(f"part-{i}.parquet", 4 * ROWS_PER_GROUP, (ROWS_PER_GROUP,) * 4) for i in range(8))
    manifest = Manifest("/prepared", {}, "raw", "model", {}, {}, ROWS_PER_GROUP, shards)
    source = Source("stages.0.dataset", "/prepared", "train", manifest.files, manifest=manifest)
    stage = StageConfig(dataset="/prepared")
    orders = {key: pass_reads(source, stage, key) for key in [(42, 0, p) for p in range(4)] + [(7, 0, 0), (42, 1, 0)]}
    for reads in orders.values():
        assert sorted(file for file, _ in reads) == sorted(manifest.files)
        assert all(sorted(groups) == [0, 1, 2, 3] for _, groups in reads)
    assert len({tuple(reads) for reads in orders.values()}) == len(orders)  # per pass, seed and source
    assert len({tuple(file for file, _ in reads) for reads in orders.values()}) == len(orders)  # the files' too
    assert pass_reads(source, stage, (42, 0, 1)) == orders[(42, 0, 1)]  # the same key, the same order
    listed = pass_reads(source, dataclasses.replace(stage, shuffle_files=False), (42, 0, 1))
    assert listed == [(file, None) for file in manifest.files]


def test_a_pass_reads_every_row_once_in_its_own_order_and_a_resume_continues_it_exactly(
    raw_folder, encoder, tiny_model_dir, tmp_path
):
    """A prepared source (two shards of three row groups) through the stream of one worker: each pass's sequence of
    rows is the row groups in ``pass_reads``' order, every row once, any stretch of it read as it is there; two
    epochs give each row once each, in other batches; a run resumed inside the second epoch takes exactly the
    micro-batches the uninterrupted run takes from there."""
    stage = StageConfig(dataset=str(raw_folder))
    prepared = tmp_path / "prepared"
    write_prepared(raw_folder, prepared, stage, encoder, str(tiny_model_dir))
    config = train_config(prepared, str(tiny_model_dir))
    ((source,), (stream,)) = stage_sources(config.stages[0], 0), local_sources(config, 0, encoder)
    reads = []
    for key in [(config.seed, 0, 0), (config.seed, 0, 1)]:
        groups = [
            pq.ParquetFile(file).read_row_group(group).column("hash_0").to_pylist()
            for file, order in pass_reads(source, config.stages[0], key)
            for group in order
        ]
        row_groups = stream.prepared.row_groups(key)
        table, read = stream.prepared.read(row_groups, 0, stream.rows)
        reads.append(table.column("hash_0").to_pylist())
        assert reads[-1] == list(itertools.chain(*groups))  # in the pass's order of files and row groups
        assert read == stream.rows and [g.rows for g in row_groups] == [len(g) for g in groups]
        stretch, read = stream.prepared.read(row_groups, 70, 130)  # only the row groups it lies in are read
        assert stretch.column("hash_0").to_pylist() == reads[-1][70:130]
        assert read == sum(g.rows for g in row_groups if g.first < 130 and g.first + g.rows > 70) < stream.rows
    assert reads[0] != reads[1] and sorted(reads[0]) == sorted(reads[1])  # two passes, two orders of the same rows
    rows = pa.concat_tables(pq.read_table(prepared / shard.file) for shard in source.manifest.shards)
    every_row = sorted(zip(rows.column("hash_0").to_pylist(), rows.column("hash_1").to_pylist(), strict=True))
    assert len(every_row) == sum(ROWS_PER_FILE)

    per_epoch = -(-sum(ROWS_PER_FILE) // 8)  # one worker, batches of 8: every row once, the last batch short
    whole = micro_batches(config, encoder, 2 * per_epoch)
    epochs = [[b for b in whole if b.epoch == e] for e in (0, 1)]
    trained = [
        sorted((int(a), int(b)) for m in batches for a, b in zip(*m.text_hashes, strict=True)) for batches in epochs
    ]
    assert trained[0] == trained[1] == every_row  # each row once per pass
    first = [[int(h) for h in m.text_hashes[0]] for m in epochs[0]]
    second = [[int(h) for h in m.text_hashes[0]] for m in epochs[1]]
    assert first != second and sorted(map(sorted, first)) != sorted(
        map(sorted, second)
    )  # other batches, not only moved

    resumed = micro_batches(config, encoder, per_epoch - 13, epoch=1, position=13)
    for a, b in zip(whole[per_epoch + 13 :], resumed, strict=True):
        assert (a.epoch, a.position) == (b.epoch, b.position)
        assert torch.equal(a.features[0]["input_ids"], b.features[0]["input_ids"])
        assert all(torch.equal(x, y) for x, y in zip(a.text_hashes, b.text_hashes, strict=True))


@pytest.fixture
def prepared_folder(raw_folder, encoder, tiny_model_dir, tmp_path):
    """The raw folder prepared in row groups of 8 rows (more row groups than windows)."""
    prepared = tmp_path / "prepared"
    write_prepared(raw_folder, prepared, StageConfig(dataset=str(raw_folder)), encoder, str(tiny_model_dir), 8)
    return prepared


def every_row(prepared) -> list[tuple[int, int]]:
    shards = pa.concat_tables(pq.read_table(path) for path in sorted(prepared.glob("*.parquet")))
    return sorted(zip(shards.column("hash_0").to_pylist(), shards.column("hash_1").to_pylist(), strict=True))


def test_each_rank_trains_on_rows_of_its_pass_key_world_sizes_and_rank_alone(prepared_folder, encoder, tiny_model_dir):
    """Two workers: each rank's examples of a pass are the same whichever rank reads first and from a source rebuilt
    from the wire (as another process on another node gets it); the ranks' examples are disjoint and together every
    row of the pass once; the next pass gives each rank other rows."""
    config = train_config(prepared_folder, str(tiny_model_dir))
    per_pass = -(-sum(ROWS_PER_FILE) // 8)  # 35 global micro-batches of 8: 4 examples per rank
    ranks = [rank_rows(rank_stream(config, encoder, 2, rank), 2 * per_pass) for rank in (0, 1)]
    again = [rank_rows(rank_stream(config, encoder, 2, rank), 2 * per_pass) for rank in (1, 0)][::-1]
    assert ranks == again
    (stream,) = local_sources(config, 0, encoder)
    wired = PreparedPasses.from_wire(json.loads(json.dumps(stream.prepared.to_wire())), config.stages[0])
    assert wired == stream.prepared
    for first, second in [(rows[: len(rows) // 2], rows[len(rows) // 2 :]) for rows in ranks]:
        assert len(first) == len(second) == sum(ROWS_PER_FILE) // 2
    passes = [[rows[: len(rows) // 2] for rows in ranks], [rows[len(rows) // 2 :] for rows in ranks]]
    for shares in passes:  # (the same multiset: one pair of the rows is there twice)
        assert sorted(shares[0] + shares[1]) == every_row(prepared_folder)
    assert set(passes[0][0]) != set(passes[1][0])  # another pass, another share


def test_a_resized_run_trains_every_row_of_a_pass_once_but_the_remainder(prepared_folder, encoder, tiny_model_dir):
    """Planned for 3 workers, live 2 (a global micro-batch of 9: shares 5 and 4): each rank's share of a pass is
    its share's part of every window, so the two take every row once but the one the 3 planned equal shares leave
    (280 // 3 * 3 = 279; counted unseen), and both take the planned 31 micro-batches."""
    config = train_config(prepared_folder, str(tiny_model_dir), batch_size=9)
    streams = [rank_stream(config, encoder, 2, rank, max_workers=3) for rank in (0, 1)]
    trained = [rank_rows(stream, 31 * stream.plan.chunks) for stream in streams]  # 31 global micro-batches
    assert [len(rows) for rows in trained] == [7 * 4 * 5 + 15, 7 * 4 * 4 + 12]  # 7 whole windows, then 27 rows
    counts = [stream.metrics() for stream in streams]
    assert [c["data/prepared/unseen"] for c in counts] == [0, 1]
    assert [c["data/prepared/repeated"] for c in counts] == [0, 0]
    assert not Counter(trained[0] + trained[1]) - Counter(every_row(prepared_folder))  # each row at most once


def test_a_run_resized_inside_a_pass_trains_every_row_outside_the_window_it_stood_in_once(
    prepared_folder, encoder, tiny_model_dir
):
    """Planned for 3 workers (a global micro-batch of 9, windows of 4 of them: 36 rows), 13 global micro-batches
    taken by 3 workers, the rest of the pass by 2 from that position: the window the position lies in (the 4th) is
    cut anew at the new size (its rows may be trained twice or not), every other row of the pass exactly once."""
    config = train_config(prepared_folder, str(tiny_model_dir), batch_size=9)
    before = [rank_rows(rank_stream(config, encoder, 3, rank, max_workers=3), 13) for rank in range(3)]
    after = []
    for rank in (0, 1):
        stream = rank_stream(config, encoder, 2, rank, position=13, max_workers=3)
        after += rank_rows(stream, (31 - 13) * stream.plan.chunks)
    (source,) = local_sources(config, 0, encoder)
    table, _ = source.prepared.read(source.prepared.row_groups((config.seed, 0, 0)), 0, 279)
    sequence = list(zip(table.column("hash_0").to_pylist(), table.column("hash_1").to_pylist(), strict=True))
    window, outside = Counter(sequence[3 * 36 : 4 * 36]), Counter(sequence[: 3 * 36] + sequence[4 * 36 :])
    trained = Counter(itertools.chain(*before, after))
    only_outside = {row: n for row, n in outside.items() if row not in window}  # (one pair is there twice)
    assert {row: trained[row] for row in only_outside} == only_outside and len(only_outside) > 240  # each once
    assert all(trained[row] <= 2 * n for row, n in window.items()) and not set(trained) - set(sequence)


@pytest.mark.parametrize("position", [31, 33])  # 90 % into a pass of 35 (a whole window), and into its last window
def test_a_resume_reads_one_window_and_takes_the_batches_of_the_uninterrupted_run(
    prepared_folder, encoder, tiny_model_dir, position
):
    """Two workers, windows of 4 global micro-batches (16 examples per rank), row groups of 8: a run resumed at
    ``position`` of the first pass reads at most its window and the two row groups it starts and ends in before
    its first micro-batch, per rank (counted at the reader), and takes exactly the micro-batches the uninterrupted
    run takes from there on, into the next pass."""
    config = train_config(prepared_folder, str(tiny_model_dir))
    for rank in (0, 1):
        whole = list(itertools.islice(rank_stream(config, encoder, 2, rank), 35 + 10))
        resumed_stream = rank_stream(config, encoder, 2, rank, epoch=0, position=position)
        resumed = iter(resumed_stream)
        first = next(resumed)
        assert resumed_stream.metrics()["data/prepared/read"] <= 4 * 4 + 2 * 8
        for a, b in zip(whole[position:], [first, *itertools.islice(resumed, 35 + 10 - position - 1)], strict=True):
            assert (a.epoch, a.position, a.size) == (b.epoch, b.position, b.size)
            assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a.features, b.features, strict=True))
            assert all(torch.equal(x, y) for x, y in zip(a.text_hashes, b.text_hashes, strict=True))


def test_the_next_window_is_read_in_a_thread_while_this_one_trains(
    prepared_folder, encoder, tiny_model_dir, monkeypatch
):
    """One worker, windows of 4 micro-batches: once the first window's first micro-batch is taken, the second
    window's rows are being read on another thread (object storage's latency costs a step nothing after the first
    window), and no window further ahead."""
    reads, second_read = [], threading.Event()  # (first row of the read, its thread)
    read = PreparedPasses.read

    def recorded(self, groups, start, stop):
        reads.append((start, threading.current_thread().name))
        if len(reads) == 2:
            second_read.set()
        return read(self, groups, start, stop)

    monkeypatch.setattr(PreparedPasses, "read", recorded)
    stream = iter(rank_stream(train_config(prepared_folder, str(tiny_model_dir)), encoder, 1, 0))
    next(stream)
    assert second_read.wait(30), reads
    assert [start for start, _ in reads] == [0, 4 * 8]
    assert all(thread.startswith("read-ahead") for _, thread in reads), reads


def test_a_manifest_made_for_other_settings_is_refused_naming_each_difference(
    raw_folder, encoder, tiny_model_dir, tmp_path
):
    prepared = tmp_path / "prepared"
    write_prepared(raw_folder, prepared, StageConfig(dataset=str(raw_folder)), encoder, str(tiny_model_dir))
    config = train_config(prepared, str(tiny_model_dir), prompts={"query": "query: "})
    longer = load_encoder(str(tiny_model_dir), max_seq_length=32, prompts={"query": "query: "})
    with pytest.raises(ConfigError) as refused:
        local_sources(config, 0, longer)
    message = str(refused.value)
    assert message.startswith(f"stages.0.dataset: {prepared} was prepared for another run: ")
    assert "max_seq_length: prepared with 16, this run's 32" in message
    assert "prompts: prepared with {}, this run's {'query': 'query: '}" in message
    assert "tokenizer" not in message and "reading" not in message  # what matches is not named

    other_objective = dataclasses.replace(config.stages[0], objective="mnrl")
    with pytest.raises(ConfigError, match=r"reading: prepared with \{'records': 'scored'"):
        local_sources(dataclasses.replace(config, stages=[other_objective]), 0, encoder)

    # A reranker reads each pair as one text pair: the texts of a bi-encoder's source were tokenised alone.
    reranker = CrossEncoderModel.load(tiny_model_dir, max_seq_length=MAX_SEQ_LENGTH)
    as_reranker = dataclasses.replace(
        config,
        model=ModelConfig(name=str(tiny_model_dir), type="cross_encoder", max_seq_length=MAX_SEQ_LENGTH),
        stages=[dataclasses.replace(config.stages[0], objective="reranker_bce", score_max=5.0)],
    )
    with pytest.raises(ConfigError) as refused:
        local_sources(as_reranker, 0, reranker)
    assert "joins_pairs: prepared with False, this run's True" in str(refused.value)


def test_prepare_tokenises_pairs_for_a_reranker_objective(raw_folder, tiny_model_dir, tmp_path):
    request = PrepareRequest(str(raw_folder), str(tiny_model_dir), 16, tmp_path / "out", objective="reranker_bce")
    assert request.model_type == "cross_encoder"
    with pytest.raises(ConfigError, match="--prompt: --objective reranker_bce trains a reranker, which takes no"):
        dataclasses.replace(request, prompts={"query": "query: "})


def test_sbert_ray_train_refuses_a_mismatched_manifest_before_ray(
    raw_folder, encoder, tiny_model_dir, tiny_train_config, tmp_path, capsys
):
    """The run's tokenizer (random:tiny's) and max_seq_length (128) are not those the source was prepared with: one
    line naming both, exit 2, no Ray started (the suite's sentinel checks that)."""
    prepared = tmp_path / "prepared"
    write_prepared(raw_folder, prepared, StageConfig(dataset=str(raw_folder)), encoder, str(tiny_model_dir))
    manifest = json.loads((prepared / MANIFEST).read_text())
    manifest["tokenizer"] = "sha256:0000000000000000"  # as another tokenizer's fingerprint
    (prepared / MANIFEST).write_text(json.dumps(manifest))
    code = main(["train", str(tiny_train_config()), f"stages.0.dataset={prepared}", "stages.0.limit=null"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"sbert-ray train: error: stages.0.dataset: {prepared} was prepared for another run: "), err
    assert "tokenizer: prepared with 'sha256:0000000000000000', this run's 'sha256:" in err, err
    assert "max_seq_length: prepared with 16, this run's 128" in err, err


def test_the_tokenizer_fingerprint_is_the_tokenizers_not_its_last_calls(tiny_model_dir) -> None:
    """A fast tokenizer's truncation and padding change with every call (training truncates to max_seq_length):
    they are left out, so a prepared source is not refused for how the tokenizer was last called; a tokenizer that
    tokenises differently (one more token in its vocabulary) has another fingerprint."""
    tokenizer = load_tokenizer(str(tiny_model_dir), MAX_SEQ_LENGTH).tokenizer
    first = tokenizer_fingerprint(tokenizer)
    tokenizer(["a dog runs", "a cat"], truncation=True, max_length=3, padding="max_length")
    assert tokenizer_fingerprint(tokenizer) == first
    tokenizer.add_tokens(["zzqxword"])
    assert tokenizer_fingerprint(tokenizer) != first


def test_prepare_refuses_bad_input_before_ray(raw_folder, tiny_model_dir, tmp_path) -> None:
    """A missing file, a missing column and an output folder that is not prepare's: each one error naming it."""
    model = str(tiny_model_dir)
    with pytest.raises(ConfigError, match="missing.csv does not exist"):
        prepare_source(PrepareRequest(str(tmp_path / "missing.csv"), model, 16, tmp_path / "out"))
    no_score = tmp_path / "no-score.csv"
    no_score.write_text("sentence1,sentence2\na dog,a cat\n")
    with pytest.raises(ConfigError, match=rf"{no_score}.*score"):
        prepare_source(PrepareRequest(str(no_score), model, 16, tmp_path / "out"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not an sbert-ray prepare output"):
        prepare_source(PrepareRequest(str(raw_folder), model, 16, theirs))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / PREPARE_MARKER).write_text("{}")
    with pytest.raises(ConfigError, match=rf"^stages.0.dataset: {unfinished}: an unfinished sbert-ray prepare output"):
        stage_sources(StageConfig(dataset=str(unfinished)), 0)


@pytest.mark.cluster
@pytest.mark.slow
def test_prepare_writes_what_training_computes_and_a_rerun_only_what_is_missing(
    local_ray, raw_folder, encoder, tiny_model_dir, tmp_path
) -> None:
    model = str(tiny_model_dir)
    request = PrepareRequest(str(raw_folder), model, MAX_SEQ_LENGTH, tmp_path / "out", rows_per_group=ROWS_PER_GROUP)
    first = prepare_source(request)
    assert (first.rows, first.files_written, first.files_skipped) == (sum(ROWS_PER_FILE), 2, 0)
    manifest = read_manifest(str(tmp_path / "out"))
    assert [(s.file, s.rows) for s in manifest.shards] == [("part-0.parquet", 150), ("part-1.parquet", 130)]
    assert [s.row_groups for s in manifest.shards] == [(64, 64, 22), (64, 64, 2)]
    assert manifest.column_roles == {"ids_0": "sentence1", "ids_1": "sentence2"}
    expected = tmp_path / "expected"
    write_prepared(raw_folder, expected, StageConfig(dataset=str(raw_folder)), encoder, model)
    for shard in manifest.shards:
        assert pq.read_table(tmp_path / "out" / shard.file).equals(pq.read_table(expected / shard.file))
    assert manifest.settings == read_manifest(str(expected)).settings

    # Training reads the prepared source without Ray Data (no dataset, no PassKeys): each worker reads its share of
    # a pass from the shards, described to it in primitives (Ray Train's controller unpickles them). Two workers'
    # shares read in Ray tasks, wherever they run, are the shares read here, every row once between them.
    config = train_config(tmp_path / "out", model)
    sources = [stage_sources(config.stages[0], 0)]
    assert count_stages(config, sources) == [[sum(ROWS_PER_FILE)]]  # from the manifest
    datasets, (described,) = stage_datasets(config, sources, [[sum(ROWS_PER_FILE)]])
    assert datasets == {} and set(described[0]) == {"name", "rows", "weight", "prepared"}
    assert b"sbert_ray" not in pickle.dumps(described)

    def share_hashes(described: dict, stage: StageConfig, seed: int, rank: int) -> list[int]:
        """Rank ``rank`` of two workers: the second texts' hashes of its examples of a pass, read from the source
        as ``stage_datasets`` describes it to the workers (``source_stream``)."""
        prepared = source_stream(described, None, stage).prepared
        plan = batch_plan(stage, 0, seed=seed, world_size=2, rank=rank)
        per_pass, key = plan.units_per_pass(prepared.rows), (plan.seed, 0, 0)
        batches = share_batches(prepared, per_pass, plan, key, 0, SourceCounts())
        return [int(h) for rows, index in batches for h in rows.hashes[1][index]]

    read_share = ray.remote(num_cpus=0)(share_hashes)
    shares = ray.get([read_share.remote(described[0], config.stages[0], config.seed, rank) for rank in (0, 1)])
    assert shares == [share_hashes(described[0], config.stages[0], config.seed, rank) for rank in (0, 1)]
    shards = pa.concat_tables(pq.read_table(tmp_path / "out" / shard.file) for shard in manifest.shards)
    assert sorted(shares[0] + shares[1]) == sorted(shards.column("hash_1").to_pylist())

    written = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "out").glob("*.parquet")}
    again = prepare_source(request)
    assert (again.rows, again.files_written, again.files_skipped) == (0, 0, 2)
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "out").glob("*.parquet")} == written
    (tmp_path / "out" / "part-1.parquet").unlink()
    resumed = prepare_source(request)
    assert (resumed.rows, resumed.files_written, resumed.files_skipped) == (130, 1, 1)
    assert read_manifest(str(tmp_path / "out")) == manifest

    # A reranker's objective: each row tokenised on the cluster as one text pair, as the reranker's training does.
    prepare_source(dataclasses.replace(request, output=tmp_path / "pairs", objective="reranker_bce"))
    reranker = CrossEncoderModel.load(tiny_model_dir, max_seq_length=MAX_SEQ_LENGTH)
    as_reranker = StageConfig(dataset=str(raw_folder), objective="reranker_bce")
    write_prepared(raw_folder, tmp_path / "pairs-expected", as_reranker, reranker, model)
    pairs = read_manifest(str(tmp_path / "pairs"))
    assert pairs.settings["joins_pairs"] and pairs.settings == read_manifest(str(tmp_path / "pairs-expected")).settings
    for shard in pairs.shards:
        table = pq.read_table(tmp_path / "pairs" / shard.file)
        assert table.equals(pq.read_table(tmp_path / "pairs-expected" / shard.file))
