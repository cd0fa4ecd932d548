"""Frozen-feature probes, as Meta's DINOv3 evaluations on one CPU: kNN (`knn`), logistic regression
(`logistic_regression`) and the linear segmentation head (`linear_segmentation`) on features given as tensors,
and the features of a folder of images (`extract_features`, through `classification_transform` or
`segmentation_transform` of the model)."""

from .data import classification_transform, segmentation_transform
from .extract import extract_features
from .knn import KS, TEMPERATURE, KnnResult, knn
from .logreg import C_GRID, LogRegResult, logistic_regression
from .segment import LinearSegmentationHead, SegmentationResult, linear_segmentation
from .split import stratified_split

__all__ = [
    "C_GRID",
    "KS",
    "TEMPERATURE",
    "KnnResult",
    "LinearSegmentationHead",
    "LogRegResult",
    "SegmentationResult",
    "classification_transform",
    "extract_features",
    "knn",
    "linear_segmentation",
    "logistic_regression",
    "segmentation_transform",
    "stratified_split",
]
