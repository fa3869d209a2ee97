"""seqio task registry of aligner_jax: importing ``tasks`` registers the training tasks.

Registered tasks (``tasks.retrieval_tasks``): ``msmarco_triples``, ``beir_train_bm25`` and
``selfsup_pseudo_queries``, with their data located by the gin-configurable functions
``msmarco_train_source``, ``beir_train_source`` and ``selfsup_train_source`` and their
vocabulary chosen by ``task_vocabulary``. ``AlignerFeatureConverter`` turns task features
``{"query", "doc"}`` into model features ``query_tokens [Lq]`` / ``doc_tokens [1+N, Ld]``.
"""

from aligner_jax.tasks.beir_train import (
    BeirTrainConfig,
    beir_train_source,
    build_beir_train_examples,
)
from aligner_jax.tasks.features import (
    DEFAULT_TASK_FEATURE_LENGTHS,
    AlignerFeatureConverter,
    batches_as_numpy,
    frame_tokens,
    frame_tokens_tf,
    output_features,
    tokenize_query_and_documents,
)
from aligner_jax.tasks.msmarco import MsMarcoConfig, build_msmarco_examples, msmarco_train_source
from aligner_jax.tasks.retrieval_tasks import (
    BEIR_TRAIN_BM25,
    MSMARCO_TRIPLES,
    SELFSUP_PSEUDO_QUERIES,
    TASK_NAMES,
    register_retrieval_tasks,
)
from aligner_jax.tasks.selfsup import SelfSupConfig, build_selfsup_examples, selfsup_train_source
from aligner_jax.tasks.sources import RetrievalExamples, RetrievalSource, clear_examples_cache
from aligner_jax.tasks.vocab import (
    ConfiguredVocabulary,
    WordPieceVocabulary,
    special_token_ids,
    task_vocabulary,
)

__all__ = [
    "BEIR_TRAIN_BM25",
    "DEFAULT_TASK_FEATURE_LENGTHS",
    "MSMARCO_TRIPLES",
    "SELFSUP_PSEUDO_QUERIES",
    "TASK_NAMES",
    "AlignerFeatureConverter",
    "BeirTrainConfig",
    "ConfiguredVocabulary",
    "MsMarcoConfig",
    "RetrievalExamples",
    "RetrievalSource",
    "SelfSupConfig",
    "WordPieceVocabulary",
    "batches_as_numpy",
    "beir_train_source",
    "build_beir_train_examples",
    "build_msmarco_examples",
    "build_selfsup_examples",
    "clear_examples_cache",
    "frame_tokens",
    "frame_tokens_tf",
    "msmarco_train_source",
    "output_features",
    "register_retrieval_tasks",
    "selfsup_train_source",
    "special_token_ids",
    "task_vocabulary",
    "tokenize_query_and_documents",
]
