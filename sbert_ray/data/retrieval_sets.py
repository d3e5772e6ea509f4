"""Retrieval sets: queries, a corpus and which documents are relevant to each query.

Two sources:

- the BEIR layout in a local folder: ``corpus.jsonl`` (``{"_id", "title", "text"}``; a document's text is
  ``title + " " + text``, stripped, as BEIR's and sentence-transformers' examples join them), ``queries.jsonl``
  (``{"_id", "text"}``) and ``qrels/<split>.tsv`` (a ``query-id, corpus-id, score`` header, then one judgement a
  line; score > 0 is relevant, 0 or less judged not relevant). Every id the qrels name must exist; queries
  without a relevant document are not scored (sentence-transformers' ``InformationRetrievalEvaluator`` skips
  them too); documents without a judgement are not relevant.
- ``stsb_retrieval``: built from an STSb split (see its docstring), so retrieval can be scored with no download.

Bad input is a one-line ``DataError`` naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sbert_ray.data.records import DataError, ScoredPair

QRELS_HEADER = ("query-id", "corpus-id", "score")
STSB_RELEVANT_SCORE = 4.0  # stsb-retrieval: a pair scored at least this makes sentence2 relevant to sentence1


@dataclass(frozen=True)
class RetrievalSet:
    """``queries`` and ``corpus``: id -> text; ``relevant``: query id -> the ids of its relevant documents, for
    the queries that have one (the scored queries)."""

    queries: dict[str, str]
    corpus: dict[str, str]
    relevant: dict[str, set[str]]


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its LF or CRLF) for every line; bytes that are not UTF-8 name their line."""
    try:
        file = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"{path}: no such file") from None
    with file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}, line {number}: not valid UTF-8") from None
            yield number, line.removesuffix("\n").removesuffix("\r")


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSON-lines file."""
    for number, line in _text_lines(path):
        if line.strip():
            yield number, _json_object(line, path, number)


def _json_object(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}, line {number}: invalid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
    return row


def _row_id(row: dict, path: Path, number: int) -> str:
    """A row's ``_id``: text, or a JSON integer (some BEIR exports write them so) as its decimal text."""
    value = row.get("_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise DataError(f"{path}, line {number}: '_id' must be a string or an integer, got {value!r}")
    return value


def _row_text(row: dict, key: str, path: Path, number: int, optional: bool = False) -> str:
    value = row.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{path}, line {number}: {key!r} must be text, got {value!r}"[:200])
    return value


def _read_texts(path: Path, with_title: bool) -> dict[str, str]:
    """{_id: text} of a corpus (title and text joined by a space, stripped) or queries file."""
    texts: dict[str, str] = {}
    for number, row in _json_lines(path):
        key = _row_id(row, path, number)
        title = _row_text(row, "title", path, number, optional=True) if with_title else ""
        text = f"{title} {_row_text(row, 'text', path, number)}".strip()
        if not text:
            raise DataError(f"{path}, line {number}: empty text for id {key!r}")
        if key in texts:
            raise DataError(f"{path}, line {number}: id {key!r} appears twice")
        texts[key] = text
    if not texts:
        raise DataError(f"{path}: no rows")
    return texts


def _read_qrels(path: Path, queries: dict[str, str], corpus: dict[str, str]) -> dict[str, set[str]]:
    relevant: dict[str, set[str]] = {}
    lines = _text_lines(path)
    if tuple(next(lines, (1, ""))[1].split("\t")) != QRELS_HEADER:
        raise DataError(f"{path}, line 1: expected the header {chr(9).join(QRELS_HEADER)!r} (TAB-separated)")
    for number, line in lines:
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise DataError(f"{path}, line {number}: expected 3 TAB-separated fields, got {len(fields)}")
        query, document, score = fields
        for key, known, name in ((query, queries, "queries.jsonl"), (document, corpus, "corpus.jsonl")):
            if key not in known:
                raise DataError(f"{path}, line {number}: id {key!r} is not in {name}")
        try:
            relevant_here = int(score) > 0
        except ValueError:
            raise DataError(f"{path}, line {number}: score {score!r} is not an integer") from None
        if relevant_here:
            relevant.setdefault(query, set()).add(document)
    if not relevant:
        raise DataError(f"{path}: no judgement with a score above 0, so no query can be scored")
    return relevant


def read_beir(folder: str | Path, split: str = "test") -> RetrievalSet:
    """The BEIR layout in ``folder`` with the judgements of ``qrels/<split>.tsv``."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder (expected corpus.jsonl, queries.jsonl and qrels/{split}.tsv)")
    corpus = _read_texts(folder / "corpus.jsonl", with_title=True)
    queries = _read_texts(folder / "queries.jsonl", with_title=False)
    relevant = _read_qrels(folder / "qrels" / f"{split}.tsv", queries, corpus)
    return RetrievalSet({key: queries[key] for key in queries if key in relevant}, corpus, relevant)


def stsb_retrieval(pairs: Sequence[ScoredPair]) -> RetrievalSet:
    """Retrieval from one STSb split: the queries are the distinct ``sentence1`` texts of the pairs scored at
    least 4.0, each query's relevant documents the ``sentence2`` texts of those pairs, and the corpus every
    distinct ``sentence2`` of the split. Ids follow the file's order: ``d<k>`` is the k-th distinct sentence2 of
    the split, ``q<k>`` the k-th distinct sentence1 among the pairs scored at least 4.0 (k from 0)."""
    corpus_ids = {text: f"d{k}" for k, text in enumerate(dict.fromkeys(p.sentence2 for p in pairs))}
    relevant_texts: dict[str, list[str]] = {}
    for pair in pairs:
        if pair.score >= STSB_RELEVANT_SCORE:
            relevant_texts.setdefault(pair.sentence1, []).append(pair.sentence2)
    queries = {f"q{k}": text for k, text in enumerate(relevant_texts)}
    relevant = {f"q{k}": {corpus_ids[text] for text in texts} for k, texts in enumerate(relevant_texts.values())}
    return RetrievalSet(queries, {key: text for text, key in corpus_ids.items()}, relevant)
