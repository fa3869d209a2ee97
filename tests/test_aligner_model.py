"""The ALIGNER model class: every objective / training alignment / salience ablation trains."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fixtures import TINY_BERT_NO_DROPOUT, TINY_T5
from flax import linen as nn

from aligner_jax.core import scoring
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models import aligner_model

TINY = TINY_BERT_NO_DROPOUT


def _batch(b=3, g=2, lq=6, ld=10, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(5, 64, size=(b, lq)).astype(np.int32)
    d = rng.integers(5, 64, size=(b, g, ld)).astype(np.int32)
    q[:, -2:] = 0  # padding
    d[:, :, -3:] = 0
    d[0, 1, 4:] = 0  # a short document
    return {"query_tokens": jnp.asarray(q), "doc_tokens": jnp.asarray(d)}


def _model(salience="lp", objective="aligner", alignment="top_k:1", dtype="float32", **loss):
    config = aligner_lib.AlignerConfig(
        backbone=TINY, projection_dim=8, salience=salience, epsilon=0.05, dtype=dtype
    )
    return aligner_model.AlignerModel(
        config, aligner_model.LossConfig(objective=objective, alignment=alignment, **loss)
    )


@pytest.mark.parametrize(
    "salience,objective,alignment,extra",
    [
        ("lp", "aligner", "top_k:1", {}),
        ("lp", "aligner", "top_p:0.2", {}),
        ("lp", "aligner", "differentiable:k=2,epsilon=0.1", {}),
        ("relu", "aligner", "top_k:2", {}),
        ("hard_topk", "aligner", "top_k:1", {}),
        ("l1", "aligner", "top_k:1", {"l1_weight": 0.1}),
        ("none", "aligner", "top_k:1", {"in_batch_negatives": False}),
        ("none", "xtr", "top_k:1", {"k_train": 8}),
    ],
)
def test_loss_and_gradients_are_finite(salience, objective, alignment, extra):
    model = _model(salience, objective, alignment, **extra)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0)))
    batch = _batch()
    loss_fn = jax.jit(lambda p: model.loss_fn(p, batch, jax.random.PRNGKey(1)))
    (loss, metrics), grads = jax.value_and_grad(lambda p: loss_fn(p), has_aux=True)(params)
    assert np.isfinite(loss) and 0.0 <= metrics["accuracy"] <= 1.0
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.all(np.isfinite(g)) for g in leaves)
    assert any(np.any(g != 0) for g in jax.tree_util.tree_leaves(grads["backbone"]))
    if salience not in ("none",):
        assert np.any(grads["doc_salience"]["kernel"] != 0) or salience == "hard_topk"
    if extra.get("l1_weight"):
        assert metrics["total_loss"] == pytest.approx(loss)
        assert metrics["total_loss"] > metrics["loss"]


@pytest.mark.parametrize("objective,salience", [("aligner", "lp"), ("xtr", "none")])
def test_a_few_steps_lower_the_loss(objective, salience):
    model = _model(salience, objective, "top_k:1", k_train=8)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0)))
    batch = _batch()
    tx = optax.adam(1e-2)

    def loss_fn(p):
        return model.loss_fn(p, batch, None)[0]

    @jax.jit
    def step(p, state):
        updates, state = tx.update(jax.grad(loss_fn)(p), state)
        return optax.apply_updates(p, updates), state

    p, state = params, tx.init(params)
    start = loss_fn(p)
    for _ in range(6):
        p, state = step(p, state)
    assert loss_fn(p) < start


def test_training_scores_follow_eq_1_and_2():
    """loss_fn's in-batch scores equal alignment_scores on the encoded vectors."""
    model = _model("lp", alignment="top_k:2")
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(2)))
    batch = _batch(seed=3)
    q, u_q, q_mask = model.encode(params, batch["query_tokens"], aligner_lib.QUERY)
    docs = batch["doc_tokens"].reshape(-1, batch["doc_tokens"].shape[-1])
    d, u_d, d_mask = model.encode(params, docs, aligner_lib.DOC)
    scores = model.batch_scores(q, q_mask, u_q, d, d_mask, u_d)
    for i in range(q.shape[0]):
        for j in range(d.shape[0]):
            s = scoring.similarity_matrix(q[i], d[j])
            ref = scoring.alignment_scores(
                s, q_mask[i], d_mask[j], "top_k:2", u_q=u_q[i], u_d=u_d[j]
            )
            assert scores[i, j] == pytest.approx(float(ref), abs=1e-5)
    # Saliences: zero on padding, LP gate keeps about ceil(alpha * m) tokens.
    assert np.all(np.asarray(u_d)[~np.asarray(d_mask)] == 0)
    mass = np.asarray(jnp.sum(u_d > 0.5, axis=-1))
    assert np.all(mass <= np.ceil(0.4 * np.asarray(d_mask.sum(-1))) + 1)


def test_score_batch_modes_and_bfloat16():
    model = _model("lp", dtype="bfloat16")
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0)))
    batch = _batch(b=2, g=3)
    v, u, m = model.score_batch(params, batch, "encode_queries")
    assert v.shape == (2, 6, 8) and v.dtype == jnp.float32 and u.shape == m.shape == (2, 6)
    norms = np.linalg.norm(np.asarray(v), axis=-1)
    np.testing.assert_allclose(norms[np.asarray(m)], 1.0, atol=1e-3)
    assert np.all(norms[~np.asarray(m)] == 0)
    v, _, _ = model.score_batch(params, batch, "encode_documents")
    assert v.shape == (6, 10, 8)
    sims = model.score_batch(params, batch, "similarity")
    assert sims.shape == (2, 3) and np.all(np.abs(np.asarray(sims)) <= 1.0 + 1e-5)
    loss, _ = model.loss_fn(params, batch, None)
    assert np.isfinite(loss)
    with pytest.raises(ValueError, match="score_batch mode='rank'"):
        model.score_batch(params, batch, "rank")


