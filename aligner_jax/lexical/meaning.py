"""miniCOIL's meaning models: per word, one linear layer + tanh over the word's contextual vector.

For a word w and one occurrence of it with contextual vector x (the encoder's token vectors of the
occurrence, averaged over its word-pieces), the article's meaning vector is

    m_w(x) = tanh(W_w · x + b_w) ∈ (-1, 1)^dim        (dim = 4 by default; 8 and 16 selectable)

and two occurrences of the same word are compared by cosine similarity (``Meaning^{q_i × d_j}``
of the article's score). The models are trained self-supervised with the article's triplet loss

    L = mean over triplets (a, p, n) of ReLU(d(a, p) − d(a, n) + margin_apn),   d = 1 − cos,

whose triplets and per-triplet margins come from a teacher's sentence similarities
(``lexical.triplets``). Every word's parameters are stacked (``weight [V, D, dim]``,
``bias [V, dim]``) and one jitted optax step trains all words at once: the per-word loss is
``jax.vmap``-ed over words and summed, so each word's gradient is its own (the words never
interact) and there is no Python loop per word.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from aligner_jax.common import fileio
from aligner_jax.common.errors import CheckpointError, MissingPathError

FORMAT = "aligner_jax.minicoil.meaning/1"
FILE = "meaning.safetensors"  # the models' file in a saved MiniCoilIndex folder
_EPS = 1e-8


def init_params(key: jax.Array, num_words: int, input_dim: int, dim: int) -> dict:
    """``weight [V, D, dim]`` ~ N(0, 1/D) (unit-variance pre-activations for unit inputs), zero bias."""
    weight = jax.random.normal(key, (num_words, input_dim, dim), jnp.float32) / np.sqrt(input_dim)
    return {"weight": weight, "bias": jnp.zeros((num_words, dim), jnp.float32)}


def meaning_vectors(weight: jax.Array, bias: jax.Array, x: jax.Array) -> jax.Array:
    """One word's meaning vectors ``tanh(x · W + b)`` for occurrences ``x [n, D]`` → ``[n, dim]``."""
    return jnp.tanh(x @ weight + bias)


def unit(v: jax.Array) -> jax.Array:
    """``v / |v|`` along the last axis (zero stays zero): cosine similarity is then a dot product."""
    # rsqrt of a clamped squared norm: finite gradients at v = 0 too (rows without data)
    return v * jax.lax.rsqrt(jnp.maximum(jnp.sum(v * v, axis=-1, keepdims=True), _EPS**2))


def word_triplet_terms(
    params_w: dict,
    examples: jax.Array,
    triplets: jax.Array,
    margins: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One word's triplet loss terms (summed) and its correctly ordered triplets (counted).

    Args:
      params_w: ``weight [D, dim]``, ``bias [dim]`` of the word.
      examples: ``[S, D]`` contextual vectors of the word's occurrences (rows without data are
        never referenced by a valid triplet).
      triplets: ``[T, 3]`` int rows (anchor, positive, negative) into ``examples``.
      margins: ``[T]`` the teacher's margin of each triplet.
      mask: ``[T]`` bool, real triplets (padding is False).

    Returns ``(Σ mask · ReLU(d(a,p) − d(a,n) + margin), Σ mask · [d(a,p) < d(a,n)])``.
    """
    m = unit(meaning_vectors(params_w["weight"], params_w["bias"], examples))
    a, p, n = m[triplets[:, 0]], m[triplets[:, 1]], m[triplets[:, 2]]
    d_pos = 1.0 - jnp.sum(a * p, axis=-1)
    d_neg = 1.0 - jnp.sum(a * n, axis=-1)
    w = mask.astype(jnp.float32)
    loss = jnp.sum(w * jax.nn.relu(d_pos - d_neg + margins))
    correct = jnp.sum(w * (d_pos < d_neg))
    return loss, correct


def triplet_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Mean triplet loss over every word's triplets, and the fraction correctly ordered.

    ``batch``: ``examples [V, S, D]``, ``triplets [V, T, 3]``, ``margins [V, T]``,
    ``mask [V, T]``; ``params``: ``weight [V, D, dim]``, ``bias [V, dim]``.
    """
    loss, correct = jax.vmap(word_triplet_terms)(
        params, batch["examples"], batch["triplets"], batch["margins"], batch["mask"]
    )
    count = jnp.maximum(jnp.sum(batch["mask"]), 1)
    return jnp.sum(loss) / count, jnp.sum(correct) / count


