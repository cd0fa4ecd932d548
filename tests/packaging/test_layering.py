"""The package's imports run one way: a test that fails on a cycle or an import that runs back up.

Every import counts, deferred ones inside functions too, read from the source with `ast` (nothing is run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import timm_layerscale
import timm_ls

PACKAGE = Path(timm_layerscale.__file__).parent
ROOT = "timm_layerscale"
FRONT = Path(timm_ls.__file__).parent  # the command's front and what it shares with the package, torch-free

# Bottom to top; a module may import its own layer and those below. Checked by the first matching prefix.
LAYERS = (
    ("timm_ls.names", -1),
    ("timm_ls.destinations", -1),
    ("timm_ls.errors", -1),
    ("timm_ls.paths", -1),
    ("timm_ls.interrupts", -1),
    ("timm_ls.plain_yaml", -1),
    ("timm_ls.image_folder", -1),
    ("timm_ls.layer_sets", -1),
    ("timm_ls.cpu", -1),
    ("timm_ls.model_source", -1),
    ("timm_ls.probe_request", -1),
    ("timm_ls.int8_request", -1),
    ("timm_ls.pretrain_request", -1),
    ("timm_ls.pretrain_parser", -1),
    ("timm_ls.logs", -1),
    ("layer_options", 0),  # the layer options' declarations: the family records and config ask them, layers fill them
    ("families", 0),  # the family records: below config, which records a family and is checked by its record
    ("config", 0),
    ("layers", 1),
    ("checkpoints.errors", 2.0),
    ("checkpoints.dtypes", 2.0),
    ("checkpoints.mapping", 2.1),
    ("checkpoints.read", 2.2),
    ("checkpoints.write", 2.2),
    ("checkpoints.formats", 2.3),
    ("checkpoints.load_hook", 2.4),
    ("checkpoints", 2.5),  # the folder's public names
    ("model", 3),
    ("intermediates", 3),
    ("fsdp", 3),
    ("fold", 3),
    ("hub", 4),
    ("loading", 4),
    ("variants", 5),
    ("identity", 6),
    ("convert", 7),
    ("publish", 7),
    ("export", 7),
    ("fidelity", 7),  # a changed model's outputs against its fp32 original's; draws images with tools
    ("deploy", 7),  # int8 copies of a model, with their fidelity
    ("tools", 7),
    ("probe", 7),
    ("pretrain", 7),  # adapting a model to unlabeled images: the loop, the methods, Meta's losses
    ("cli.__main__", 9),  # `python -m timm_layerscale.cli`: the entry point's other name
    ("cli", 8),
    ("docs_tables", 9),  # the README's and docs' tables from the registry, the commands' parsers and `list`
    ("timm_ls", 9),  # the entry point: it loads a command's module when that command runs
    ("", 9),  # the package itself: its public names
)


def module_name(path: Path) -> str:
    root = FRONT if path.is_relative_to(FRONT) else PACKAGE
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((root.name, *parts))


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in [*sorted(PACKAGE.rglob("*.py")), *sorted(FRONT.rglob("*.py"))]}


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each import of one of the package's modules."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deferred = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        targets = []
        if _loads_a_module(node):  # importlib.import_module("timm_layerscale..." or f"timm_layerscale...{x}")
            text = ast.unparse(node.args[0]) if node.args else ""
            targets = [root for root in (ROOT, FRONT.name) if text.lstrip("f'\"").startswith(root)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from X import y` imports the module X.y where there is one, else X
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known and target.startswith((ROOT + ".", FRONT.name + ".")):
                target = target.rpartition(".")[0]
            if target in known and target != name:
                found.append((target, node.lineno, id(node) in deferred))
    return found


def _loads_a_module(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def layer(name: str) -> int:
    inner = name.removeprefix(ROOT).removeprefix(".")
    return next(rank for prefix, rank in LAYERS if inner == prefix or inner.startswith(prefix + ".") or not prefix)


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return result


def test_the_package_has_no_import_cycle():
    edges = {name: [t for t, _, _ in found] for name, found in graph().items()}
    assert cycles(edges) == []


def test_imports_never_run_back_up_the_layers():
    upward = [
        f"{name}:{line} imports {target} (layer {layer(target)} above {layer(name)})"
        for name, found in graph().items()
        for target, line, _ in found
        if layer(target) > layer(name)
    ]
    assert upward == []


# Inside the checkpoint machinery, the two directions never meet: a reader knows no writer and no format, a
# writer no reader. Both stand on mapping (plans, key tables), errors and dtypes.
APART = {
    f"{ROOT}.checkpoints.read": (f"{ROOT}.checkpoints.write", f"{ROOT}.checkpoints.formats"),
    f"{ROOT}.checkpoints.write": (f"{ROOT}.checkpoints.read", f"{ROOT}.checkpoints.formats"),
}


def crossings(edges: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    return [
        f"{name}:{line} imports {target}"
        for name, found in edges.items()
        for source, barred in APART.items()
        if name == source or name.startswith(source + ".")
        for target, line, _ in found
        if any(target == b or target.startswith(b + ".") for b in barred)
    ]


def test_reading_and_writing_checkpoints_never_import_each_other():
    assert crossings(graph()) == []
    made_up = {f"{ROOT}.checkpoints.read.reader": [(f"{ROOT}.checkpoints.write.writers", 3, False)]}
    assert crossings(made_up) == [f"{ROOT}.checkpoints.read.reader:3 imports {ROOT}.checkpoints.write.writers"]


FORMATS_PACKAGE = f"{ROOT}.checkpoints.formats"
SHARED_BY_FORMATS = (f"{FORMATS_PACKAGE}.base", f"{FORMATS_PACKAGE}.foreign")


def format_crossings(edges: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """A format module importing another format's: what they share lives in base (foreign names families)."""
    return [
        f"{name}:{line} imports {target}"
        for name, found in edges.items()
        if name.startswith(FORMATS_PACKAGE + ".") and name not in SHARED_BY_FORMATS
        for target, line, _ in found
        if target.startswith(FORMATS_PACKAGE + ".") and target not in SHARED_BY_FORMATS
    ]


