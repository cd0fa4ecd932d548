"""Frozen-feature probes, as Meta's DINOv3 evaluations on one CPU: kNN (`knn`) and logistic regression
(`logistic_regression`) on features given as tensors."""

from .knn import KS, TEMPERATURE, KnnResult, knn
from .logreg import C_GRID, LogRegResult, logistic_regression
from .split import stratified_split

__all__ = ["C_GRID", "KS", "TEMPERATURE", "KnnResult", "LogRegResult", "knn", "logistic_regression", "stratified_split"]
