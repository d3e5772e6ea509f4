"""Record types every reader returns, and the row checks that build them.

A reader turns each row of a source into one record or a clear error. Row-level problems are raised as
`RowError` (what is wrong); `RecordCollector` adds where (file and line, or Hub dataset and row) and applies
the error policy: "raise" stops at the first bad row with a `DataError`, "skip" counts bad rows and warns.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

# Label index = position. The order of the SBERT reference training script (label2int); Hub and XNLI label
# ids use other orders and are converted by name.
NLI_LABELS = ("contradiction", "entailment", "neutral")


@dataclass(frozen=True, slots=True)
class ScoredPair:
    sentence1: str
    sentence2: str
    score: float


@dataclass(frozen=True, slots=True)
class LabelledPair:
    sentence1: str
    sentence2: str
    label: int


@dataclass(frozen=True, slots=True)
class Triplet:
    anchor: str
    positive: str
    negative: str


@dataclass(frozen=True, slots=True)
class Pair:
    """(anchor, positive) without a hard negative: in-batch-negative objectives take the batch's other positives."""

    anchor: str
    positive: str


@dataclass(frozen=True, slots=True)
class Sentence:
    """One text (and, in a parquet source, its translation beside it): what a teacher's embedding is distilled on."""

    text: str


@dataclass(frozen=True, slots=True)
class TopicPair:
    topic: str
    sentence1: str
    sentence2: str
    score: float


Record = ScoredPair | LabelledPair | Triplet | Pair | TopicPair | Sentence
Kind = Literal["scored", "labelled", "triplet", "pair", "topic", "sentence"]
Errors = Literal["raise", "skip"]
RECORD_TYPES: dict[str, type[Record]] = {
    "scored": ScoredPair,
    "labelled": LabelledPair,
    "triplet": Triplet,
    "pair": Pair,
    "topic": TopicPair,
    "sentence": Sentence,
}


# The text fields of each record type, one siamese branch each, in column order.
TEXT_FIELDS: dict[type[Record], tuple[str, ...]] = {
    ScoredPair: ("sentence1", "sentence2"),
    LabelledPair: ("sentence1", "sentence2"),
    TopicPair: ("sentence1", "sentence2"),
    Triplet: ("anchor", "positive", "negative"),
    Pair: ("anchor", "positive"),
    Sentence: ("text",),
}


class DataError(ValueError):
    """A source cannot be read as asked; the message names the file and line (or Hub dataset and row)."""


class RowError(ValueError):
    """What is wrong with one row; the collector adds where the row is."""


class Records(list):
    """The records read from a source, plus what was left out of them.

    `skipped`: bad rows passed over with errors="skip". `dropped`: rows the format itself marks as unusable
    (SNLI/MultiNLI "-" labels, STS pairs without a gold score); they are logged, never an error.
    Concatenating sources adds the counts up (`Records.concat`).
    """

    def __init__(self, items: Iterable[Record] = (), skipped: int = 0, dropped: int = 0) -> None:
        super().__init__(items)
        self.skipped = skipped
        self.dropped = dropped

    @classmethod
    def concat(cls, parts: Iterable[Records]) -> Records:
        out = cls()
        for part in parts:
            out.extend(part)
            out.skipped += part.skipped
            out.dropped += part.dropped
        return out


def check_encoding(value: str, field: str) -> None:
    """Text that cannot be encoded as UTF-8: a byte that was not UTF-8 in the file (readers decode with
    errors="surrogateescape", so the row holding it fails here with its file and line) or, from JSON, an
    unpaired surrogate escape."""
    try:
        value.encode("utf-8")  # fails exactly on surrogates, at C speed
        return
    except UnicodeEncodeError as error:
        bad = value[error.start]
    if "\udc80" <= bad <= "\udcff":
        raise RowError(f"{field} is not valid UTF-8 (byte 0x{ord(bad) - 0xDC00:02x})")
    raise RowError(f"{field} holds an unpaired surrogate (U+{ord(bad):04X})")


