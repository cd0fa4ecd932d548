"""The probes against the protocols computed here independently (kNN) and scikit-learn called directly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from timm_layerscale.probe import C_GRID, knn, logistic_regression, stratified_split


def _data(n: int, classes: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 2
    labels = torch.arange(n) % classes
    return centres[labels] + torch.randn(n, dim, generator=g) * 3, labels


def test_knn_probabilities_match_the_dense_formula():
    train, train_labels = _data(300, 8, 16, 0)
    test, test_labels = _data(50, 8, 16, 1)
    result = knn(train, train_labels, test, test_labels, ks=(10, 20, 100, 200, 400))
    assert result.ks == [10, 20, 100, 200]
    a, b = train / train.norm(dim=1, keepdim=True), test / test.norm(dim=1, keepdim=True)
    sim = (b.double() @ a.double().T).numpy()
    for k in result.ks:
        expected = np.zeros((50, 8))
        for row in range(50):
            # Meta's softmax runs over the largest k's neighbours; each k sums the first k of those weights
            order = np.argsort(-sim[row])[: max(result.ks)]
            w = np.exp(sim[row, order] / 0.07 - (sim[row, order] / 0.07).max())
            np.add.at(expected[row], train_labels.numpy()[order[:k]], (w / w.sum())[:k])
        np.testing.assert_allclose(result.probabilities[k].numpy(), expected, atol=1e-6)
        assert abs(result.top1[k] - 100 * (expected.argmax(1) == test_labels.numpy()).mean()) < 1e-4
        # top-5 where ties (classes with no vote at small k) may fall either way: between the rows whose label
        # beats all but 4 classes outright and those it ties for a place in the 5
        mine = expected[np.arange(50), test_labels.numpy()][:, None]
        surely = 100 * (((expected >= mine).sum(1) - 1) < 5).mean()
        maybe = 100 * ((expected > mine).sum(1) < 5).mean()
        assert surely - 1e-4 <= result.top5[k] <= maybe + 1e-4
        if surely == maybe:
            assert abs(result.top5[k] - surely) < 1e-4


def test_logistic_regression_matches_sklearn_on_the_same_split():
    train, train_labels = _data(120, 3, 8, 2)
    val, val_labels = _data(60, 3, 8, 3)
    grid = C_GRID[::11]
    result = logistic_regression(train, train_labels, val, val_labels, c_grid=grid, seed=0, max_iter=200, tol=1e-6)
    x, y = train.double().numpy(), train_labels.numpy()
    held = np.asarray(stratified_split(y.tolist(), 0.1, 0))
    scores = []
    for c in grid:
        m = LogisticRegression(C=c, max_iter=200, tol=1e-6).fit(x[~held], y[~held])
        scores.append(100 * (m.predict(x[held]) == y[held]).mean())
    assert [s for _, s in result.sweep] == scores
    best = grid[int(np.argmax(scores))]
    assert result.best_c == best
    refit = LogisticRegression(C=best, max_iter=200, tol=1e-6).fit(x, y)
    assert result.top1 == 100 * (refit.predict(val.double().numpy()) == val_labels.numpy()).mean()
    np.testing.assert_allclose(result.probabilities, refit.predict_proba(val.double().numpy()), atol=1e-12)
    again = logistic_regression(train, train_labels, val, val_labels, c_grid=grid, seed=0, max_iter=200, tol=1e-6)
    assert (again.best_c, again.top1) == (result.best_c, result.top1)


def test_per_class_accuracy_is_each_classs_share_of_its_rows_predicted_right():
    """kNN's and the logistic regression's per-class accuracies, recomputed from their own probabilities; a class
    with no val row is NaN, and the classes' mean is not the overall top-1 when the classes differ in size."""
    g = torch.Generator().manual_seed(3)
    centres = torch.randn(4, 16, generator=g) * 2
    train_labels = torch.arange(4).repeat_interleave(25)
    train = centres[train_labels] + torch.randn(100, 16, generator=g) * 1.5
    val_labels = torch.tensor([0] * 12 + [1] * 3 + [2] * 6)  # class 3 has no val row
    val = centres[val_labels] + torch.randn(len(val_labels), 16, generator=g) * 1.5
    found = knn(train, train_labels, val, val_labels, ks=[10])
    fitted = logistic_regression(train, train_labels, val, val_labels, max_iter=50)
    for probabilities, per_class in (
        (found.probabilities[10], found.per_class[10]),
        (torch.from_numpy(fitted.probabilities), fitted.per_class),
    ):
        predicted = probabilities.argmax(1)
        for c in range(3):
            rows = val_labels == c
            assert per_class[c] == pytest.approx(100.0 * float((predicted[rows] == c).float().mean()))
        assert math.isnan(per_class[3])