def make_train_step(optimizer: optax.GradientTransformation):
    """The jitted step ``(params, opt_state, batch) → (params, opt_state, loss, accuracy)``
    training all words at once."""

    @jax.jit
    def step(params, opt_state, batch):
        (loss, accuracy), grads = jax.value_and_grad(triplet_loss, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accuracy

    return step


def input_space_accuracy(batch: dict) -> float:
    """Fraction of triplets the raw contextual vectors already order like the teacher (cosine in
    the encoder's space): the article's "the input transformer approximates the teacher" figure."""
    x = unit(jnp.asarray(batch["examples"]))
    t = jnp.asarray(batch["triplets"])
    rows = jnp.arange(x.shape[0])[:, None]
    a, p, n = x[rows, t[..., 0]], x[rows, t[..., 1]], x[rows, t[..., 2]]
    ok = jnp.sum(a * p, -1) > jnp.sum(a * n, -1)
    mask = jnp.asarray(batch["mask"])
    return float(jnp.sum(ok & mask) / jnp.maximum(jnp.sum(mask), 1))


def fit(
    batch: dict,
    dim: int,
    steps: int,
    learning_rate: float,
    seed: int,
    validation: dict | None = None,
    log_every_s: float = 20.0,
    weight_decay: float = 0.0,
) -> tuple[dict, dict]:
    """Trains every word's model on its triplets with Adam (decoupled ``weight_decay``), full
    batch, ``steps`` steps.

    Returns ``(params as numpy, report)``; the report has the final train loss/accuracy, the
    validation triplet accuracy (and loss) when ``validation`` is given, seconds, steps/s and
    words/s (words × steps / s).
    """
    num_words, _, input_dim = batch["examples"].shape
    params = init_params(jax.random.PRNGKey(seed), num_words, input_dim, dim)
    optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
    opt_state = optimizer.init(params)
    step = make_train_step(optimizer)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    start = last = time.perf_counter()
    loss = accuracy = jnp.nan
    for i in range(steps):
        params, opt_state, loss, accuracy = step(params, opt_state, batch)
        now = time.perf_counter()
        if now - last >= log_every_s:
            last = now
            rate = (i + 1) / (now - start)
            logging.info(
                "miniCOIL meaning models: step %d/%d, loss %.4f, train triplet accuracy %.3f, "
                "%.1f steps/s (%.0f words/s), ETA %.0f s",
                i + 1,
                steps,
                float(loss),
                float(accuracy),
                rate,
                rate * num_words,
                (steps - i - 1) / rate,
            )
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    report = {
        "words": int(num_words),
        "steps": int(steps),
        "train_loss": float(loss),
        "train_triplet_accuracy": float(accuracy),
        "train_triplets": int(np.asarray(batch["mask"]).sum()),
        "seconds": seconds,
        "steps_per_s": steps / seconds if seconds > 0 else None,
        "words_per_s": num_words * steps / seconds if seconds > 0 else None,
    }
    if validation is not None:
        val = {k: jnp.asarray(v) for k, v in validation.items()}
        val_loss, val_accuracy = jax.jit(triplet_loss)(params, val)
        report.update(
            validation_loss=float(val_loss),
            validation_triplet_accuracy=float(val_accuracy),
            validation_triplets=int(np.asarray(validation["mask"]).sum()),
            validation_input_space_accuracy=input_space_accuracy(validation),
        )
    return jax.tree_util.tree_map(np.asarray, params), report


def fit_reduction(x: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A shared linear input reduction ``(center [D], basis [D, r])``: the top ``rank`` principal
    directions of the occurrence vectors ``x [n, D]``.

    With few sentences per word a full ``D × dim`` layer per word memorises its triplets; on the
    reduced inputs each word's layer is ``W_w · basisᵀ (x − center)``, still one linear layer +
    tanh over ``x`` (of rank ≤ r), with r × dim parameters to fit instead of D × dim.
    """
    center = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - center, full_matrices=False)
    return center.astype(np.float32), np.ascontiguousarray(vt[:rank].T, np.float32)


def reduce_inputs(x: np.ndarray, center: np.ndarray, basis: np.ndarray) -> np.ndarray:
    return ((np.asarray(x, np.float32) - center) @ basis).astype(np.float32)


def apply(
    weight: np.ndarray,
    bias: np.ndarray,
    word_index: np.ndarray,
    x: np.ndarray,
    chunk: int = 4096,
    reduction: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Unit meaning vectors ``[n, dim]`` of occurrences ``x [n, D]`` of words ``word_index [n]``
    (rows of the stacked models), in chunks (the gathered weights are ``chunk × D × dim``)."""
    if reduction is not None:
        x = reduce_inputs(x, *reduction)
    out = np.zeros((len(word_index), weight.shape[-1]), np.float32)
    chunk = min(chunk, 1 << max(len(word_index) - 1, 0).bit_length())  # few shapes, small queries
    w, b = jnp.asarray(weight), jnp.asarray(bias)
    fn = _apply_chunk
    for start in range(0, len(word_index), chunk):
        idx = np.asarray(word_index[start : start + chunk])
        v = np.asarray(x[start : start + chunk], np.float32)
        pad = chunk - len(idx)  # one compiled shape
        idx_p = np.concatenate([idx, np.zeros(pad, idx.dtype)])
        v_p = np.concatenate([v, np.zeros((pad, v.shape[1]), np.float32)])
        out[start : start + len(idx)] = np.asarray(fn(w, b, idx_p, v_p))[: len(idx)]
    return out


@jax.jit
def _apply_chunk(weight, bias, idx, x):
    return unit(jnp.tanh(jnp.einsum("nd,ndk->nk", x, weight[idx]) + bias[idx]))


@dataclasses.dataclass
class MeaningModels:
    """The stacked per-word models and what they were trained for (saved as one safetensors)."""

    words: list[str]  # stems, row order of weight/bias
    weight: np.ndarray  # [V, D, dim] float32
    bias: np.ndarray  # [V, dim] float32
    encoder_fingerprint: str
    report: dict = dataclasses.field(default_factory=dict)
    center: np.ndarray | None = None  # [D] shared input reduction (fit_reduction), or None
    basis: np.ndarray | None = None  # [D, r]

    @property
    def dim(self) -> int:
        return int(self.weight.shape[-1])

    @property
    def input_dim(self) -> int:
        """Size of the encoder vectors the models take (before any reduction)."""
        return int(self.basis.shape[0] if self.basis is not None else self.weight.shape[1])

    @property
    def reduction(self) -> tuple[np.ndarray, np.ndarray] | None:
        return None if self.basis is None else (self.center, self.basis)

    def apply(self, word_index: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Unit meaning vectors of occurrences ``x [n, D]`` of model rows ``word_index [n]``."""
        return apply(self.weight, self.bias, word_index, x, reduction=self.reduction)

    def index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}

    def to_bytes(self) -> bytes:
        metadata = {
            "format": FORMAT,
            "words": json.dumps(self.words),
            "encoder_fingerprint": self.encoder_fingerprint,
            "report": json.dumps(self.report),
        }
        tensors = {"weight": np.ascontiguousarray(self.weight, np.float32)}
        tensors["bias"] = np.ascontiguousarray(self.bias, np.float32)
        if self.basis is not None:
            tensors["center"] = np.ascontiguousarray(self.center, np.float32)
            tensors["basis"] = np.ascontiguousarray(self.basis, np.float32)
        return st_save(tensors, metadata=metadata)

    def save(self, path: str | Path) -> Path:
        """Writes ``path`` (a ``.safetensors`` file) atomically."""
        return fileio.atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> MeaningModels:
        try:
            tensors = st_load(data)
            metadata = _safetensors_metadata(data)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{where}: not a miniCOIL meaning model file ({e})") from e
        names = set(tensors)
        if metadata.get("format") != FORMAT or names not in (
            {"weight", "bias"},
            {"weight", "bias", "center", "basis"},
        ):
            raise CheckpointError(
                f"{where}: not a miniCOIL meaning model file (format "
                f"{metadata.get('format')!r}, expected {FORMAT!r})"
            )
        words = json.loads(metadata["words"])
        if tensors["weight"].shape[0] != len(words) or tensors["bias"].shape[0] != len(words):
            raise CheckpointError(f"{where}: {len(words)} words but tensors of another size")
        return cls(
            words=words,
            weight=tensors["weight"],
            bias=tensors["bias"],
            encoder_fingerprint=metadata.get("encoder_fingerprint", ""),
            report=json.loads(metadata.get("report", "{}")),
            center=tensors.get("center"),
            basis=tensors.get("basis"),
        )

    @classmethod
    def load(cls, path: str | Path, where: str | None = None) -> MeaningModels:
        """The models of ``path``: a ``.safetensors`` file, or a folder holding ``FILE`` (a
        saved ``MiniCoilIndex``); ``where`` names the flag or binding in an error."""
        path = models_file(path, where)
        return cls.from_bytes(path.read_bytes(), str(path))


def models_file(path: str | Path, where: str | None = None) -> Path:
    """The meaning-model file of ``path`` (a file, or a folder holding ``FILE``), or a
    ``MissingPathError`` naming ``where`` (the flag or binding that gave it)."""
    given = Path(path)
    found = given / FILE if given.is_dir() else given
    if not found.is_file():
        raise MissingPathError(
            f"{where + '=' if where else ''}{path}: no miniCOIL meaning models there (a "
            f".safetensors file, or a folder with {FILE}: a saved miniCOIL index)"
        )
    return found


def _safetensors_metadata(data: bytes) -> dict:
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + header_len]).get("__metadata__", {}) or {}
