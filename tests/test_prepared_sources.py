"""Prepared training sources (``sbert-ray prepare``, ``data.prepared``): training reads their shards as they are, to
the same micro-batches as the raw source gives; a manifest made for another tokenizer, length or prompts is refused
before Ray, naming each difference. The one prepare run on the local cluster checks that its shards hold what
training would compute, that training's Ray Data stream reads a pass of them in that pass's seeded order of shards
and row groups, and that a rerun writes only what is missing."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data
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
from sbert_ray.models.load import load_tokenizer
from sbert_ray.runs.prepare_source import PrepareRequest, prepare_source, shard_inputs
from sbert_ray.training.batches import tokenize_table
from sbert_ray.training.sources import Source, column_roles, pass_reads, read_tables, reading, stage_sources
from sbert_ray.training.stage_data import count_stages, pass_opener, stage_datasets
from sbert_ray.training.stream import StageBatches, batch_plan, local_sources, stage_steps

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


def write_prepared(raw, output, stage: StageConfig, encoder, model: str) -> None:
    """A prepared folder written in this process: each input file's tables tokenised as the training stream does,
    in row groups of ROWS_PER_GROUP, and its manifest (the cluster test shows prepare writes the same shards)."""
    (source,) = stage_sources(dataclasses.replace(stage, dataset=str(raw)), 0)
    output.mkdir()
    shards = []
    for item in shard_inputs(source.files):
        table = pa.concat_tables(tokenize_table(t, encoder) for t in read_tables(source, item.uri, stage, None))
        pq.write_table(table, output / f"{item.key}.parquet", row_group_size=ROWS_PER_GROUP)
        groups = [min(ROWS_PER_GROUP, table.num_rows - start) for start in range(0, table.num_rows, ROWS_PER_GROUP)]
        shards.append(Shard(f"{item.key}.parquet", table.num_rows, tuple(groups)))
    settings = prepared_settings(encoder.tokenizer, encoder.max_seq_length, encoder.prompts, reading(stage))
    roles = column_roles(stage, 2)
    manifest = Manifest(str(output), settings, str(raw), model, {}, roles, ROWS_PER_GROUP, tuple(shards))
    (output / MANIFEST).write_text(json.dumps(manifest.to_json()))


def train_config(dataset, model: str, shuffle_files: bool = True, **model_settings) -> TrainConfig:
    stage = StageConfig(dataset=str(dataset), batch_size=8, window_batches=4, epochs=2, shuffle_files=shuffle_files)
    return TrainConfig(
        name="prepared",
        model=ModelConfig(name=model, max_seq_length=MAX_SEQ_LENGTH, **model_settings),
        stages=[stage],
        evaluation=EvalConfig(final_tasks=[]),
    )


def micro_batches(config: TrainConfig, encoder, count: int, epoch: int = 0, position: int = 0) -> list:
    """The first ``count`` micro-batches of the stage's one worker (``config.seed``) from (``epoch``, ``position``)
    on, across the epoch boundary."""
    stage = config.stages[0]
    sources = local_sources(config, 0, encoder)
    plan = batch_plan(stage, 0, seed=config.seed, world_size=1, rank=0)
    per_epoch, _ = stage_steps([s.rows for s in sources], [s.weight for s in sources], stage, plan)

    def collate(batch):
        rows, index = batch
        return rows.collate(index, pad_token_id=0, pad_left=False, device=torch.device("cpu"))

    return list(itertools.islice(StageBatches(sources, plan, per_epoch, epoch, position, collate), count))


def test_a_prepared_source_gives_the_micro_batches_of_its_raw_source(raw_folder, encoder, tiny_model_dir, tmp_path):
    """Token ids, text hashes, labels and positions of every micro-batch of two epochs are equal, read from the raw
    csv shards (tokenised in the loop) or from their prepared shards (read as they are), in the files' listed order
    (with ``shuffle_files`` the prepared shards' row groups are read in an order of their own, which raw files
    have not)."""
    stage = StageConfig(dataset=str(raw_folder))
    prepared = tmp_path / "prepared"
    write_prepared(raw_folder, prepared, stage, encoder, str(tiny_model_dir))
    (source,) = stage_sources(StageConfig(dataset=str(prepared)), 0)
    assert source.manifest is not None and source.manifest.rows == sum(ROWS_PER_FILE)

    count = 2 * -(-sum(ROWS_PER_FILE) // 8)  # two epochs of batches of 8
    raw = micro_batches(train_config(raw_folder, str(tiny_model_dir), shuffle_files=False), encoder, count)
    read = micro_batches(train_config(prepared, str(tiny_model_dir), shuffle_files=False), encoder, count)
    assert len(raw) == len(read) == count and {b.epoch for b in raw} == {0, 1}
    for a, b in zip(raw, read, strict=True):
        assert (a.epoch, a.position, a.size) == (b.epoch, b.position, b.size)
        for features_a, features_b in zip(a.features, b.features, strict=True):
            assert torch.equal(features_a["input_ids"], features_b["input_ids"])
        assert all(torch.equal(x, y) for x, y in zip(a.text_hashes, b.text_hashes, strict=True))
        assert torch.equal(a.labels, b.labels)


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
    """A prepared source (two shards of three row groups) through the stream of one worker: each pass's tables are
    the row groups in ``pass_reads``' order, every row once; two epochs give each row once each, in other batches;
    a run resumed inside the second epoch takes exactly the micro-batches the uninterrupted run takes from there."""
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
        reads.append([h for table in stream.open_pass(key) for h in table.column("hash_0").to_pylist()])
        assert reads[-1] == list(itertools.chain(*groups))  # in the pass's order of files and row groups
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
    local_ray, raw_folder, encoder, tiny_model_dir, tmp_path, monkeypatch
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

    # Training's Ray Data stream of the prepared source: its shards' rows as they are, no tokenise stage.
    config = train_config(tmp_path / "out", model)
    sources = [stage_sources(config.stages[0], 0)]
    assert count_stages(config, sources) == [[sum(ROWS_PER_FILE)]]  # from the manifest
    options = ray.data.DataContext.get_current().execution_options
    monkeypatch.setattr(options, "preserve_order", True)  # as the Train workers' DataConfig
    datasets, (described,) = stage_datasets(config, sources, [[sum(ROWS_PER_FILE)]])
    key = (config.seed, 0, 1)  # the second pass: its read tasks in its order of shards and row groups
    open_pass = pass_opener(datasets["stage0.0"], described[0])
    streamed = pa.concat_tables(open_pass(key))
    shards = pa.concat_tables(pq.read_table(tmp_path / "out" / shard.file) for shard in manifest.shards)
    assert streamed.schema.names == shards.schema.names
    in_order = [
        pq.ParquetFile(file).read_row_group(group).column("hash_0")
        for file, groups in pass_reads(sources[0][0], config.stages[0], key)
        for group in groups
    ]
    assert streamed.column("hash_0").to_pylist() == pa.chunked_array(in_order).to_pylist()
    assert sorted(streamed.column("hash_0").to_pylist()) == sorted(shards.column("hash_0").to_pylist())
    # Split for two workers as Ray Train splits it: both hand the first pass's key to PassKeys, and the split's
    # coordinator (its own actor) lists the read tasks in that pass's order, every row once between them.
    key = (config.seed, 0, 0)
    splits = datasets["stage0.0"].streaming_split(2, equal=True)
    with ThreadPoolExecutor(2) as workers:  # the split's pass starts when both have asked for it
        opened = [pass_opener(split, described[0]) for split in splits]
        shares = list(workers.map(lambda open_pass: pa.concat_tables(open_pass(key)), opened))
    order = [h for t in local_sources(config, 0, encoder)[0].open_pass(key) for h in t.column("hash_0").to_pylist()]
    for share in shares:
        rest = iter(order)
        assert all(h in rest for h in share.column("hash_0").to_pylist())  # in the pass's order
    assert sorted(pa.concat_tables(shares).column("hash_0").to_pylist()) == sorted(order)

    written = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "out").glob("*.parquet")}
    again = prepare_source(request)
    assert (again.rows, again.files_written, again.files_skipped) == (0, 0, 2)
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "out").glob("*.parquet")} == written
    (tmp_path / "out" / "part-1.parquet").unlink()
    resumed = prepare_source(request)
    assert (resumed.rows, resumed.files_written, resumed.files_skipped) == (130, 1, 1)
    assert read_manifest(str(tmp_path / "out")) == manifest
