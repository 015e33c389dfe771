"""Screening a model file's pickle for allocations before ``torch.load`` unpickles it.

``torch.load(weights_only=True)`` refuses arbitrary classes, but its allow-list still holds callables that
allocate memory from a number in the file: ``bytearray(10**12)`` (a 1.3 KB file asking for a terabyte),
``torch._utils._rebuild_qtensor`` with a size of ``(10**6, 10**6)``, a legacy file's storage of 10**12
elements. :func:`scan_model_file` reads the pickle's opcodes with the standard library's
:func:`pickletools.genops` (nothing is unpickled, nothing is allocated beyond the file's own bytes), follows
the unpickler's stack abstractly, and refuses (:class:`UnsafeModelFileError`) a file that:

- imports a callable that allocates from a number argument (:data:`ALLOCATING`: ``bytearray``, ``bytes``,
  numpy's and torch's array factories);
- passes a call an integer above :data:`MAX_COUNT` (2**31), or a tuple of integers (a shape) whose product is
  above it, anywhere in its arguments; the tensor rebuilders whose memory is the file's own storage record
  (:data:`STORAGE_BOUNDED`: torch checks their sizes against it) are exempt;
- declares a storage (its persistent id) of more elements than the bytes that hold it.

Files: a zip (torch >= 1.6, told by its first bytes as ``torch.load`` tells it: every ``*.pkl`` record, usually
``<archive>/data.pkl``; a zip that cannot be read is refused) or a legacy file (the pickles at its start, up to
the storage data); a tar-format file (PyTorch < 0.4) is refused. Where the opcodes stop parsing, the unpickler would stop there
too (it reads the same opcodes in the same order), so the scan ends and ``torch.load`` reports the damage.
"""

from __future__ import annotations

import os
import pickletools
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["ALLOCATING", "MAX_COUNT", "STORAGE_BOUNDED", "UnsafeModelFileError", "scan_model_file"]

