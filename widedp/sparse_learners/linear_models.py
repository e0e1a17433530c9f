"""Losses and per-example gradients of wide linear models on CSR rows, never densifying a row.

Privacy assumption: none by itself — these are the non-private building blocks (validation,
losses, per-example gradient scalars, clipping, sparse sums) that the private learners in
`sparse_learners.dp_erm` and `sparse_learners.bias_reduced_sgd` call; their docstrings state the
sensitivity each one guarantees.

A generalized linear model has ℓ(w; x, y) = φ(⟨w, x⟩, y), so ∇ℓ = φ'(⟨w, x⟩, y)·x: every
per-example gradient is a scalar times the (s-sparse) feature row, and clipping it in any norm
is clipping that scalar. Losses:
  logistic  φ(z, y) = log(1 + e^{-yz}),  y ∈ {-1, +1} ({0, 1} is mapped to {-1, +1}),
            φ'(z, y) = -y / (1 + e^{yz}),  |φ'| ≤ 1;
  squared   φ(z, y) = ½(z - y)²,  φ'(z, y) = z - y (unbounded: needs clipping).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import scipy.sparse as sp
from scipy import special

Loss = Literal["logistic", "squared"]
LOSSES: tuple[str, ...] = ("logistic", "squared")


class Dataset(NamedTuple):
    """Validated data: CSR float64 features (n × d) and float64 labels (±1 for logistic)."""

    X: sp.csr_matrix
    y: np.ndarray
    loss: str


def check_loss(loss: str) -> str:
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    return loss


def check_data(X, y, loss: str) -> Dataset:
    """Validate (X, y) for `loss`; raise ValueError naming the parameter or the offending row.

    X must be a scipy.sparse matrix (converted to CSR float64, duplicates summed) with finite
    entries and at least one row; y must be finite with one label per row; logistic labels must
    be in {-1, +1} or {0, 1}.
    """
    loss = check_loss(loss)
    if not sp.issparse(X):
        raise ValueError(f"X must be a scipy.sparse matrix (CSR), got {type(X).__name__}")
    X = sp.csr_matrix(X, dtype=np.float64)
    X.sum_duplicates()
    n = X.shape[0]
    if n < 1 or X.shape[1] < 1:
        raise ValueError(f"X must have at least one row and one column, got shape {X.shape}")
    bad = np.flatnonzero(~np.isfinite(X.data))
    if bad.size:
        row = int(np.searchsorted(X.indptr, bad[0], side="right") - 1)
        raise ValueError(f"X row {row} has a non-finite entry {X.data[bad[0]]}")
    y = np.asarray(y, dtype=np.float64)
    if y.shape != (n,):
        raise ValueError(f"y must have shape ({n},) (one label per row of X), got {y.shape}")
    bad = np.flatnonzero(~np.isfinite(y))
    if bad.size:
        raise ValueError(f"y[{bad[0]}] is not finite: {y[bad[0]]}")
    if loss == "logistic":
        if np.all((y == 0) | (y == 1)):
            y = 2.0 * y - 1.0
        bad = np.flatnonzero(np.abs(y) != 1.0)
        if bad.size:
            raise ValueError(f"logistic labels must be in {{-1, +1}} or {{0, 1}}; y[{bad[0]}] = {y[bad[0]]}")
    return Dataset(X, y, loss)


def check_feature_bound(X: sp.csr_matrix, bound: float, norm: Literal["inf", "2"]) -> None:
    """Raise ValueError naming the first row whose ℓ∞ (or ℓ2) norm exceeds `bound`."""
    norms = row_norms(X, norm)
    bad = np.flatnonzero(norms > bound * (1 + 1e-12))
    if bad.size:
        raise ValueError(f"X row {bad[0]} has ℓ{'∞' if norm == 'inf' else '2'} norm {norms[bad[0]]:.6g} > "
                         f"feature bound {bound}")


def row_norms(X: sp.csr_matrix, norm: Literal["inf", "2"]) -> np.ndarray:
    """Per-row ℓ∞ or ℓ2 norm of a CSR matrix (0 for empty rows), O(nnz)."""
    n = X.shape[0]
    lengths = np.diff(X.indptr)
    out = np.zeros(n)
    nonempty = lengths > 0
    if norm == "inf":
        if X.nnz:
            out[nonempty] = np.maximum.reduceat(np.abs(X.data), X.indptr[:-1][nonempty])
        return out
    if X.nnz:
        out[nonempty] = np.sqrt(np.add.reduceat(X.data**2, X.indptr[:-1][nonempty]))
    return out


def loss_derivative(loss: str, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """φ'(z, y) per example (see module docstring)."""
    if loss == "logistic":
        return -y * special.expit(-y * z)
    return z - y


def per_example_scalars(data: Dataset, rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    """φ'(⟨w, x_i⟩, y_i) for the given rows: ∇ℓ(w; z_i) = scalar_i · x_i."""
    sub = data.X[rows]
    return loss_derivative(data.loss, sub @ w, data.y[rows])


def clip_scalars(scalars: np.ndarray, norms: np.ndarray, bound: float) -> np.ndarray:
    """Scale each scalar_i so that ‖scalar_i · x_i‖ = |scalar_i|·norms_i ≤ bound (per-example clipping)."""
    size = np.abs(scalars) * norms
    factor = np.where(size > bound, bound / np.where(size > 0, size, 1.0), 1.0)
    return scalars * factor


def sparse_weighted_sum(X: sp.csr_matrix, rows: np.ndarray, coeffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ_i coeffs_i · X[rows_i] as (sorted unique touched column ids, values), O(nnz log nnz).

    Never forms a dense d-vector: the result is supported on the union of the rows' supports.
    """
    rows = np.asarray(rows, dtype=np.int64)
    starts, ends = X.indptr[rows], X.indptr[rows + 1]
    lengths = ends - starts
    if lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    # positions of every stored entry of the selected rows, row by row
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    pos = np.arange(lengths.sum()) + offsets
    cols = X.indices[pos]
    vals = X.data[pos] * np.repeat(np.asarray(coeffs, dtype=np.float64), lengths)
    ids, inverse = np.unique(cols, return_inverse=True)
    return ids.astype(np.int64), np.bincount(inverse, weights=vals, minlength=ids.size)


def empirical_loss(data: Dataset, w: np.ndarray, l2: float = 0.0) -> float:
    """L(w) = (1/n) Σ φ(⟨w, x_i⟩, y_i) + (l2/2)‖w‖²."""
    z = data.X @ w
    if data.loss == "logistic":
        per = np.logaddexp(0.0, -data.y * z)
    else:
        per = 0.5 * (z - data.y) ** 2
    return float(per.mean() + 0.5 * l2 * float(w @ w))


def full_gradient(data: Dataset, w: np.ndarray, l2: float = 0.0) -> np.ndarray:
    """∇L(w) (dense d-vector: the model's own size), non-private."""
    s = loss_derivative(data.loss, data.X @ w, data.y)
    return np.asarray(data.X.T @ s).ravel() / data.X.shape[0] + l2 * w


def project_l2(w: np.ndarray, radius: float | None) -> np.ndarray:
    """Euclidean projection onto the ℓ2 ball of `radius` (identity when radius is None)."""
    if radius is None:
        return w
    norm = float(np.linalg.norm(w))
    return w if norm <= radius else w * (radius / norm)
