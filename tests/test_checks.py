"""Every configuration field is range- and type-checked at construction, naming its flag."""

from __future__ import annotations

import pytest

from aligner_jax.common import checks, errors
from aligner_jax.encoding.encoder import EncodingConfig
from aligner_jax.evaluation.adaptation import AdaptationConfig
from aligner_jax.indexing.ann import ScannConfig
from aligner_jax.indexing.indexer import IndexingConfig
from aligner_jax.models.aligner import AlignerConfig
from aligner_jax.models.aligner_model import LossConfig
from aligner_jax.retrieval.refine import RefineConfig
from aligner_jax.retrieval.searcher import SearchConfig
from aligner_jax.training.checkpointing import CheckpointConfig
from aligner_jax.training.input_pipeline import DataConfig

CASES = [
    (SearchConfig, "top_k", 0, "must be >= 1"),
    (SearchConfig, "query_batch_size", 0, "must be >= 1"),
    (SearchConfig, "k_prime", "abc", "expected an integer"),
    (SearchConfig, "k_prime", -1, "must be >= 0"),
    (SearchConfig, "beta_q", 0.0, "must be in (0.0, 1.0]"),
    (SearchConfig, "beta_d", 1.5, "must be in (0.0, 1.0]"),
    (SearchConfig, "backend", "faiss", "choose one of"),
    (EncodingConfig, "max_tokens_per_batch", 0, "must be >= 1"),
    (EncodingConfig, "bucket_multiple", 0, "must be >= 1"),
    (EncodingConfig, "concurrent_batches", 0, "must be >= 1"),
    (IndexingConfig, "shard_size", 0, "must be >= 1"),
    (IndexingConfig, "shard_size", 2.5, "expected an integer"),
    (IndexingConfig, "store_beta_d", 0.0, "must be in (0.0, 1.0]"),
    (RefineConfig, "max_elements", 0, "must be >= 1"),
    (RefineConfig, "length_multiple", 0, "must be >= 1"),
    (RefineConfig, "query_length_buckets", (32, 16), "strictly increasing"),
    (RefineConfig, "query_length_buckets", (), "non-empty"),
    (RefineConfig, "cache_bytes", -1, "must be >= 0"),
    (RefineConfig, "concurrent_chunks", 0, "must be >= 1"),
    (ScannConfig, "num_leaves", 0, "must be >= 1"),
    (ScannConfig, "leaves_to_search_fraction", 0.0, "must be in (0.0, 1.0]"),
    (ScannConfig, "num_leaves_to_search", 0, "must be >= 1"),
    (ScannConfig, "reorder_factor", 0.5, "must be >= 1.0"),
    (ScannConfig, "reorder_dtype", "int4", "choose one of"),
    (ScannConfig, "training_sample_size", 0, "must be >= 1"),
    (ScannConfig, "max_tokens_per_part", 0, "must be >= 1"),
    (ScannConfig, "anisotropic_quantization_threshold", float("nan"), "finite number"),
    (AdaptationConfig, "fold_size", 0, "must be >= 1"),
    (AdaptationConfig, "metric", "ndcg@5", "choose one of"),
    (AlignerConfig, "query_maxlen", 0, "must be >= 1"),
    (AlignerConfig, "epsilon", 0.0, "must be > 0.0"),
    (AlignerConfig, "lp_init", "random", "choose one of"),
    (LossConfig, "k_train", 0, "must be >= 1"),
    (LossConfig, "l1_weight", -0.1, "must be >= 0.0"),
    (CheckpointConfig, "period", 0, "must be >= 1"),
    (CheckpointConfig, "keep", 0, "must be >= 1"),
    (DataConfig, "batch_size", 0, "must be >= 1"),
]


@pytest.mark.parametrize(("cls", "field", "value", "fragment"), CASES)
def test_bad_field_is_refused_naming_the_flag(cls, field, value, fragment):
    with pytest.raises(errors.ConfigError) as info:
        cls(**{field: value})
    message = str(info.value)
    assert message.startswith(f"--gin.{cls.__name__}.{field}={value!r}: "), message
    assert fragment in message


@pytest.mark.parametrize(
    "cls",
    [
        SearchConfig,
        EncodingConfig,
        IndexingConfig,
        RefineConfig,
        ScannConfig,
        AdaptationConfig,
        AlignerConfig,
        LossConfig,
        CheckpointConfig,
        DataConfig,
    ],
)
def test_defaults_are_valid(cls):
    cls()


def test_messages():
    with pytest.raises(errors.ConfigError, match=r"^--gin\.X\.y=True: expected an integer$"):
        checks.integer("X.y", True, 0)
    with pytest.raises(errors.ConfigError, match=r"^--gin\.X\.y=2: must be <= 1$"):
        checks.number("X.y", 2, high=1)
    checks.integer("X.y", None, 1, allow_none=True)


def test_bound_value_and_is_bound():
    import gin  # noqa: PLC0415

    gin.clear_config()
    try:
        assert checks.bound_value("SearchConfig.top_k") is None
        assert checks.bound_value("SearchConfig.top_k", 7) == 7
        assert not checks.is_bound("SearchConfig.top_k")
        assert checks.bound_value("NoSuchConfigurable.field", 3) == 3  # unknown: the default
        gin.bind_parameter("SearchConfig.top_k", None)  # bound, to None
        assert checks.is_bound("SearchConfig.top_k")
        gin.bind_parameter("SearchConfig.top_k", 5)
        assert checks.bound_value("SearchConfig.top_k", 7) == 5
    finally:
        gin.clear_config()
