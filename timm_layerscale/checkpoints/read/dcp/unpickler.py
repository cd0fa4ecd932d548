"""The unpickler of DCP `.metadata`: DCP's own classes only, each operation checked, the work counted and bounded.

torch's own reader unpickles `.metadata` with `pickle.load`. Here pickle's pure-Python unpickler runs with a
check before each operation that could run code or change anything outside what it makes: globals come from
an allow-list and fixed tables (dtypes.py; never `getattr` on a module), only DCP's dataclasses are
instantiated, REDUCE calls only torch.Size, the layout and memory-format lookups and pure paths. And before
each operation that makes or fills a container it checks the nesting depth and the counts (`Limits`,
`Work`), and that every key or set element is a string or a MetadataIndex: so no hash, comparison or repr
of what it made can recurse deeply or take more than linear work, however the file shares objects through
the memo.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import torch

from ...dtypes import dtype_named, layout_named
from .schema import LIMITS, Limits, Work, shown


def _allowed_globals() -> dict[tuple[str, str], Any]:
    # torch.distributed.checkpoint is imported on use: about 0.4 s that every `import timm` would pay.
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in dataclasses_allowed()
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = metadata._MEM_FORMAT_ENCODING
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = layout
    # StorageMeta.checkpoint_id: the path it was saved to, kept as a pure path (no file system access).
    for name in ("PosixPath", "PurePosixPath"):
        allowed[("pathlib", name)] = PurePosixPath
    for name in ("WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = PureWindowsPath
    return allowed


def dataclasses_allowed() -> tuple[type, ...]:
    """The classes whose instances DCP metadata holds: each made empty (NEWOBJ), then given its fields (BUILD)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    )
    return (*(vars(metadata)[name] for name in names if name in vars(metadata)), filesystem._StorageInfo)


def layout(name: str) -> torch.layout:
    """`torch.serialization._get_layout` as DCP's pickles call it, from the fixed table of layouts."""
    found = layout_named(name)
    if found is None:
        raise pickle.UnpicklingError(f"unknown tensor layout {shown(name)}")
    return found


class Refused(pickle.UnpicklingError):
    """An operation the unpickler will not run: the message says what the pickle asked for."""


