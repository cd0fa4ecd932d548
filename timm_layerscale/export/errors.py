"""What an export refuses: bad input, and ONNX Runtime's outputs too far from PyTorch's."""

from __future__ import annotations

from dataclasses import dataclass


class ExportError(ValueError):
    """Bad input to an export: one line naming the problem and the fix."""


@dataclass
class CheckRow:
    height: int
    width: int
    batch: int
    output: str
    max_abs: float
    max_rel: float

    def line(self) -> str:
        size = f"{self.height}x{self.width}"
        return f"{size:>9} batch {self.batch}  {self.output}: max abs {self.max_abs:.2e}, max rel {self.max_rel:.2e}"


class OnnxCheckError(ExportError):
    """ONNX Runtime's outputs differ from PyTorch's by more than the tolerance."""

    def __init__(self, message: str, rows: list[CheckRow]) -> None:
        super().__init__(message)
        self.rows = rows