def check_text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{field} is {type(value).__name__}, not text")
    if not value.strip():
        raise RowError(f"empty {field}")
    return value


def parse_score(value: object, field: str = "score") -> float:
    if isinstance(value, bool):  # JSON true is not the number 1
        raise RowError(f"{field} is a boolean ({value!r}), not a number")
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise RowError(f"unparsable {field} {value!r}") from None
    if not math.isfinite(score):
        raise RowError(f"{field} {value!r} is not a finite number")
    return score


def lookup(value: object, table: Mapping[object, float | int], field: str) -> float | int:
    known = ", ".join(repr(key) for key in table)
    try:
        found = not isinstance(value, bool) and value in table  # JSON true would match the key 1
    except TypeError:  # unhashable, e.g. a JSON list
        found = False
    if not found:
        raise RowError(f"unknown {field} {value!r} (expected one of {known})")
    return table[value]


NLI_LABEL_IDS: dict[object, int] = {name: index for index, name in enumerate(NLI_LABELS)}


def make_record(
    kind: Kind,
    row: Mapping[str, object],
    columns: Mapping[str, str] | None = None,
    values: Mapping[object, float | int] | None = None,
    score_range: tuple[float, float] | None = None,
) -> Record:
    """Build one record from a row of named values.

    columns: record field -> row key (fields not listed are looked up under their own name).
    values: raw label/score value -> number (e.g. UKP "HS" -> 3); without it a label must be an NLI word
    and a score a number.
    score_range: the source's declared scale (low, high), both included; a score outside it is a bad row.
    """
    record_type = RECORD_TYPES[kind]
    columns = columns or {}
    args = {}
    for field in dataclasses.fields(record_type):
        key = columns.get(field.name, field.name)
        if key not in row:
            raise RowError(f"missing column {key!r}")
        raw = row[key]
        if isinstance(raw, str):
            check_encoding(raw, key)
        if field.name == "label":
            args["label"] = int(lookup(raw, values or NLI_LABEL_IDS, key))
        elif field.name == "score":
            args["score"] = float(lookup(raw, values, key)) if values else parse_score(raw, key)
            if score_range and not score_range[0] <= args["score"] <= score_range[1]:
                low, high = score_range
                raise RowError(f"{key} {args['score']:g} is outside this data's scale [{low:g}, {high:g}]")
        else:
            args[field.name] = check_text(raw, key)
    return record_type(**args)


class RecordCollector:
    """Collects the records of one source and applies the error policy to its bad rows."""

    def __init__(self, source: str, errors: Errors = "raise", unit: str = "line") -> None:
        if errors not in ("raise", "skip"):
            raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
        self.source, self.errors, self.unit = source, errors, unit
        self.records = Records()
        self.rows = 0
        self.skip_reasons: list[str] = []
        self.drop_reasons: dict[str, int] = {}

    def add(self, position: int, build: Callable[..., Record], *args: object) -> None:
        """Append build(*args); a RowError it raises becomes a DataError or a skip."""
        self.rows += 1
        try:
            self.records.append(build(*args))
        except RowError as error:
            where = f"{self.source}, {self.unit} {position}: {error}"
            if self.errors == "raise":
                raise DataError(where) from None
            self.records.skipped += 1
            self.skip_reasons.append(where)

    def drop(self, reason: str) -> None:
        """A row the format documents as unusable (counted and logged, not an error)."""
        self.rows += 1
        self.records.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def finish(self) -> Records:
        for reason, count in self.drop_reasons.items():
            logger.info("dropped %d of %d rows in %s: %s", count, self.rows, self.source, reason)
        if self.skip_reasons:
            examples = "; ".join(self.skip_reasons[:3])
            logger.warning(
                "skipped %d of %d rows in %s (errors='skip'), e.g. %s",
                len(self.skip_reasons),
                self.rows,
                self.source,
                examples,
            )
        return self.records
