"""``model.type``: what a run trains. Its own module so that the config can check it without importing torch."""

from typing import Literal

# bi_encoder: ``SentenceEncoder`` (each text embedded alone); cross_encoder: ``CrossEncoderModel`` (a reranker,
# each (query, passage) pair read together)
ModelType = Literal["bi_encoder", "cross_encoder"]
