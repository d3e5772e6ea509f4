"""Retrieval sets from the Hugging Face Hub, by the names their publishers gave them, each read in its publisher's
own layout (through ``hub.load_hub_table``: the Hub, or its copy under SBERT_RAY_HUB_MIRROR).

- ``zeta-alpha-ai/Nano<Set>`` (NanoBEIR; sentence-transformers' ``NanoBEIREvaluator`` reads the same data): configs
  ``corpus`` and ``queries`` (``_id``, ``text``) and ``qrels`` (``query-id``, ``corpus-id``), each one ``train``
  split (``<config>/train-00000-of-00001.parquet``), which is NanoBEIR's test set. Every qrels row is relevant.
- ``mteb/<set>`` (MTEB's retrieval tasks): configs ``corpus`` (``_id``, ``title``, ``text``; split ``corpus``),
  ``queries`` (``_id``, ``text``; split ``queries``) and ``default``, the judgements (``query-id``, ``corpus-id``,
  ``score``) in one split per BEIR split (``test``, ``dev``, ``train``).
- ``BeIR/<set>`` (BEIR's own upload): configs ``corpus`` and ``queries`` (``_id``, ``title``, ``text``; splits
  ``corpus`` and ``queries``), the judgements in the separate repository ``BeIR/<set>-qrels`` (``test.tsv``,
  ``dev.tsv``, ``train.tsv``: ``query-id``, ``corpus-id``, ``score``).

As for a local BEIR folder (``retrieval_sets.read_beir``): a document's text is ``title + " " + text``, stripped; a
judgement scores relevant above 0; queries without a relevant document are not scored. As sentence-transformers'
NanoBEIR and MTEB loaders do, rows with empty text are left out (with a warning that counts them), and ids are
compared as text (a TSV's numeric ids are read as numbers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sbert_ray.data.hub import load_hub_table
from sbert_ray.data.records import DataError
from sbert_ray.data.retrieval_sets import RetrievalSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubRetrievalLayout:
    corpus: tuple[str, str]  # (config, split)
    queries: tuple[str, str]
    qrels_repo: str  # the repository of the judgements, "{repo}" formatted
    qrels_config: str | None
    qrels_split: str | None  # None: the split asked for
    splits: tuple[str, ...]  # the splits a task may ask for


# By owner. Each layout was read from the repositories' file listings and dataset cards on huggingface.co and from
# the loaders that read them (sentence-transformers' NanoBEIREvaluator, MTEB's retrieval data loader);
# tests/test_retrieval_hub.py rebuilds each one and loads it.
HUB_RETRIEVAL_LAYOUTS: dict[str, HubRetrievalLayout] = {
    "zeta-alpha-ai": HubRetrievalLayout(
        ("corpus", "train"), ("queries", "train"), "{repo}", "qrels", "train", ("test",)
    ),
    "mteb": HubRetrievalLayout(
        ("corpus", "corpus"), ("queries", "queries"), "{repo}", "default", None, ("test", "dev", "train")
    ),
    "BeIR": HubRetrievalLayout(
        ("corpus", "corpus"), ("queries", "queries"), "{repo}-qrels", None, None, ("test", "dev", "train")
    ),
}
# The NanoBEIR collection (zeta-alpha-ai/Nano<name>), named as sentence-transformers' NanoBEIREvaluator names them.
NANOBEIR = {
    "climatefever": "NanoClimateFEVER",
    "dbpedia": "NanoDBPedia",
    "fever": "NanoFEVER",
    "fiqa2018": "NanoFiQA2018",
    "hotpotqa": "NanoHotpotQA",
    "msmarco": "NanoMSMARCO",
    "nfcorpus": "NanoNFCorpus",
    "nq": "NanoNQ",
    "quoraretrieval": "NanoQuoraRetrieval",
    "scidocs": "NanoSCIDOCS",
    "arguana": "NanoArguAna",
    "scifact": "NanoSciFact",
    "touche2020": "NanoTouche2020",
}


def is_hub_retrieval(name: str) -> bool:
    """``name`` (``owner/set``) is a repository of an owner whose layout we read."""
    owner, slash, rest = name.partition("/")
    return bool(slash and rest and "/" not in rest and owner in HUB_RETRIEVAL_LAYOUTS)


def hub_retrieval_layout(repo: str, split: str) -> HubRetrievalLayout:
    """The layout of ``repo``, or a DataError naming what exists."""
    if not is_hub_retrieval(repo):
        raise DataError(f"{repo!r}: Hub retrieval sets are <owner>/<set> of {', '.join(HUB_RETRIEVAL_LAYOUTS)}")
    layout = HUB_RETRIEVAL_LAYOUTS[repo.partition("/")[0]]
    if split not in layout.splits:
        raise DataError(f"{repo} has no split {split!r}; choose one of {', '.join(layout.splits)}")
    return layout


def read_hub_retrieval(repo: str, split: str = "test") -> RetrievalSet:
    """The retrieval set ``repo`` (e.g. ``mteb/scifact``) with the judgements of ``split``."""
    layout = hub_retrieval_layout(repo, split)
    corpus = _texts(repo, *layout.corpus, with_title=True)
    queries = _texts(repo, *layout.queries, with_title=False)
    qrels_repo = layout.qrels_repo.format(repo=repo)
    qrels = load_hub_table(qrels_repo, layout.qrels_config, layout.qrels_split or split, repo)
    _require_columns(qrels, ("query-id", "corpus-id"), qrels_repo)
    scores = qrels["score"] if "score" in qrels.column_names else [1] * len(qrels)
    relevant: dict[str, set[str]] = {}
    for query, document, score in zip(qrels["query-id"], qrels["corpus-id"], scores, strict=True):
        if score > 0 and str(query) in queries:
            relevant.setdefault(str(query), set()).add(str(document))
    if not relevant:
        raise DataError(f"{qrels_repo} ({split}): no judgement with a score above 0 for a query of {repo}")
    return RetrievalSet({key: queries[key] for key in relevant}, corpus, relevant)


def _texts(repo: str, config: str, split: str, with_title: bool) -> dict[str, str]:
    table = load_hub_table(repo, config, split, repo)
    _require_columns(table, ("_id", "text"), f"{repo} ({config})")
    titles = table["title"] if with_title and "title" in table.column_names else [""] * len(table)
    texts = {
        str(key): f"{title or ''} {text or ''}".strip()
        for key, title, text in zip(table["_id"], titles, table["text"], strict=True)
    }
    empty = [key for key, text in texts.items() if not text]
    if empty:
        log.warning("%s (%s): %d row(s) with empty text left out, e.g. id %r", repo, config, len(empty), empty[0])
    return {key: text for key, text in texts.items() if text}


def _require_columns(table, columns: tuple[str, ...], where: str) -> None:
    missing = [column for column in columns if column not in table.column_names]
    if missing:
        raise DataError(f"{where}: no column {', '.join(missing)} (columns: {', '.join(table.column_names)})")
