"""The code stays readable: every function of the package at most 60 lines, every file at most 500."""

from __future__ import annotations

import ast
from pathlib import Path

import timm_layerscale
import timm_ls

ROOTS = (Path(timm_layerscale.__file__).parent, Path(timm_ls.__file__).parent)
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


def sources() -> list[Path]:
    return [path for root in ROOTS for path in sorted(root.rglob("*.py"))]


def test_every_file_is_at_most_500_lines():
    long = {str(p): n for p in sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert long == {}


def test_every_function_is_at_most_60_lines():
    long = {
        f"{path}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for path in sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES
    }
    assert long == {}


def test_the_checks_see_a_long_function(tmp_path):
    source = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    (node,) = ast.parse(source).body
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1
