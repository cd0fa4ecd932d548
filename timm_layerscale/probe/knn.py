"""k-nearest-neighbour classification on frozen features, as Meta's `dinov3/eval/knn.py` (one process).

The features are L2-normalised, each test feature's cosine similarity to every train feature is taken, the
k most similar train features vote for their class with weights `softmax(sim / T)` over the k (T = 0.07),
and the votes summed per class are the class probabilities. Accuracy is top-1, and top-5 where there are
more than 5 classes, for every k in `ks` that is not above the train set's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.functional import normalize, one_hot, softmax

KS = (10, 20, 100, 200)  # Meta's TrainConfig.ks
TEMPERATURE = 0.07  # Meta's TrainConfig.temperature
ROWS = 1024  # test features per similarity block: memory stays bounded on large sets


@dataclass
class KnnResult:
    ks: list[int]
    probabilities: dict[int, torch.Tensor]  # k -> [N_test, classes]
    top1: dict[int, float] = field(default_factory=dict)  # k -> percent; empty without test labels
    top5: dict[int, float] = field(default_factory=dict)  # only with more than 5 classes
    per_class: dict[int, list[float]] = field(default_factory=dict)  # k -> top-1 percent per class


def usable_ks(ks: Sequence[int], train_size: int) -> list[int]:
    """The ks not above the train set's size; an error line when none is."""
    kept = sorted({int(k) for k in ks if 0 < k <= train_size})
    if not kept:
        raise ValueError(f"kNN: the train set has {train_size} images, fewer than the smallest k ({min(ks)})")
    return kept


def knn_probabilities(
    train: torch.Tensor, train_labels: torch.Tensor, test: torch.Tensor, ks: list[int], num_classes: int, T: float
) -> dict[int, torch.Tensor]:
    """Meta's KnnModule.forward for every k at once, in blocks of test rows."""
    train_t = normalize(train.float(), dim=1, p=2).T
    test = normalize(test.float(), dim=1, p=2)
    out: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    for start in range(0, len(test), ROWS):
        similarity = test[start : start + ROWS] @ train_t
        sims, indices = similarity.topk(max(ks), dim=1, largest=True, sorted=True)
        votes = one_hot(train_labels[indices], num_classes).float() * softmax(sims / T, dim=1).unsqueeze(2)
        for k in ks:
            out[k].append(votes[:, :k].sum(dim=1))
    return {k: torch.cat(parts) for k, parts in out.items()}


def accuracy(probabilities: torch.Tensor, labels: torch.Tensor, top: int = 1) -> float:
    """Percent of rows whose label is among the `top` most probable classes (torchmetrics' micro accuracy)."""
    best = probabilities.topk(top, dim=1).indices
    return 100.0 * (best == labels[:, None]).any(dim=1).float().mean().item()


def per_class_accuracy(predicted: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[float]:
    """Top-1 percent per class (NaN for a class with no test item)."""
    result = []
    for c in range(num_classes):
        mine = labels == c
        result.append(100.0 * (predicted[mine] == c).float().mean().item() if mine.any() else float("nan"))
    return result


def knn(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor | None = None,
    *,
    ks: Sequence[int] = KS,
    temperature: float = TEMPERATURE,
    num_classes: int | None = None,
) -> KnnResult:
    """Meta's weighted kNN: class probabilities per k, and accuracies where `test_labels` are given."""
    if train_features.ndim != 2 or test_features.ndim != 2 or train_features.shape[1] != test_features.shape[1]:
        raise ValueError(
            f"kNN: features must be [N, D] with one D, got {tuple(train_features.shape)} "
            f"and {tuple(test_features.shape)}"
        )
    train_labels = torch.as_tensor(train_labels, dtype=torch.long)
    num_classes = num_classes or int(train_labels.max()) + 1
    kept = usable_ks(ks, len(train_features))
    probabilities = knn_probabilities(train_features, train_labels, test_features, kept, num_classes, temperature)
    result = KnnResult(kept, probabilities)
    if test_labels is not None:
        test_labels = torch.as_tensor(test_labels, dtype=torch.long)
        for k, p in probabilities.items():
            result.top1[k] = accuracy(p, test_labels)
            if num_classes > 5:
                result.top5[k] = accuracy(p, test_labels, 5)
            result.per_class[k] = per_class_accuracy(p.argmax(dim=1), test_labels, num_classes)
    return result
