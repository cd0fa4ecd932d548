"""Logistic regression on frozen features, as Meta's `dinov3/eval/log_regression.py` on CPU (scikit-learn).

L2-regularised multinomial logistic regression fitted by L-BFGS (float64 features, tol 1e-12, at most 1,000
iterations), for each C of `10 ** linspace(-6, 5, 45)` on train less a held-out part (10% of each class,
seeded, as Meta's `split_train_val_datasets` when no val set is given); the C with the best top-1 on the
held-out part (the first, on a tie) is refitted on all of train, and scored on val.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .knn import per_class_accuracy
from .split import stratified_split

C_GRID = (10 ** torch.linspace(-6, 5, 45)).tolist()  # Meta's C_POWER_RANGE, float32 as there
HOLDOUT = 0.1
TOL, MAX_ITER = 1e-12, 1_000  # Meta's TrainConfig.tol and max_train_iters


def _sklearn():
    try:  # the probe extra: only the logistic regression needs it
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise ImportError("logistic regression needs scikit-learn; pip install 'timm-layerscale[probe]'") from None
    return LogisticRegression, ConvergenceWarning


@dataclass
class LogRegResult:
    best_c: float
    sweep: list[tuple[float, float]]  # (C, held-out top-1 percent), in grid order
    top1: float | None  # val top-1 percent (None without val labels)
    probabilities: np.ndarray  # [N_val, classes]
    per_class: list[float] = field(default_factory=list)
    unconverged: int = 0  # fits stopped at MAX_ITER (sweep and refit)
    estimator: object = None


def _fit(c: float, x: np.ndarray, y: np.ndarray, max_iter: int, tol: float):
    LogisticRegression, ConvergenceWarning = _sklearn()
    estimator = LogisticRegression(penalty="l2", solver="lbfgs", C=c, max_iter=max_iter, tol=tol)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        estimator.fit(x, y)
    return estimator, any(issubclass(w.category, ConvergenceWarning) for w in caught)


def _as_numpy(features) -> np.ndarray:
    return features.double().numpy() if isinstance(features, torch.Tensor) else np.asarray(features, np.float64)


def _top1(estimator, x: np.ndarray, y: np.ndarray) -> float:
    return 100.0 * float((estimator.predict(x) == y).mean())


def logistic_regression(
    train_features,
    train_labels,
    val_features,
    val_labels=None,
    *,
    c_grid: list[float] = C_GRID,
    holdout: float = HOLDOUT,
    seed: int = 0,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
) -> LogRegResult:
    """Meta's protocol: sweep C on a held-out part of train, refit the best on all of train, score val."""
    x, y = _as_numpy(train_features), np.asarray(train_labels, dtype=np.int64)
    held = np.asarray(stratified_split(y.tolist(), holdout, seed))
    if not held.any() or held.all():
        raise ValueError(f"logistic regression: {len(y)} train images leave no held-out part to choose C on")
    sweep, unconverged = [], 0
    for c in c_grid:
        estimator, stopped = _fit(c, x[~held], y[~held], max_iter, tol)
        sweep.append((c, _top1(estimator, x[held], y[held])))
        unconverged += stopped
    best_c = max(sweep, key=lambda row: row[1])[0]  # max() keeps the first of equals: Meta's tracker
    estimator, stopped = _fit(best_c, x, y, max_iter, tol)
    x_val = _as_numpy(val_features)
    probabilities = estimator.predict_proba(x_val)
    result = LogRegResult(best_c, sweep, None, probabilities, unconverged=unconverged + stopped, estimator=estimator)
    if val_labels is not None:
        y_val = np.asarray(val_labels, dtype=np.int64)
        predicted = estimator.classes_[probabilities.argmax(axis=1)]
        result.top1 = 100.0 * float((predicted == y_val).mean())
        num_classes = int(max(y.max(), y_val.max())) + 1
        result.per_class = per_class_accuracy(torch.from_numpy(predicted), torch.from_numpy(y_val), num_classes)
    return result
