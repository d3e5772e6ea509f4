"""Retrieval sets: queries, a corpus and which documents are relevant to each query.

Two sources:

- the BEIR layout in a local folder or under an object-storage prefix (``s3://bucket/beir/scifact``):
  ``corpus.jsonl`` (``{"_id", "title", "text"}``; a document's text is ``title + " " + text``, stripped, as BEIR's
  and sentence-transformers' examples join them), ``queries.jsonl`` (``{"_id", "text"}``) and
  ``qrels/<split>.tsv`` (a ``query-id, corpus-id, score`` header, then one judgement a line; score > 0 is
  relevant, 0 or less judged not relevant). Every id the qrels name must exist; queries without a relevant
  document are not scored (sentence-transformers' ``InformationRetrievalEvaluator`` skips them too); documents
  without a judgement are not relevant. Under a prefix, queries and judgements are read whole (they are small)
  but the corpus is a ``StreamedCorpus``: read as a stream each time it is needed, by this process or through Ray
  Data (``evaluation.retrieval``), its rows checked as they come.
- ``stsb_retrieval``: built from an STSb split (see its docstring), so retrieval can be scored with no download.

Bad input is a one-line ``DataError`` naming the file and line.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sbert_ray.data.records import DataError, ScoredPair

QRELS_HEADER = ("query-id", "corpus-id", "score")
BYTE_ORDER_MARK = "\ufeff"  # a file may start with one; Ray Data's text reader keeps it in the first line
STSB_RELEVANT_SCORE = 4.0  # stsb-retrieval: a pair scored at least this makes sentence2 relevant to sentence1


@dataclass(frozen=True)
class StreamedCorpus:
    """A ``corpus.jsonl`` on object storage, never held whole: ``documents`` checks and joins the rows of a stream
    of its non-blank lines (from ``lines()`` here, or from Ray Data on a cluster). A judgement of ``qrels`` can only
    be checked against its ids once they have streamed by (``check_judged``)."""

    uri: str
    qrels: str  # the judgements' file, named when one names a document the corpus lacks

    def lines(self) -> Iterator[str]:
        """The file's non-blank lines, read as a stream by this process."""
        return (line for _, line in _text_lines(self.uri) if line.strip())

    def documents(self, lines: Iterable[str]) -> Iterator[tuple[str, str, str]]:
        """(where, id, text) of each of ``lines`` (the file's non-blank lines, in order), checked as a local
        corpus.jsonl's rows are; ``where`` (and an error) names the file and the row (the n-th non-blank line)."""
        rows = (
            (f"{self.uri}, row {number}", line.removeprefix(BYTE_ORDER_MARK) if number == 1 else line)
            for number, line in enumerate(lines, start=1)
        )
        return _documents(((where, _json_object(line, where)) for where, line in rows), with_title=True)

    def check_judged(self, relevant: dict[str, set[str]], ids: set[str]) -> None:
        missing = sorted(document for documents in relevant.values() for document in documents - ids)
        if missing:
            raise DataError(f"{self.qrels}: id {missing[0]!r} is not in {self.uri}")


@dataclass(frozen=True)
class RetrievalSet:
    """``queries`` and ``corpus``: id -> text (a corpus on object storage: a ``StreamedCorpus``); ``relevant``:
    query id -> the ids of its relevant documents, for the queries that have one (the scored queries)."""

    queries: dict[str, str]
    corpus: dict[str, str] | StreamedCorpus
    relevant: dict[str, set[str]]


def _open(location: str | Path) -> io.BufferedIOBase:
    """A local file, or an object (``s3://...``, any URI pyarrow opens), for reading bytes."""
    try:
        if isinstance(location, Path) or "://" not in location:
            return open(location, "rb")
        import pyarrow.fs as pa_fs  # objects only: a local retrieval set is read without pyarrow

        filesystem, path = pa_fs.FileSystem.from_uri(location)
        if filesystem.get_file_info(path).type != pa_fs.FileType.File:
            raise FileNotFoundError(location)
        return io.BufferedReader(filesystem.open_input_stream(path))
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"{location}: no such file") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{location}: cannot be read ({str(err).strip().splitlines()[0]})") from None


