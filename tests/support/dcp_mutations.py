"""Structure-aware mutations of a real DCP `.metadata` pickle, for the fuzzer (tests/formats/test_dcp_fuzz.py).

The pickle is taken apart into opcodes and its stack is simulated once, so each object it builds is known by
the opcode that made it, its first and last opcode and its memo index. A mutation is one or a few edits of
that opcode list: values changed (ints, strings, dtype names), opcodes deleted, doubled or swapped, an object
replaced by a reference to another one of its kind through the memo (a chunk list, a Size or a
TensorProperties shared), objects wrapped in containers or replaced by deep ones, the file cut short. Every
case comes from a seed alone.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import struct
from dataclasses import dataclass

from support.dcp import deep_list, deep_tuple, glob, integer, opcodes, text

# Opcodes whose bottom operand stays on the stack, filled or built: the object is the same, its span grows.
FILLS = {"SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS", "BUILD"}
MEMO_PUTS = {"MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"}
MEMO_GETS = {"BINGET", "LONG_BINGET", "GET"}
# Opcodes without an argument, for swapping one for another.
BARE = [
    *(pickle.BUILD, pickle.POP, pickle.APPEND, pickle.APPENDS, pickle.SETITEM, pickle.SETITEMS, pickle.ADDITEMS),
    *(pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.LIST, pickle.DICT, pickle.FROZENSET),
    *(pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_SET, pickle.EMPTY_TUPLE, pickle.NONE, pickle.NEWTRUE),
    *(pickle.NEWFALSE, pickle.DUP, pickle.MARK, pickle.POP_MARK, pickle.MEMOIZE, pickle.STOP, pickle.REDUCE),
    *(pickle.NEWOBJ, pickle.STACK_GLOBAL),
]
INTS = [0, 1, -1, 2, 3, 7, 31, 32, 63, 64, 65, 127, 255, 256, 2**31 - 1, -(2**31), 2**32, 2**40, 2**61 - 1, 2**61]
STRINGS = [
    *("", ".", "..", "../__0_0.distcp", "/etc/passwd", "__1_0.distcp", "__0_0.distcp", "a\0b", "\n", "x" * 1024),
    *("x" * 1025, "model.backbone.cls_token", "iteration", "fqn", "offset", "offsets", "sizes", "chunks"),
    *("relative_path", "length", "dtype", "has_cuda", "set_vital", "_dynamo", "load", "Size", "strided"),
    *("torch.strided", "torch.float32", "TensorProperties", "Metadata", "MetadataIndex", "_StorageInfo"),
]
# What a memo reference may stand for: containers, instances, sizes and names.
SHARED_KINDS = {
    "EMPTY_LIST",
    "EMPTY_DICT",
    "NEWOBJ",
    "REDUCE",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "SHORT_BINUNICODE",
}
DTYPES = ["float64", "float16", "bfloat16", "int32", "int8", "uint8", "bool", "complex128", "qint8", "float", "Tensor"]
FRAGMENTS = [
    glob("torch", "has_cuda"),
    glob("torch", "load"),
    glob("pathlib", "PosixPath") + pickle.EMPTY_TUPLE + pickle.NEWOBJ,
    glob("torch.serialization", "_get_layout") + text("torch.float32") + pickle.TUPLE1 + pickle.REDUCE,
    glob("torch", "Size") + pickle.MARK + integer(-5) + pickle.TUPLE + pickle.TUPLE1 + pickle.REDUCE,
    pickle.PERSID + b"0\n",
    pickle.BYTEARRAY8 + struct.pack("<Q", 2**40),
]


@dataclass
class Value:
    """An object the pickle builds: the opcode that made it, its first and last opcode, its memo index."""

    kind: str
    start: int
    end: int
    memo: int | None = None


def values(ops: list[tuple[str, object, bytes]]) -> list[Value]:
    """Every object the opcodes build, by a simulation of pickle's stack (an opcode of a valid pickle)."""
    stack: list[tuple[int | None, int] | None] = []  # (identity: the opcode that made it, first opcode); None: MARK
    found: dict[int, Value] = {}
    memo: dict[int, int | None] = {}
    for i, (name, arg, raw) in enumerate(ops):
        info = pickletools.code2op[chr(raw[0])]
        if name in MEMO_PUTS:
            index = len(memo) if name == "MEMOIZE" else int(arg)
            memo[index] = stack[-1][0] if stack and stack[-1] is not None else None
            if memo[index] in found and found[memo[index]].memo is None:
                found[memo[index]].memo = index
            continue
        if name in MEMO_GETS or name == "DUP":
            stack.append((memo.get(int(arg)) if name != "DUP" else stack[-1][0], i))
            continue
        if name == "MARK":
            stack.append(None)
            continue
        popped = []
        if pickletools.markobject in info.stack_before:
            while stack[-1] is not None:
                popped.append(stack.pop())
            stack.pop()
        operands = [x for x in info.stack_before if x not in (pickletools.markobject, pickletools.stackslice)]
        popped += [stack.pop() for _ in operands]
        if name in FILLS:
            identity, start = popped[-1]
            if identity in found:
                found[identity].end = i
            stack.append((identity, start))
        elif info.stack_after:
            start = min([s for _, s in popped] + [i])
            found[i] = Value(name, start, i)
            stack.append((i, start))
    return list(found.values())


def binget(index: int) -> bytes:
    return pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