def _named(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"the module {obj.__name__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"the function {getattr(obj, '__module__', None)}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _never(what: str) -> Refused:
    return Refused(f"{what}, which distributed checkpoint metadata never does (nothing was changed)")


# Memory per object made beyond its own size (its `_Made`, its slot in `_made` and on the stack), and per item
# put into a container (a dict's slot and its share of the table's growth).
_BOOKKEEPING = 160
# A dataclass's state is a name-keyed mapping too: Metadata's has 5 fields.
_MOST_FIELDS = 16
_ITEM_BYTES = 48


class _Made:
    """What the unpickler knows of an object it made: how deep it nests, and whether it is inside another
    (then it is never changed again, so the depth of what holds it stays true). Holding the object keeps
    its id from being reused by another while the unpickler runs."""

    __slots__ = ("built", "depth", "inside", "obj")

    def __init__(self, obj: Any, depth: int, built: bool | None = None) -> None:
        self.obj, self.depth, self.inside, self.built = obj, depth, False, built


def _calls(limits: Limits) -> tuple[tuple[Callable[..., Any], Callable[[tuple[Any, ...]], bool]], ...]:
    """What REDUCE may call, each with the only arguments DCP's pickles pass it."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    def one(kind: type) -> Callable[[tuple[Any, ...]], bool]:
        return lambda args: len(args) == 1 and type(args[0]) is kind

    def strings(args: tuple[Any, ...]) -> bool:
        return all(type(a) is str for a in args)

    def size(args: tuple[Any, ...]) -> bool:
        return (
            len(args) == 1
            and type(args[0]) is tuple
            and len(args[0]) <= limits.dims
            and all(type(n) is int and -limits.size_value < n < limits.size_value for n in args[0])
        )

    return (
        (torch.Size, size),
        (layout, one(str)),
        (_MEM_FORMAT_ENCODING, one(int)),
        (PurePosixPath, strings),
        (PureWindowsPath, strings),
    )


def _counted(load_op: Callable[[Any], None]) -> Callable[[Any], None]:
    def counted(self: MetadataUnpickler) -> None:
        self.work.opcodes += 1
        load_op(self)

    return counted


def _size_of(file: io.BufferedIOBase) -> int:
    here = file.tell()
    end = file.seek(0, io.SEEK_END)
    file.seek(here)
    return end - here


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata and nothing else: its dataclasses, torch dtypes, sizes and pure paths.

    Any other global is refused unrun. pickle's pure-Python unpickler, so that each operation is checked
    before it runs: only DCP's dataclasses are instantiated (empty, then BUILD gives each instance, once, a
    state of its own fields), REDUCE calls only torch.Size, the layout and memory-format lookups and pure
    paths, with the arguments DCP gives them, items and elements go only into dicts, lists and sets made
    here and not yet inside anything else, keyed by strings or MetadataIndex. So nothing in the pickle sets
    an attribute on a class, a module or a function, and no code runs. `work` counts what it did, within
    `limits`: each count grows at most linearly with the file.
    """

    def __init__(self, file: io.BufferedIOBase, limits: Limits = LIMITS, work: Work | None = None) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        super().__init__(file)
        self.limits = limits
        self.work = work if work is not None else Work()
        self.work.bytes = _size_of(file)
        self._memory = min(limits.memory, max(limits.memory_floor, limits.memory_per_byte * self.work.bytes))
        self._allowed = _allowed_globals()
        self._calls = _calls(limits)
        self._fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in dataclasses_allowed()}
        self._required = {
            cls: {f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING}
            for cls in self._fields
        }
        self._setstate = {cls for cls in self._fields if "__setstate__" in vars(cls)}  # TensorProperties
        self._index_class = MetadataIndex
        self._made: dict[int, _Made] = {}  # id -> each container and instance made here

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[module, name]
        if module == "torch" and (dtype := dtype_named(name)) is not None:
            return dtype
        asked = f"{module}.{name}"
        raise Refused(
            f"asks for {asked if asked.isprintable() and len(asked) <= 200 else shown(asked)}, which distributed "
            f"checkpoint metadata never holds, so it could run code (nothing was run)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(
            f"asks for persistent id {shown(pid)}, which distributed checkpoint metadata never holds, so it could "
            f"run code (nothing was run)"
        )

    def load(self) -> Any:
        result = super().load()
        for made in self._made.values():
            if made.built is None:
                continue
            missing = self._required[type(made.obj)] - vars(made.obj).keys()
            if missing:
                name = type(made.obj).__name__
                raise pickle.UnpicklingError(f"a {name} without its fields {', '.join(sorted(missing))}")
        return result

    # ----------------------------------------------------------------------------- depth and counts

    def _count(self, objects: int = 0, items: int = 0, size: int = 0) -> None:
        work, limits = self.work, self.limits
        work.objects += objects
        work.items += items
        work.memory += size + objects * _BOOKKEEPING + items * _ITEM_BYTES
        if work.objects > limits.objects or work.items > limits.items:
            raise Refused(
                f"makes {work.objects} objects holding {work.items} items, more than any distributed checkpoint "
                f"metadata ({limits.objects} and {limits.items}) (nothing was run)"
            )
        if work.memory > self._memory:
            raise Refused(
                f"makes objects taking over {self._memory >> 20} MiB from {work.bytes} bytes, more than any "
                f"distributed checkpoint metadata of its size needs (nothing was run)"
            )

    def _nest(self, children: Iterable[Any]) -> int:
        """The depth of a container of `children`, refused when too deep; each child is marked as inside it."""
        deepest, made = 0, self._made
        for child in children:
            found = made.get(id(child))
            if found is not None:
                found.inside = True
                deepest = max(deepest, found.depth)
        if deepest >= self.limits.depth:
            raise _never(f"nests objects more than {self.limits.depth} deep")
        self.work.depth = max(self.work.depth, deepest + 1)
        return deepest + 1

    def _push(self, obj: Any, depth: int, built: bool | None = None) -> None:
        self._count(objects=1, size=sys.getsizeof(obj))
        self._made[id(obj)] = _Made(obj, depth, built)
        self.append(obj)

    def _check_keys(self, keys: Iterable[Any]) -> None:
        """Before anything is hashed: a key or set element is a string of bounded length, or a MetadataIndex
        with its fields set (a string and a checked torch.Size), so that its hash and comparisons take
        bounded work and cannot be chosen to collide."""
        for key in keys:
            if type(key) is str:
                if len(key) > self.limits.name_length:
                    raise _never(f"uses a string of {len(key)} characters as a key")
            elif type(key) is not self._index_class or not self._is_set_index(key):
                raise _never(f"uses {_named(key)} as a key or set element")

    def _check_names(self, target: dict, key: Any) -> None:
        """A mapping keyed by names (`state_dict_metadata`, `planner_data`) holds one item per state dict key:
        refused by its count as it fills, not after the whole file is unpickled."""
        if type(key) is str and len(target) > self.limits.keys + _MOST_FIELDS:  # the schema counts exactly
            raise Refused(f"lists more than the {self.limits.keys} items any checkpoint holds (nothing was run)")

    def _is_set_index(self, index: Any) -> bool:
        # Only BUILD sets fields (once, before the index can be inside anything), and only REDUCE makes a
        # torch.Size (of ints checked there).
        fqn, offset = vars(index).get("fqn"), getattr(index, "offset", None)
        return (
            type(fqn) is str and len(fqn) <= self.limits.name_length and (offset is None or type(offset) is torch.Size)
        )

    # ------------------------------------------------------------------------------- containers

    def _make(self, kind: Callable[[list[Any]], Any], items: list[Any], keys: list[Any] | None = None) -> None:
        depth = self._nest(items)
        self._count(items=len(items))
        if keys is not None:
            self._check_keys(keys)
        self._push(kind(items), depth)

    def load_tuple(self) -> None:
        self._make(tuple, self.pop_mark())

    def load_tuple1(self) -> None:
        self._make(tuple, [self.stack.pop()])

    def load_tuple2(self) -> None:
        second, first = self.stack.pop(), self.stack.pop()
        self._make(tuple, [first, second])

    def load_tuple3(self) -> None:
        third, second, first = self.stack.pop(), self.stack.pop(), self.stack.pop()
        self._make(tuple, [first, second, third])

    def load_list(self) -> None:
        self._make(list, self.pop_mark())

    def load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError("DICT with a key and no value")
        self._make(lambda kv: dict(zip(kv[::2], kv[1::2])), items, items[::2])

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self._make(frozenset, items, items)

    def load_empty_list(self) -> None:
        self._push([], 1)

    def load_empty_dictionary(self) -> None:
        self._push({}, 1)

    def load_empty_set(self) -> None:
        self._push(set(), 1)

    def _target(self, kind: type, opcode: str, children: list[Any]) -> Any:
        """The container on top of the stack that `children` go into: one of `kind` made here and not yet
        inside another (whose depth would then change unseen); its depth is updated."""
        target = self.stack[-1]
        made = self._made.get(id(target))
        if type(target) is not kind or made is None:
            raise _never(f"{opcode} {_named(target)}")
        if made.inside:
            raise _never(f"{opcode} a {kind.__name__} already inside another object")
        made.depth = max(made.depth, self._nest(children))
        self._count(items=len(children))
        return target

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        target = self._target(dict, "sets an item of", [key, value])
        self._check_keys((key,))
        target[key] = value
        self._check_names(target, key)

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target(dict, "sets items of", items)
        self._check_keys(items[::2])
        target.update(zip(items[::2], items[1::2]))
        if items:
            self._check_names(target, items[0])

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target(list, "appends to", [value]).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target(list, "appends to", items).extend(items)

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._target(set, "adds to", items)
        self._check_keys(items)
        target.update(items)

    # ---------------------------------------------------------------------------------- instances

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        if not any(cls is allowed for allowed in self._fields):
            raise _never(f"creates an instance of {_named(cls)} (pickle NEWOBJ)")
        if args != () or kwargs != {}:
            given = shown(args) + (f" and keywords {shown(kwargs)}" if kwargs != {} else "")
            raise _never(f"creates a {cls.__qualname__} with arguments {given} (pickle NEWOBJ)")
        self._push(cls.__new__(cls), 1, built=False)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, {})

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    def load_reduce(self) -> None:
        args, func = self.stack.pop(), self.stack[-1]
        check = next((check for allowed, check in self._calls if func is allowed), None)
        if check is None:
            raise _never(f"calls {_named(func)} (pickle REDUCE)")
        if type(args) is not tuple or not check(args):
            raise _never(f"calls {_named(func)} with {shown(args)} (pickle REDUCE)")
        result = func(*args)
        self.stack.pop()
        if type(result) is torch.Size:  # a tuple of ints; the others are paths and shared torch objects
            self._push(result, 1)
        else:
            self._count(objects=1)
            self.append(result)

    def load_build(self) -> None:
        state, obj = self.stack.pop(), self.stack[-1]
        made = self._made.get(id(obj))
        if made is None or made.built is not False or made.inside:
            again = " again" if made is not None and made.built else ""
            raise _never(f"sets the state of {_named(obj)}{again} (pickle BUILD)")
        cls, fields = type(obj), self._fields[type(obj)]
        if cls in self._setstate:  # TensorProperties: a tuple, one item per field
            if type(state) is not tuple or len(state) != len(fields):
                raise _never(f"gives a {cls.__qualname__} the state {shown(state)} (pickle BUILD)")
            made.depth = max(made.depth, self._nest([state]))
            cls.__setstate__(obj, state)
        else:
            if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
                unknown = sorted(map(shown, set(state) - fields)) if type(state) is dict else [shown(state)]
                raise _never(f"gives a {cls.__qualname__} {', '.join(unknown)}, not its fields (pickle BUILD)")
            made.depth = max(made.depth, self._nest([state]))
            vars(obj).update(state)
        made.built = True

    def load_refused(self) -> None:
        raise _never("instantiates a class by INST/OBJ or takes an object from pickle's extension registry")

    def load_buffer_refused(self) -> None:
        raise _never("makes a bytearray or an out-of-band buffer")

    dispatch = {
        code: _counted(load_op)
        for code, load_op in {
            **pickle._Unpickler.dispatch,
            pickle.TUPLE[0]: load_tuple,
            pickle.TUPLE1[0]: load_tuple1,
            pickle.TUPLE2[0]: load_tuple2,
            pickle.TUPLE3[0]: load_tuple3,
            pickle.LIST[0]: load_list,
            pickle.DICT[0]: load_dict,
            pickle.FROZENSET[0]: load_frozenset,
            pickle.EMPTY_LIST[0]: load_empty_list,
            pickle.EMPTY_DICT[0]: load_empty_dictionary,
            pickle.EMPTY_SET[0]: load_empty_set,
            pickle.SETITEM[0]: load_setitem,
            pickle.SETITEMS[0]: load_setitems,
            pickle.APPEND[0]: load_append,
            pickle.APPENDS[0]: load_appends,
            pickle.ADDITEMS[0]: load_additems,
            pickle.NEWOBJ[0]: load_newobj,
            pickle.NEWOBJ_EX[0]: load_newobj_ex,
            pickle.REDUCE[0]: load_reduce,
            pickle.BUILD[0]: load_build,
            pickle.INST[0]: load_refused,
            pickle.OBJ[0]: load_refused,
            pickle.EXT1[0]: load_refused,
            pickle.EXT2[0]: load_refused,
            pickle.EXT4[0]: load_refused,
            pickle.BYTEARRAY8[0]: load_buffer_refused,
            pickle.NEXT_BUFFER[0]: load_buffer_refused,
            pickle.READONLY_BUFFER[0]: load_buffer_refused,
        }.items()
    }
