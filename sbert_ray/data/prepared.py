"""A prepared training source: a folder ``sbert-ray prepare`` wrote, of tokenised parquet shards and ``manifest.json``.

Each shard holds one input file's training examples in the tokenised table layout the training stream carries
(``training.batches.tokenize_table``: ``ids_<k>`` int32 token ids per text column, ``hash_<k>`` a hash of each text,
``length``, ``truncated``, ``label``), in row groups of ``rows_per_group`` rows (a shard's last one fewer). The
manifest, written last (a folder without one is incomplete), lists the shards with their rows per row group and
what their token ids depend on: the tokenizer (a fingerprint of its files' behaviour), ``max_seq_length``, the
prompts, whether each row's anchor and other texts were tokenised as one text pair (``joins_pairs``: a reranker's
objective), and how the rows were read (``reading``: the objective's records, label and kept rows, ``score_max``,
``errors``). Training reads the shards as they are and refuses a manifest whose settings differ from the run's
(``differences``), naming each.

pyarrow is imported inside the functions that read: the command line imports the data layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sbert_ray.data.records import DataError

MANIFEST = "manifest.json"
PREPARE_MARKER = "_sbert_ray_prepare.json"  # marks a folder as prepare's, with the settings of its shards
FORMAT = 1  # the manifest's layout; a reader refuses one it does not know
# What a prepared source's token ids depend on: a run whose own differ is refused (``differences``).
SETTINGS = ("tokenizer", "max_seq_length", "prompts", "joins_pairs", "reading")


@dataclass(frozen=True)
class Shard:
    file: str  # its path under the prepared folder
    rows: int
    row_groups: tuple[int, ...]  # rows per row group, in order


@dataclass(frozen=True)
class Manifest:
    """A prepared folder's manifest (``folder``: where it was read, not stored in it)."""

    folder: str
    settings: dict[str, Any]  # SETTINGS' values
    source: str  # the source it was prepared from, as given
    model: str
    input_columns: dict[str, str]  # field -> the input's column, where it names them otherwise (``columns``)
    column_roles: dict[str, str]  # ids_<k> -> the input field it tokenises (its prompt: the anchor's query prompt)
    rows_per_group: int
    shards: tuple[Shard, ...]

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    @property
    def files(self) -> tuple[str, ...]:
        """The shards' paths (or URIs), in the order the manifest lists them."""
        return tuple(f"{self.folder}/{shard.file}" for shard in self.shards)

    def to_json(self) -> dict[str, Any]:
        shards = [{"file": s.file, "rows": s.rows, "row_groups": list(s.row_groups)} for s in self.shards]
        return {
            "format": FORMAT,
            "source": self.source,
            "model": self.model,
            "input_columns": self.input_columns,
            **self.settings,
            "column_roles": self.column_roles,
            "rows_per_group": self.rows_per_group,
            "rows": self.rows,
            "shards": shards,
        }

    @classmethod
    def from_json(cls, folder: str, data: dict[str, Any]) -> Manifest:
        where = f"{folder}/{MANIFEST}"
        if data.get("format") != FORMAT:
            raise DataError(f"{where}: format {data.get('format')!r}, this sbert-ray reads {FORMAT}; prepare it again")
        try:
            shards = tuple(Shard(s["file"], int(s["rows"]), tuple(s["row_groups"])) for s in data["shards"])
            return cls(
                folder,
                # Manifests written before rerankers hold no joins_pairs: their texts were tokenised alone.
                {name: data[name] if name != "joins_pairs" else data.get(name, False) for name in SETTINGS},
                data["source"],
                data["model"],
                dict(data["input_columns"]),
                dict(data["column_roles"]),
                int(data["rows_per_group"]),
                shards,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{where}: not a manifest of sbert-ray prepare ({type(err).__name__}: {err})") from None


def read_manifest(folder: str) -> Manifest | None:
    """The manifest of the prepared ``folder`` (a local absolute path or an object storage URI); None when it is
    not prepare's; a DataError when prepare has not finished it (its marker without a manifest)."""
    from pyarrow import fs

    from sbert_ray.data.corpus import file_system

    filesystem, root = file_system(folder.rstrip("/"))
    path = f"{root}/{MANIFEST}"
    manifest, marker = filesystem.get_file_info([path, f"{root}/{PREPARE_MARKER}"])
    if manifest.type != fs.FileType.File:
        if marker.type == fs.FileType.File:
            raise DataError(f"{folder}: an unfinished sbert-ray prepare output (no {MANIFEST}): run prepare again")
        return None
    with filesystem.open_input_stream(path) as stream:
        try:
            data = json.loads(stream.read())
        except ValueError as err:
            raise DataError(f"{folder}/{MANIFEST}: not JSON ({err})") from None
    return Manifest.from_json(folder.rstrip("/"), data)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides a transformers tokenizer's token ids: for a fast tokenizer its whole pipeline
    (normaliser, pre-tokeniser, vocabulary, post-processor: ``tokenizer.json``), else its class, vocabulary and
    special tokens. Equal tokenizers saved anywhere give the same fingerprint. A fast tokenizer's truncation and
    padding are left out: each call sets them (``max_seq_length`` is compared on its own)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        described = json.dumps(pipeline, sort_keys=True)
    else:
        vocabulary = sorted(tokenizer.get_vocab().items())
        described = json.dumps([type(tokenizer).__name__, vocabulary, tokenizer.special_tokens_map], default=str)
    return "sha256:" + hashlib.sha256(described.encode()).hexdigest()[:16]


def prepared_settings(
    tokenizer, max_seq_length: int, prompts: dict[str, str], reading: dict[str, Any], joins_pairs: bool = False
) -> dict:
    """SETTINGS as a run with this tokenizer, ``max_seq_length``, prompts, way of reading its source and of
    tokenising its rows (``joins_pairs``: a reranker's text pairs) has them."""
    return {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_length": max_seq_length,
        "prompts": dict(prompts),
        "joins_pairs": joins_pairs,
        "reading": reading,
    }


def differences(manifest: Manifest, settings: dict[str, Any]) -> list[str]:
    """Each setting the prepared source was made with that differs from ``settings`` (a run's), as
    ``name: prepared with X, this run's Y``."""
    return [
        f"{name}: prepared with {manifest.settings[name]!r}, this run's {settings[name]!r}"
        for name in SETTINGS
        if manifest.settings[name] != settings[name]
    ]
