"""The registered seqio tasks of ALIGNER training (imported by ``import tasks``).

* ``msmarco_triples``: MS MARCO training triples, text or id form (``msmarco_train_source``);
* ``beir_train_bm25``: a BEIR qrels split with BM25 hard negatives (``beir_train_source``);
* ``selfsup_pseudo_queries``: any corpus, title → text or inverse cloze
  (``selfsup_train_source``).

The gin-configurable function in brackets locates each task's data.

Each task's source gives text examples ``query``, ``positive`` and ``negatives`` (``[N]``); its
preprocessor frames them into the output features ``query`` and ``doc`` (positive first; see
``tasks.features``) with the vocabulary chosen by ``task_vocabulary``. Feature lengths are
``{"query": Lq, "doc": Ld}``; convert with ``tasks.AlignerFeatureConverter``::

    import seqio, tasks
    ds = seqio.get_dataset(
        "beir_train_bm25", {"query": 64, "doc": 256}, tasks.AlignerFeatureConverter(),
        dataset_split="train", shuffle=True, seed=0, num_epochs=None)
    for batch in tasks.batches_as_numpy(ds, 32):
        ...  # batch["query_tokens"] [32, 64], batch["doc_tokens"] [32, 1+N, 256]

A task's example table is built when its dataset is first asked for (after gin parsing) and
cached in memory for the process; the order of examples is fixed by the ``seed`` passed to
``get_dataset`` (``tasks.sources``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import gin
import seqio

from aligner_jax.common.errors import ConfigError
from aligner_jax.tasks import beir_train, features, msmarco, selfsup, sources

MSMARCO_TRIPLES = "msmarco_triples"
BEIR_TRAIN_BM25 = "beir_train_bm25"
SELFSUP_PSEUDO_QUERIES = "selfsup_pseudo_queries"
TASK_NAMES = (MSMARCO_TRIPLES, BEIR_TRAIN_BM25, SELFSUP_PSEUDO_QUERIES)

_SOURCES: dict[str, tuple[Callable[[], Hashable], Callable, Callable, tuple[str, ...]]] = {
    MSMARCO_TRIPLES: (
        lambda: msmarco.msmarco_train_source(),
        msmarco.build_msmarco_examples,
        msmarco.fingerprint,
        ("train",),
    ),
    BEIR_TRAIN_BM25: (
        lambda: beir_train.beir_train_source(),
        beir_train.build_beir_train_examples,
        beir_train.fingerprint,
        ("train", "dev", "test"),
    ),
    SELFSUP_PSEUDO_QUERIES: (
        lambda: selfsup.selfsup_train_source(),
        selfsup.build_selfsup_examples,
        selfsup.fingerprint,
        ("train",),
    ),
}


def register_retrieval_tasks(
    vocabulary: seqio.Vocabulary | None = None, suffix: str = ""
) -> list[str]:
    """Registers the three tasks (names + ``suffix``) in ``seqio.TaskRegistry``; returns names.

    ``vocabulary`` defaults to the gin-chosen ``ConfiguredVocabulary``; pass a concrete one (and
    a suffix) to register variants side by side, e.g. a T5 SentencePiece vocabulary with
    ``suffix="_t5"``. Registering a name again replaces the earlier task.
    """
    names = []
    for base_name, (config_fn, build_fn, fingerprint_fn, splits) in _SOURCES.items():
        name = base_name + suffix
        source = sources.RetrievalSource(name, config_fn, build_fn, fingerprint_fn, splits)
        seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name,
            source=source,
            output_features=features.output_features(vocabulary),
            preprocessors=[features.tokenize_query_and_documents],
            metric_fns=[],
        )
        names.append(name)
    return names


register_retrieval_tasks()


BEIR_TRAIN_AND_SELFSUP = "beir_train_and_selfsup"


@gin.configurable
def supervised_rate(supervised_fraction: float = 0.5) -> float:
    """Share of ``beir_train_and_selfsup`` examples drawn from the labelled split."""
    if not 0.0 < supervised_fraction < 1.0:
        raise ConfigError(
            f"supervised_rate.supervised_fraction={supervised_fraction}: must be in (0, 1)"
        )
    return supervised_fraction


def register_mixtures() -> list[str]:
    """``beir_train_and_selfsup``: a BEIR training split with BM25 negatives mixed with
    self-supervised pseudo-queries from a corpus (domain adaptation with and without labels).
    The rates are read from gin when the mixture is used (``supervised_rate``)."""
    seqio.MixtureRegistry.remove(BEIR_TRAIN_AND_SELFSUP)
    seqio.MixtureRegistry.add(
        BEIR_TRAIN_AND_SELFSUP,
        [
            (BEIR_TRAIN_BM25, lambda task: supervised_rate()),
            (SELFSUP_PSEUDO_QUERIES, lambda task: 1.0 - supervised_rate()),
        ],
    )
    return [BEIR_TRAIN_AND_SELFSUP]


register_mixtures()
