"""The pooling modes as a type that needs no torch: the config checks ``model.pooling`` against it."""

from typing import Literal, get_args

PoolingMode = Literal["mean", "max", "cls"]
POOLING_MODES: tuple[str, ...] = get_args(PoolingMode)