class Mutator:
    """Mutations of one pickle: `case(seed)` gives the mutated bytes and what was done."""

    def __init__(self, data: bytes) -> None:
        self.ops = opcodes(data)
        self.values = [v for v in values(self.ops) if v.kind not in ("PROTO", "STOP")]
        self.memoized = [v for v in self.values if v.memo is not None and v.kind in SHARED_KINDS]
        self.ints = [i for i, (name, _, _) in enumerate(self.ops) if name in ("BININT1", "BININT2", "BININT", "LONG1")]
        self.strings = [i for i, (name, _, _) in enumerate(self.ops) if "UNICODE" in name]
        self.texts = sorted({str(self.ops[i][1]) for i in self.strings})
        self.dtypes = [i for i in self.strings if self.ops[i][1] in ("float32", "bfloat16", "int64")]

    def case(self, seed: int) -> tuple[bytes, list[str]]:
        rng = random.Random(seed)
        edits: list[tuple[int, int, bytes]] = []
        done = []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            operator = rng.choices(list(OPERATORS), weights=[w for _, w in OPERATORS.values()])[0]
            new_edits, what = OPERATORS[operator][0](self, rng)
            edits += new_edits
            done.append(f"{operator}: {what}")
        raw = [r for _, _, r in self.ops]
        for position, removed, inserted in sorted(edits, key=lambda e: e[0], reverse=True):
            raw[position : position + removed] = [inserted]
        return b"".join(raw), done

    def share(self, rng: random.Random, same_kind: bool = True) -> tuple[list, str]:
        source = rng.choice(self.memoized)
        later = [v for v in self.values if v.start > source.end and (not same_kind or v.kind == source.kind)]
        if not later:
            return [], "nothing to share"
        target = rng.choice(later)
        edit = (target.end + 1, 0, pickle.POP + binget(source.memo))
        return [edit], f"the {target.kind} at {target.start} replaced by the memo's {source.kind} {source.memo}"

    def share_any(self, rng: random.Random) -> tuple[list, str]:
        return self.share(rng, same_kind=False)

    def integer(self, rng: random.Random) -> tuple[list, str]:
        at, value = rng.choice(self.ints), rng.choice([*INTS, rng.randint(-1000, 1000)])
        return [(at, 1, integer(value))], f"int {self.ops[at][1]} at {at} -> {value}"

    def string(self, rng: random.Random) -> tuple[list, str]:
        at, value = rng.choice(self.strings), rng.choice([*STRINGS, rng.choice(self.texts)])
        return [(at, 1, text(value))], f"string {self.ops[at][1]!r} at {at} -> {value[:40]!r}"

    def dtype(self, rng: random.Random) -> tuple[list, str]:
        at, value = rng.choice(self.dtypes), rng.choice(DTYPES)
        return [(at, 1, text(value))], f"dtype {self.ops[at][1]} at {at} -> {value}"

    def opcode(self, rng: random.Random) -> tuple[list, str]:
        bare = [i for i, (_, _, raw) in enumerate(self.ops) if len(raw) == 1 and i > 0]
        at, value = rng.choice(bare), rng.choice(BARE)
        return [(at, 1, value)], f"{self.ops[at][0]} at {at} -> {pickletools.code2op[chr(value[0])].name}"

    def delete(self, rng: random.Random) -> tuple[list, str]:
        at = rng.randrange(1, len(self.ops) - 1)
        return [(at, 1, b"")], f"{self.ops[at][0]} at {at} deleted"

    def duplicate(self, rng: random.Random) -> tuple[list, str]:
        at = rng.randrange(1, len(self.ops) - 1)
        return [(at, 0, self.ops[at][2])], f"{self.ops[at][0]} at {at} doubled"

    def nest(self, rng: random.Random) -> tuple[list, str]:
        target, n = rng.choice(self.values), rng.choice((1, 2, 8, 31, 32, 33, 500))
        close = rng.choice((pickle.TUPLE, pickle.LIST, pickle.FROZENSET))
        edits = [(target.start, 0, pickle.MARK * n), (target.end + 1, 0, close * n)]
        return edits, f"the {target.kind} at {target.start} nested {n} deep in {close!r}"

    def deep(self, rng: random.Random) -> tuple[list, str]:
        target, n = rng.choice(self.values), rng.choice((31, 32, 33, 1000, 100_000))
        nested = rng.choice((deep_tuple, deep_list))
        return [(target.end + 1, 0, pickle.POP + nested(n))], f"the {target.kind} at {target.start} -> {n} deep"

    def fragment(self, rng: random.Random) -> tuple[list, str]:
        target, fragment = rng.choice(self.values), rng.choice(FRAGMENTS)
        return [(target.end + 1, 0, pickle.POP + fragment)], f"the {target.kind} at {target.start} -> {fragment[:24]!r}"

    def memo_reference(self, rng: random.Random) -> tuple[list, str]:
        gets = [i for i, (name, _, _) in enumerate(self.ops) if name in MEMO_GETS]
        at, index = rng.choice(gets), rng.choice((0, rng.randrange(len(self.memoized) + 5), 10**6))
        return [(at, 1, binget(index))], f"memo reference at {at} -> {index}"

    def truncate(self, rng: random.Random) -> tuple[list, str]:
        at = rng.randrange(1, len(self.ops))
        return [(at, len(self.ops) - at, rng.choice((b"", pickle.STOP)))], f"cut at {at}"


# name: (operator, weight)
OPERATORS = {
    "share": (Mutator.share, 15),
    "share any": (Mutator.share_any, 5),
    "int": (Mutator.integer, 15),
    "string": (Mutator.string, 12),
    "dtype": (Mutator.dtype, 6),
    "opcode": (Mutator.opcode, 10),
    "delete": (Mutator.delete, 7),
    "duplicate": (Mutator.duplicate, 5),
    "nest": (Mutator.nest, 8),
    "deep": (Mutator.deep, 5),
    "fragment": (Mutator.fragment, 4),
    "memo": (Mutator.memo_reference, 5),
    "truncate": (Mutator.truncate, 3),
}