def test_config_errors_name_the_binding():
    with pytest.raises(ValueError, match="AlignerConfig.projection='linear'"):
        aligner_lib.AlignerConfig(backbone=TINY, projection="linear")
    with pytest.raises(ValueError, match="AlignerConfig.alpha_d=1.5"):
        aligner_lib.AlignerConfig(backbone=TINY, alpha_d=1.5)
    with pytest.raises(ValueError, match="LossConfig.objective='triplet'"):
        aligner_model.LossConfig(objective="triplet")
    with pytest.raises(ValueError, match="top_k:zero"):
        aligner_model.LossConfig(alignment="top_k:zero")
    with pytest.raises(TypeError, match="BertConfig or T5Config"):
        aligner_lib.build_backbone(dataclasses.replace)


@pytest.mark.parametrize(
    "backbone,projection,salience,heads",
    [
        ("bert", "dense", "lp", {"projection", "query_salience", "doc_salience"}),
        ("t5", "dense", "lp", {"projection", "query_salience", "doc_salience"}),
        ("bert", "identity", "none", set()),
    ],
)
def test_head_initialisation_without_the_backbone_equals_the_full_one(
    backbone, projection, salience, heads
):
    """``init_head_params`` (what ``load_encoder`` uses when pretrained backbone weights replace
    the backbone) gives exactly the heads of a full initialisation: same keys, shapes, values."""
    config = aligner_lib.AlignerConfig(
        backbone=TINY if backbone == "bert" else TINY_T5,
        projection=projection,
        projection_dim=8,
        salience=salience,
    )
    full = aligner_lib.init_params(config, seed=3)
    got = aligner_lib.init_head_params(config, seed=3)
    assert set(got) == set(full) - {"backbone"} == heads
    for name, tree in got.items():
        assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(full[name])
        leaves = zip(
            jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(full[name]), strict=True
        )
        for a, b in leaves:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_false_negative_mask_names_relevant_documents_other_than_the_positive():
    # Row 0's query judges keys 11 and 21 relevant (21 is row 1's positive); row 1's positive
    # is row 2's too (key 21); row 2's negative 12 is row 0's negative as well (not relevant).
    doc_keys = jnp.asarray([[11, 12], [21, 22], [21, 12]], jnp.int32)
    relevant = jnp.asarray([[11, 21, 0], [21, 0, 0], [21, 0, 0]], jnp.int32)
    mask = np.asarray(aligner_model.false_negative_mask(doc_keys, relevant))
    expected = np.zeros((3, 6), bool)
    expected[0, [2, 4]] = True  # rows 1 and 2's positive (key 21) is relevant to row 0's query
    expected[1, 4] = True  # row 2's positive is row 1's positive
    expected[2, 2] = True  # and the other way round
    np.testing.assert_array_equal(mask, expected)


def test_relevant_in_batch_documents_are_not_negatives():
    """A document relevant to a row's query is left out of that row's softmax: the row's loss is
    the cross-entropy over the other columns only, and the batch counts it."""
    model = _model("lp", mask_false_negatives=True)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(2)))
    batch = _batch(seed=3)
    batch["doc_keys"] = jnp.asarray([[11, 12], [21, 22], [31, 32]], jnp.int32)
    batch["relevant_keys"] = jnp.asarray([[11, 21], [21, 0], [31, 0]], jnp.int32)
    loss, metrics = model.loss_fn(params, batch, None)
    q, u_q, q_mask = model.encode(params, batch["query_tokens"], aligner_lib.QUERY)
    docs = batch["doc_tokens"].reshape(6, -1)
    d, u_d, d_mask = model.encode(params, docs, aligner_lib.DOC)
    logits = np.asarray(model.batch_scores(q, q_mask, u_q, d, d_mask, u_d)) / 0.02
    rows = [np.delete(logits[0], 2), logits[1], logits[2]]  # row 0 without row 1's positive
    labels = [0, 2, 4]
    expected = np.mean(
        [
            np.log(np.sum(np.exp(r - r.max()))) + r.max() - r[y]
            for r, y in zip(rows, labels, strict=True)
        ]
    )
    assert float(loss) == pytest.approx(expected, rel=1e-4)
    assert float(metrics["false_negatives"]) == pytest.approx(1 / 3)
    unmasked, plain = model.loss_fn(params, _batch(seed=3), None)
    assert float(plain["false_negatives"]) == 0.0 and float(unmasked) != pytest.approx(expected)


def test_mask_false_negatives_off_keeps_them_as_negatives_and_counts_them():
    """The default, ``mask_false_negatives=False``: the loss is the plain cross-entropy
    (what a batch without keys gives) while the metric still counts the relevant columns."""
    masked_model = _model("lp", mask_false_negatives=True)
    ablation = _model("lp")  # the default: relevant in-batch documents stay negatives
    params = nn.meta.unbox(masked_model.init(jax.random.PRNGKey(2)))
    batch = _batch(seed=3)
    batch["doc_keys"] = jnp.asarray([[11, 12], [21, 22], [31, 32]], jnp.int32)
    batch["relevant_keys"] = jnp.asarray([[11, 21], [21, 0], [31, 0]], jnp.int32)
    loss, metrics = ablation.loss_fn(params, batch, None)
    plain, _ = ablation.loss_fn(params, _batch(seed=3), None)
    masked, _ = masked_model.loss_fn(params, batch, None)
    assert float(loss) == pytest.approx(float(plain), rel=1e-6)
    assert float(loss) > float(masked) + 1e-5  # the masked column adds to the normaliser
    assert float(metrics["false_negatives"]) == pytest.approx(1 / 3)
