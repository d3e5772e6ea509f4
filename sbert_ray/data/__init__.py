"""Data layer: record types, readers for local files / the Hub / user files, and training sources
(``sbert_ray.training.sources``, imported from its module: it needs pyarrow and the losses, which this package must not
import, since the command line imports ``DataError`` to report bad input)."""

from sbert_ray.data.hub import HUB_MIRROR_ENV, HUB_SOURCES, HubSource, check_hub, load_hub
from sbert_ray.data.readers import (
    DATA_DIR_ENV,
    STS_SUBSETS,
    UKP_ASPECT_FOLDS,
    UKP_ASPECT_SCORES,
    check_available,
    load_records,
    load_sts_subsets,
    nli_triplets,
    read_user_file,
    read_wikisec_csv,
    resolve_data_dir,
)
from sbert_ray.data.records import (
    NLI_LABELS,
    DataError,
    LabelledPair,
    Pair,
    Record,
    Records,
    ScoredPair,
    TopicPair,
    Triplet,
)

__all__ = [
    "DATA_DIR_ENV",
    "HUB_MIRROR_ENV",
    "HUB_SOURCES",
    "NLI_LABELS",
    "STS_SUBSETS",
    "UKP_ASPECT_FOLDS",
    "UKP_ASPECT_SCORES",
    "DataError",
    "HubSource",
    "LabelledPair",
    "Pair",
    "Record",
    "Records",
    "ScoredPair",
    "TopicPair",
    "Triplet",
    "check_available",
    "check_hub",
    "load_hub",
    "load_records",
    "load_sts_subsets",
    "nli_triplets",
    "read_user_file",
    "read_wikisec_csv",
    "resolve_data_dir",
]
