"""The pooling modes as a type that needs no torch: the config checks ``model.pooling`` against it."""

from typing import Literal, get_args

# weightedmean and lasttoken: the modes of decoder embedders (SGPT's position-weighted mean; Qwen3-Embedding's and
# E5-Mistral's last token), as sentence-transformers computes them.
PoolingMode = Literal["mean", "max", "cls", "weightedmean", "lasttoken"]
POOLING_MODES: tuple[str, ...] = get_args(PoolingMode)
