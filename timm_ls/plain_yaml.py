"""YAML read as plain data only, within bounds: what every YAML a user gives (a variant, Meta's training
config, an experiment, a list in `--model-kwargs`) is read through.

PyYAML's safe loader makes no object but plain data (a `!!python/...` tag is refused); on top of it, the
nesting is bounded while the document is composed (so 3000 brackets are one line, not a RecursionError) and
the size of the document with every alias expanded is bounded before anything is built from it (so a
"billion laughs" file is refused in milliseconds). Every problem is one `YamlError` line naming the file,
its line and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a variant or training YAML is a few kilobytes
MAX_DEPTH = 64  # the shipped files nest 4 deep
MAX_NODES = 100_000  # values in the document with every alias expanded


class YamlError(ValueError):
    """A YAML file or text that is not plain data within the bounds: one line naming where and the fix."""


class _Refused(yaml.MarkedYAMLError):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # Refused as it is scanned: PyYAML's scanner reads a flow collection to its end before the composer
        # sees a node, keeping every open bracket as a possible key, in time quadratic in the nesting.
        if self.flow_level >= MAX_DEPTH:
            raise _Refused(f"it nests more than {MAX_DEPTH} deep", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"it nests more than {MAX_DEPTH} deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Any) -> Any:
        _expanded(node, 1, {})
        return super().construct_document(node)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:  # `!!int abc`, an unhashable key, ...
            raise _Refused(" ".join(str(exc).split()) or type(exc).__name__, node.start_mark) from None


def _expanded(node: Any, depth: int, sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(values, height) of `node` with its aliases expanded; refuses a document beyond the bounds."""
    if id(node) in sizes:
        values, height = sizes[id(node)]
    else:
        sizes[id(node)] = (MAX_NODES + 1, MAX_DEPTH + 1)  # a node met again inside itself refers to itself
        values, height = 1, 1
        children = node.value if isinstance(node.value, list) else []
        for child in children:
            for part in child if isinstance(child, tuple) else (child,):
                size, below = _expanded(part, depth + 1, sizes)
                values, height = values + size, max(height, below + 1)
                if values > MAX_NODES:
                    break
        sizes[id(node)] = (values, height)
    if values > MAX_NODES:
        raise _Refused(f"it holds more than {MAX_NODES} values once its aliases are expanded", node.start_mark)
    if depth + height - 1 > MAX_DEPTH:
        raise _Refused(f"it nests more than {MAX_DEPTH} deep once its aliases are expanded", node.start_mark)
    return values, height


def _problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        what = " ".join(f"{exc.context or ''} {exc.problem or ''}".split())
        return f"line {exc.problem_mark.line + 1}: {what}"
    return " ".join(str(exc).split())


def load_text(text: str | bytes, where: str) -> Any:
    """The plain data of a YAML document; `where` names it in the error line."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as exc:
        raise YamlError(f"{where} is not plain YAML data ({_problem(exc)}); fix the file") from None


def load_file(path: Path) -> Any:
    """The plain data of a YAML file, read only when it is of a YAML file's size."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise YamlError(f"{path} is {size} bytes, more than a YAML config holds ({MAX_BYTES}); pass the YAML file")
    return load_text(path.read_bytes(), str(path))
