"""A prepared source's pass as one sequence of rows, any stretch of which a worker reads straight from the shards.

The pass's row groups, in the order ``sources.pass_reads`` gives for its key (the shards, then each shard's row
groups), make one sequence of rows (its first ``stage.limit`` rows, with a limit); the manifest's rows per row group
place every row of it without reading anything. Each worker reads the stretches of it that are its share
(``training.stream.share_batches``) with pyarrow, locally or from object storage, reading only the row groups a
stretch lies in: the rows a rank trains on are a function of the pass key, the world sizes and its rank, never of
where anything ran, and a resume reads from where it stands, not from the pass's start. No Ray: rows that need no
tokenising are cheap to read in the worker's own process.

pyarrow is imported by the functions that read: Ray Train's controller unpickles these with the stage's data.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import TYPE_CHECKING

from sbert_ray.config import StageConfig
from sbert_ray.data.prepared import Manifest
from sbert_ray.training.sources import Source, pass_reads, read_prepared_groups

if TYPE_CHECKING:
    import pyarrow as pa


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One row group of a pass's sequence: its shard, its index there and the place of its first row in the pass."""

    file: str
    index: int
    first: int
    rows: int


@dataclasses.dataclass(frozen=True)
class PreparedPasses:
    """The passes over a prepared source (``source.manifest`` is set)."""

    source: Source
    stage: StageConfig
    rows: int  # of one pass: the manifest's, at most the stage's limit

    @classmethod
    def of(cls, source: Source, stage: StageConfig) -> PreparedPasses:
        rows = source.manifest.rows
        return cls(source, stage, min(rows, stage.limit) if stage.limit else rows)

    def to_wire(self) -> dict:
        """Primitives (the source and its manifest; the stage is the worker's own config's): Ray Train's controller
        unpickles what the workers get without importing this package."""
        source = self.source
        described = {"key": source.key, "spec": source.spec, "split": source.split, "columns": source.columns}
        return {**described, "weight": source.weight, "folder": source.manifest.folder,
                "manifest": source.manifest.to_json()}  # fmt: skip

    @classmethod
    def from_wire(cls, wire: dict, stage: StageConfig) -> PreparedPasses:
        manifest = Manifest.from_json(wire["folder"], wire["manifest"])
        described = {name: wire[name] for name in ("key", "spec", "split", "weight", "columns")}
        return cls.of(Source(**described, files=manifest.files, manifest=manifest), stage)

    def row_groups(self, key: tuple[int, int, int]) -> list[RowGroup]:
        """The pass's row groups in its order (``pass_reads``), as far as its ``rows`` go."""
        shards = dict(zip(self.source.files, self.source.manifest.shards, strict=True))
        groups, first = [], 0
        for file, order in pass_reads(self.source, self.stage, key):
            sizes = shards[file].row_groups
            for index in range(len(sizes)) if order is None else order:
                if first >= self.rows:
                    return groups
                groups.append(RowGroup(file, index, first, sizes[index]))
                first += sizes[index]
        return groups

    def read(self, groups: list[RowGroup], start: int, stop: int) -> tuple[pa.Table, int]:
        """Rows ``start`` to ``stop`` of the pass whose ``row_groups`` are ``groups``, and how many rows were read
        for them: the whole row groups they lie in (the unit parquet is read in), each shard opened once."""
        import pyarrow as pa

        first = bisect.bisect_right([group.first for group in groups], start) - 1
        touched = itertools.takewhile(lambda group: group.first < stop, groups[first:])
        tables, read = [], 0
        for file, consecutive in itertools.groupby(touched, key=lambda group: group.file):  # one read per shard
            run = list(consecutive)
            table = read_prepared_groups(self.source, file, [group.index for group in run])
            read += table.num_rows
            offset = max(0, start - run[0].first)
            tables.append(table.slice(offset, min(stop, run[-1].first + run[-1].rows) - run[0].first - offset))
        return pa.concat_tables(tables), read