#: The largest count (an integer argument, or a shape's product) a call in a model file may be given.
MAX_COUNT = 2**31
#: Callables that allocate memory from a number argument: never in a model file.
ALLOCATING = frozenset({
    f"{module}.{name}" for module in ("builtins", "__builtin__") for name in ("bytearray", "bytes")
} | {f"numpy.{name}" for name in ("zeros", "ones", "empty", "full", "arange", "ndarray")} | {
    f"torch.{name}" for name in ("zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "empty_strided")
})
#: Tensor rebuilders whose memory is a storage record of the file: torch checks size and stride against it.
STORAGE_BOUNDED = frozenset({
    "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
})
#: Legacy (non-zip) torch files: magic number, protocol, system info, the object, the storage keys.
_LEGACY_PICKLES = 5
#: The first bytes of a zip file (a local file header): torch.load's test for its zip format.
_ZIP_MAGIC = b"PK\x03\x04"
#: Nesting followed inside call arguments (deeper tuples are not shapes).
_MAX_DEPTH = 8


class UnsafeModelFileError(ValueError):
    """A model file whose pickle would allocate memory from a number on loading; refused before ``torch.load``.

    A ``ValueError``: the commands print it as one line (a file the user gave, not a bug)."""


@dataclass(frozen=True)
class _Global:
    """A callable the pickle imports (``module.name``)."""

    name: str


class _Opaque:
    """A value the scan does not follow (the result of a call, a dict, a float, bytes)."""


_MARK = object()
_OPAQUE = _Opaque()


class _Stop(Exception):
    """The opcodes stop making sense here; the unpickler would fail at the latest here too."""


def scan_model_file(path: str | os.PathLike) -> None:
    """Refuse ``path`` (:class:`UnsafeModelFileError`, naming it and what was found) when its pickle allocates from a
    number (module docstring); return quietly otherwise, also for a file that is no pickle (``torch.load`` says)."""
    p = Path(path)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == _ZIP_MAGIC:  # what torch.load takes for a zip (it looks at the first bytes, as here)
        try:
            zf = zipfile.ZipFile(p)
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            raise UnsafeModelFileError(f"refusing to load {p}: it starts as a zip file but cannot be read as one ({err}); "
                                       "truncated or damaged; its pickle cannot be checked") from None
        with zf:
            records = {info.filename.rsplit("/data/", 1)[1]: info.file_size
                       for info in zf.infolist() if "/data/" in info.filename}
            for info in zf.infolist():
                if info.filename.endswith(".pkl"):
                    with zf.open(info) as f:
                        _Scan(p, records, f"record {info.filename}").run(f, pickles=1)
        return
    with open(p, "rb") as f:
        head = f.read(1)
        f.seek(0)
        if head != b"\x80" and tarfile.is_tarfile(p):
            raise UnsafeModelFileError(f"refusing to load {p}: a tar-format torch file (PyTorch < 0.4); only zip and "
                                       "legacy torch files are checked before loading; re-save it with torch.save")
        size = p.stat().st_size
        _Scan(p, None, "", file_size=size).run(f, pickles=_LEGACY_PICKLES)


class _Scan:
    """The abstract unpickler of one pickle stream: a stack of ints, strings, tuples, lists, imported callables
    and opaque values; every call's callable and arguments are checked as it is reached."""

    def __init__(self, path: Path, records: dict[str, int] | None, where: str, file_size: int = 0) -> None:
        self.path = path
        self.records = records  # zip: storage key -> bytes of its record; None: a legacy file
        self.where = where
        self.file_size = file_size

    def refuse(self, what: str, pos: int) -> UnsafeModelFileError:
        at = f"{self.where}, byte {pos}" if self.where else f"byte {pos}"
        return UnsafeModelFileError(
            f"refusing to load {self.path}: its pickle {what} ({at}); model files hold tensors and plain containers, "
            "and loading this one could exhaust the machine's memory")

    def run(self, f: IO[bytes], pickles: int) -> None:
        """Scan up to ``pickles`` consecutive pickles of ``f``."""
        for _ in range(pickles):
            if not self._one(f):
                return

    def _one(self, f: IO[bytes]) -> bool:
        """Scan one pickle; False when the stream ended or stopped parsing (what was read before is checked all
        the same: the unpickler would have run it)."""
        stack: list[Any] = []
        memo: dict[Any, Any] = {}
        imported: list[tuple[str, int]] = []
        complete = False
        try:
            for op, arg, pos in _ops(f):
                if op.name == "STOP":
                    complete = True
                    break
                self._step(op.name, arg, pos, stack, memo, imported)
        except _Stop:
            pass
        if imported:
            glob, at = imported[0]
            raise self.refuse(f"imports {glob}, a callable that allocates memory from a number", at)
        return complete

    def _step(self, name: str, arg: Any, pos: int, stack: list[Any], memo: dict[Any, Any],
              imported: list[tuple[str, int]]) -> None:
        """Apply one opcode to the abstract stack (pickletools' opcode names)."""
        if name in ("PROTO", "FRAME"):
            return
        if name == "MARK":
            stack.append(_MARK)
        elif name in ("INT", "LONG", "BININT", "BININT1", "BININT2", "LONG1", "LONG4"):
            stack.append(arg if isinstance(arg, int) and not isinstance(arg, bool) else _OPAQUE)
        elif name in ("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"):
            stack.append(str(arg))
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = _pop(stack, n)
            stack.append(tuple(items))
        elif name == "TUPLE":
            stack.append(tuple(_pop_mark(stack)))
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name == "LIST":
            stack.append(list(_pop_mark(stack)))
        elif name == "APPEND":
            value = _pop(stack, 1)[0]
            _extend(stack, [value])
        elif name == "APPENDS":
            _extend(stack, _pop_mark(stack))
        elif name in ("DICT", "FROZENSET"):
            _pop_mark(stack)
            stack.append(_OPAQUE)
        elif name == "SETITEM":
            _pop(stack, 2)
            _top(stack)
        elif name in ("SETITEMS", "ADDITEMS"):
            _pop_mark(stack)
            _top(stack)
        elif name == "BUILD":
            _pop(stack, 1)
            _top(stack)
        elif name in ("GLOBAL", "INST"):
            glob = _Global(".".join(str(arg).split(" ", 1)))
            self._imported(glob, pos, imported)
            if name == "GLOBAL":
                stack.append(glob)
            else:  # INST: the class called on the values since the mark
                self._call(glob, tuple(_pop_mark(stack)), pos, imported)
                stack.append(_OPAQUE)
        elif name == "STACK_GLOBAL":
            module, attr = _pop(stack, 2)
            glob = _Global(f"{module}.{attr}")
            self._imported(glob, pos, imported)
            stack.append(glob)
        elif name == "REDUCE":
            func, args = _pop(stack, 2)
            self._call(func, args, pos, imported)
            stack.append(_OPAQUE)
        elif name == "NEWOBJ":
            cls, args = _pop(stack, 2)
            self._call(cls, args, pos, imported)
            stack.append(_OPAQUE)
        elif name == "NEWOBJ_EX":
            cls, args, _kwargs = _pop(stack, 3)
            self._call(cls, args, pos, imported)
            stack.append(_OPAQUE)
        elif name == "OBJ":
            items = _pop_mark(stack)
            if not items:
                raise _Stop
            self._call(items[0], tuple(items[1:]), pos, imported)
            stack.append(_OPAQUE)
        elif name == "BINPERSID":
            self._persistent(_pop(stack, 1)[0], pos)
            stack.append(_OPAQUE)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = _top(stack)
        elif name == "MEMOIZE":
            memo[len(memo)] = _top(stack)
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise _Stop
            stack.append(memo[arg])
        elif name == "POP":
            _pop(stack, 1)
        elif name == "POP_MARK":
            _pop_mark(stack)
        elif name == "DUP":
            stack.append(_top(stack))
        else:  # None, booleans, floats, bytes, empty dicts and sets, PERSID, extensions, buffers: opaque values
            stack.append(_OPAQUE)

    def _imported(self, glob: _Global, pos: int, imported: list[tuple[str, int]]) -> None:
        if glob.name in ALLOCATING:
            imported.append((glob.name, pos))

    def _call(self, func: Any, args: Any, pos: int, imported: list[tuple[str, int]]) -> None:
        """Refuse a call that allocates from a number (module docstring)."""
        name = func.name if isinstance(func, _Global) else "a computed callable"
        shown = _show(args)
        if name in ALLOCATING:
            raise self.refuse(f"calls {name}{shown}, which allocates memory from its argument", pos)
        if name in STORAGE_BOUNDED or not isinstance(args, (tuple, list)):
            return
        for value in _ints_and_shapes(args, 0):
            if isinstance(value, int) and abs(value) > MAX_COUNT:
                raise self.refuse(f"passes {value} to {name}{shown} (at most {MAX_COUNT} = 2**31 is accepted)", pos)
            if isinstance(value, tuple):
                count = 1
                for v in value:
                    count *= max(abs(v), 1)
                if count > MAX_COUNT:
                    raise self.refuse(f"passes the shape {value} ({count} elements) to {name}{shown} "
                                      f"(at most {MAX_COUNT} = 2**31 is accepted)", pos)

    def _persistent(self, pid: Any, pos: int) -> None:
        """A storage's persistent id ``('storage', type, key, location, numel, ...)``: its elements must fit the
        bytes that hold them (the zip record, or the whole legacy file)."""
        if not (isinstance(pid, tuple) and len(pid) >= 5 and isinstance(pid[4], int)):
            return
        numel, key = pid[4], str(pid[2])
        if self.records is None:
            available, held = self.file_size, "the whole file"
        elif key in self.records:
            available, held = self.records[key], f"its record data/{key}"
        else:
            return  # no such record: torch.load refuses it by name
        if numel < 0 or numel > available:
            raise self.refuse(f"declares a storage of {numel} elements held in {available} bytes ({held})", pos)


def _ops(f: IO[bytes]) -> Iterator[tuple[Any, Any, int]]:
    """:func:`pickletools.genops` over ``f``, ending (not raising) where the opcodes stop parsing."""
    gen = pickletools.genops(f)
    while True:
        try:
            op, arg, pos = next(gen)
        except StopIteration:
            return
        except (ValueError, EOFError, UnicodeDecodeError, OverflowError):
            raise _Stop from None
        yield op, arg, int(pos or 0)


def _pop(stack: list[Any], n: int) -> list[Any]:
    if len(stack) < n or any(v is _MARK for v in stack[len(stack) - n:]):
        raise _Stop
    items = stack[len(stack) - n:]
    del stack[len(stack) - n:]
    return items


def _pop_mark(stack: list[Any]) -> list[Any]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = stack[i + 1:]
            del stack[i:]
            return items
    raise _Stop


def _top(stack: list[Any]) -> Any:
    if not stack or stack[-1] is _MARK:
        raise _Stop
    return stack[-1]


def _extend(stack: list[Any], values: list[Any]) -> None:
    target = _top(stack)
    if isinstance(target, list) and len(target) < MAX_COUNT:
        target.extend(values)


def _ints_and_shapes(value: Any, depth: int) -> Iterator[int | tuple[int, ...]]:
    """Every int in ``value`` (tuples and lists followed), and every tuple or list of two or more ints (a shape)."""
    if isinstance(value, int) and not isinstance(value, bool):
        yield value
    elif isinstance(value, (tuple, list)) and depth < _MAX_DEPTH:
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        if len(value) >= 2 and len(ints) == len(value):
            yield tuple(ints)
        for v in value:
            yield from _ints_and_shapes(v, depth + 1)


def _show(args: Any, limit: int = 80) -> str:
    """The arguments of a call as the message shows them: ``(1000000000000,)``, opaque values as ``...``."""

    def text(v: Any) -> str:
        if isinstance(v, (int, str)):
            return repr(v)
        if isinstance(v, tuple):
            inner = ", ".join(text(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if isinstance(v, list):
            return "[" + ", ".join(text(x) for x in v[:8]) + (", ..." if len(v) > 8 else "") + "]"
        if isinstance(v, _Global):
            return v.name
        return "..."

    out = text(args) if isinstance(args, tuple) else "(...)"
    return out if len(out) <= limit else out[: limit - 4] + "...)"
