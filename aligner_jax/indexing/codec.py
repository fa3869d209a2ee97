"""Residual compression of token vectors: centroid id + b-bit residual (PLAID §4.1).

A token v is stored as the id of its centroid c and its residual r = v − c quantised per
dimension on a uniform grid of 2^b levels between per-dimension bounds fitted on a sample
(tail quantiles, ``TAILS``): r̂_d = lo_d + (idx_d + ½)·step_d. The grid is uniform (PLAID's
buckets are quantiles) so that a dot product with a compressed token is linear in the stored
levels and needs no decompression:

  q·v̂ = q·c + Σ_d q_d·lo_d + ½ Σ_d q_d·step_d + Σ_d (q_d·step_d)·idx_d

— one gather from the query–centroid scores, a per-query constant, and one BLAS product with the
levels. Levels are packed 8/b to a byte in *planes*: plane p holds dimensions
[p·D′/P, (p+1)·D′/P) (D′ = D padded to a multiple of P = 8/b), so unpacking is a shift and a mask
per plane, with no interleaving. Pure NumPy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from aligner_jax.common import scratch

BITS = (2, 4, 8)
TAILS = {2: 0.01, 4: 0.002, 8: 0.0}
# tokens per step of residual_scores: its temporaries stay small, reused and in cache (16,384
# took 1.6× as long: SciFact zero-shot, 100 documents refined, one thread)
CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class ResidualCodec:
    """Per-dimension uniform quantiser of residuals: ``lower`` and ``step`` are ``[D]`` float32."""

    bits: int
    lower: np.ndarray
    step: np.ndarray

    @property
    def dim(self) -> int:
        return len(self.lower)

    @property
    def planes(self) -> int:
        return 8 // self.bits

    @property
    def padded_dim(self) -> int:
        return -(-self.dim // self.planes) * self.planes

    @property
    def bytes_per_token(self) -> int:
        return packed_bytes(self.dim, self.bits)

    @classmethod
    def fit(cls, residuals: np.ndarray, bits: int, tail: float | None = None) -> ResidualCodec:
        """Fits the grid bounds to the ``tail`` / ``1 − tail`` quantiles of each dimension
        (default: ``TAILS[bits]``; coarser grids clip more of the tails to resolve the bulk)."""
        tail = TAILS.get(bits, 0.0) if tail is None else tail
        if bits not in BITS:
            raise ValueError(f"residual bits={bits}: choose one of {BITS}")
        residuals = np.asarray(residuals, np.float32)
        lower = np.empty(residuals.shape[1], np.float32)
        upper = np.empty(residuals.shape[1], np.float32)
        for j in range(0, residuals.shape[1], 16):  # a 16-column copy at a time, not the whole
            lower[j : j + 16], upper[j : j + 16] = np.quantile(
                residuals[:, j : j + 16], [tail, 1.0 - tail], axis=0
            )
        step = np.maximum(upper - lower, 1e-6) / (1 << bits)
        return cls(bits, lower, step.astype(np.float32))

    def _pad(self, x: np.ndarray) -> np.ndarray:
        extra = self.padded_dim - self.dim
        return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x

    def encode(self, residuals: np.ndarray) -> np.ndarray:
        """``[N, D]`` residuals → ``[N, bytes_per_token]`` uint8 packed levels."""
        levels = np.floor((np.asarray(residuals, np.float32) - self.lower) / self.step)
        levels = self._pad(np.clip(levels, 0, (1 << self.bits) - 1).astype(np.uint8))
        width = self.bytes_per_token
        packed = np.zeros((len(levels), width), np.uint8)
        for p in range(self.planes):
            packed |= levels[:, p * width : (p + 1) * width] << np.uint8(self.bits * p)
        return packed

    def levels(self, packed: np.ndarray) -> list[np.ndarray]:
        """The planes of levels of ``packed [N, W]``: P arrays ``[N, W]`` uint8."""
        mask = np.uint8((1 << self.bits) - 1)
        if self.planes == 1:
            return [packed]
        return [(packed >> np.uint8(self.bits * p)) & mask for p in range(self.planes)]

    def decode(self, packed: np.ndarray) -> np.ndarray:
        """``[N, W]`` packed → ``[N, D]`` float32 residuals (grid cell centres)."""
        levels = np.concatenate(self.levels(packed), axis=1)[:, : self.dim].astype(np.float32)
        return self.lower + (levels + 0.5) * self.step

    def query_terms(self, queries: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """Per-query factors of q·r̂: the plane weights ``q⊙step`` split as the planes
        (P arrays ``[n, W]``) and the constant ``q·(lower + ½·step)`` ``[n]``."""
        q = np.asarray(queries, np.float32)
        weights = self._pad(q * self.step)
        width = self.bytes_per_token
        planes = [
            np.ascontiguousarray(weights[:, p * width : (p + 1) * width])
            for p in range(self.planes)
        ]
        return planes, q @ (self.lower + 0.5 * self.step)

    def integer_query_terms(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``query_terms`` with the plane weights rounded to int16: (weights ``[n, P, W]``
        int16, scale ``[n]`` float32, constant ``[n]``), so that q·r̂ = constant + scale ·
        Σ_p Σ_b weights_{p,b}·level_{p,b} is an integer sum of small integers — what the CPU
        vectorises (``vpmaddwd``), where the float sum over unpacked levels stays scalar.
        scale_i = max |q_i⊙step| / Q with Q = 32,767, or less where a token's int32 sum (every
        level at 2^b − 1) could overflow; each weight is within ½·scale_i of its value, so a
        score moves by at most ½·scale_i·Σ levels: about 1e-6 for unit queries at 4 bits, far
        below the quantisation's own error."""
        planes, constant = self.query_terms(queries)
        n = len(constant)
        weights = np.stack(planes, axis=1) if n else np.zeros((0, self.planes, 1), np.float32)
        limit = min(32767, (2**31 - 1) // (((1 << self.bits) - 1) * self.padded_dim))
        top = np.abs(weights).reshape(n, -1).max(axis=1) if weights.size else np.zeros(n)
        scale = np.where(top > 0, top / limit, 1.0).astype(np.float32)
        rounded = np.rint(weights / scale[:, None, None]).astype(np.int16)
        return rounded, scale, constant

    def residual_scores(
        self,
        queries: np.ndarray,
        packed: np.ndarray,
        token_major: bool = False,
        add_to: np.ndarray | None = None,
    ) -> np.ndarray:
        """q·r̂ for every packed token and query, without decoding (one BLAS product per plane,
        ``[N, W] @ [W, n]``): ``[N, n]`` float32 with ``token_major`` (a token's scores are one
        contiguous row), else its transpose ``[n, N]``. ``add_to`` (token-major ``[N, n]``
        float32): the scores are added to it in place and it is returned.

        The product runs over ``CHUNK`` tokens at a time through per-thread scratch buffers
        (``common.scratch``), so a query allocates no temporary the size of its tokens."""
        planes, constant = self.query_terms(queries)
        n = len(constant)
        if add_to is None:
            out = np.empty((len(packed), n), np.float32)
            out[:] = constant[None, :]
        else:
            out = add_to
            out += constant[None, :]
        width, mask = self.bytes_per_token, np.uint8((1 << self.bits) - 1)
        for start in range(0, len(packed), CHUNK):
            block = np.asarray(packed[start : start + CHUNK])
            m = len(block)
            levels = scratch.buffer("codec.levels", (m, width), np.uint8)
            as_float = scratch.buffer("codec.float", (m, width), np.float32)
            product = scratch.buffer("codec.product", (m, n), np.float32)
            for p, w in enumerate(planes):
                if self.planes == 1:
                    np.copyto(as_float, block)
                else:
                    np.right_shift(block, np.uint8(self.bits * p), out=levels)
                    np.bitwise_and(levels, mask, out=levels)
                    np.copyto(as_float, levels)
                np.matmul(as_float, w.T, out=product)
                out[start : start + m] += product
        return out if token_major else out.T


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes of one packed residual: ``dim`` levels of ``bits`` bits, 8 // bits to a byte."""
    planes = 8 // bits
    return -(-dim // planes)