def _text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its LF or CRLF) for every line; bytes that are not UTF-8 name their line."""
    file = _open(path)
    with file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}, line {number}: not valid UTF-8") from None
            yield number, line.removesuffix("\n").removesuffix("\r")


def _json_lines(path: str | Path) -> Iterator[tuple[str, dict]]:
    """("<file>, line <n>", object) for every non-blank line of a JSON-lines file."""
    for number, line in _text_lines(path):
        if line.strip():
            where = f"{path}, line {number}"
            yield where, _json_object(line, where)


def _json_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: invalid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _row_id(row: dict, where: str) -> str:
    """A row's ``_id``: text, or a JSON integer (some BEIR exports write them so) as its decimal text."""
    value = row.get("_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: '_id' must be a string or an integer, got {value!r}")
    return value


def _row_text(row: dict, key: str, where: str, optional: bool = False) -> str:
    value = row.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be text, got {value!r}"[:200])
    return value


def _documents(rows: Iterable[tuple[str, dict]], with_title: bool) -> Iterator[tuple[str, str, str]]:
    """(where, _id, text) of each (where, row): a corpus row's title and text joined by a space, stripped, or a
    query's text; a row without an id or text names where it is."""
    for where, row in rows:
        key = _row_id(row, where)
        title = _row_text(row, "title", where, optional=True) if with_title else ""
        text = f"{title} {_row_text(row, 'text', where)}".strip()
        if not text:
            raise DataError(f"{where}: empty text for id {key!r}")
        yield where, key, text


def _read_texts(path: str | Path, with_title: bool) -> dict[str, str]:
    """{_id: text} of a corpus or queries file, each id once."""
    texts: dict[str, str] = {}
    for where, key, text in _documents(_json_lines(path), with_title):
        if key in texts:
            raise DataError(f"{where}: id {key!r} appears twice")
        texts[key] = text
    if not texts:
        raise DataError(f"{path}: no rows")
    return texts


def _read_qrels(path: str | Path, queries: dict[str, str], corpus: dict[str, str] | None) -> dict[str, set[str]]:
    """Each query's relevant documents; every id must be a query's, and a document's unless the corpus is
    streamed (``corpus`` None: ``StreamedCorpus.check_judged`` looks once its ids have come by)."""
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
            if known is not None and key not in known:
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
    """The BEIR layout in ``folder`` (or under an object-storage prefix: its corpus streamed) with the judgements
    of ``qrels/<split>.tsv``."""
    if "://" in str(folder):
        return _read_remote_beir(str(folder).rstrip("/"), split)
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder (expected corpus.jsonl, queries.jsonl and qrels/{split}.tsv)")
    corpus = _read_texts(folder / "corpus.jsonl", with_title=True)
    queries = _read_texts(folder / "queries.jsonl", with_title=False)
    relevant = _read_qrels(_qrels_file(str(folder.resolve()), split), queries, corpus)
    return RetrievalSet({key: queries[key] for key in queries if key in relevant}, corpus, relevant)


def _read_remote_beir(prefix: str, split: str) -> RetrievalSet:
    """Queries and judgements read and checked here; the corpus only looked for (it streams when scored)."""
    corpus = StreamedCorpus(f"{prefix}/corpus.jsonl", _qrels_file(prefix, split))
    _open(corpus.uri).close()
    queries = _read_texts(f"{prefix}/queries.jsonl", with_title=False)
    relevant = _read_qrels(corpus.qrels, queries, None)
    return RetrievalSet({key: queries[key] for key in queries if key in relevant}, corpus, relevant)


def _qrels_file(folder: str, split: str) -> str:
    """``<folder>/qrels/<split>.tsv`` (a local folder or a URI prefix); a DataError names it and the splits the
    folder has when it is missing."""
    import pyarrow.fs as pa_fs

    path = posixpath.join(folder, "qrels", f"{split}.tsv")
    try:
        filesystem, qrels = pa_fs.FileSystem.from_uri(posixpath.dirname(path))
        listed = filesystem.get_file_info(pa_fs.FileSelector(qrels, allow_not_found=True))
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot be listed ({str(err).strip().splitlines()[0]})") from None
    splits = sorted(posixpath.basename(info.path)[:-4] for info in listed if info.path.endswith(".tsv"))
    if split not in splits:
        raise DataError(f"{path}: no such file (splits here: {', '.join(splits) or 'none'})")
    return path


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