def test_no_format_imports_another():
    assert format_crossings(graph()) == []
    made_up = {f"{FORMATS_PACKAGE}.timm": [(f"{FORMATS_PACKAGE}.hf", 7, False)]}
    assert format_crossings(made_up) == [f"{FORMATS_PACKAGE}.timm:7 imports {FORMATS_PACKAGE}.hf"]


# The one import of a package module inside a function: the entry point loads a command's module when it runs it.
DISPATCH = "timm_ls.main"


def test_no_module_of_the_package_is_imported_inside_a_function_but_the_commands_on_dispatch():
    deferred = [f"{name}:{line} imports {target}" for name, found in graph().items() for target, line, d in found if d]
    assert [line for line in deferred if not line.startswith(f"{DISPATCH}:")] == []
    dispatched = [line for line in deferred if line.startswith(f"{DISPATCH}:")]
    assert len(dispatched) == 1 and dispatched[0].endswith(f"imports {ROOT}"), dispatched


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves: a made-up cycle and an import from the checkpoints up to the model are found."""
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert layer(f"{ROOT}.checkpoints.read.reader") < layer(f"{ROOT}.model") < layer(f"{ROOT}.variants")
    fake = tmp_path / "timm_layerscale" / "checkpoints"
    fake.mkdir(parents=True)
    (fake / "reader.py").write_text("def f():\n    from ..model import VisionTransformerLS\n")
    known = {f"{ROOT}.checkpoints.reader", f"{ROOT}.model", ROOT}
    assert imports(f"{ROOT}.checkpoints.reader", fake / "reader.py", known) == [(f"{ROOT}.model", 2, True)]
    (fake / "reader.py").write_text(
        "import importlib\ndef f(x):\n    return importlib.import_module(f'timm_layerscale.{x}')\n"
    )
    assert imports(f"{ROOT}.checkpoints.reader", fake / "reader.py", known) == [(ROOT, 3, True)]


def test_every_module_has_a_layer():
    """A new module is placed on purpose: only the package's own `__init__` takes the top layer by default."""
    prefixes = [prefix for prefix, _ in LAYERS if prefix]
    unplaced = [
        name
        for name in modules()
        if name != ROOT
        and not any(
            (inner := name.removeprefix(ROOT + ".")) == prefix or inner.startswith(prefix + ".") for prefix in prefixes
        )
    ]
    assert unplaced == []
