"""Check that a CUDA graph replays with the tensor addresses it was captured with.

A graph bakes in the device pointers it saw at capture. If a replay's inputs or attention
metadata hold a *different* tensor (rebound instead of copied into the static buffer),
the graph silently reads stale memory. Capture records `path -> data_ptr` for every reachable
tensor and a replay compares, naming the paths that moved (e.g.
`attn_metadata.seq_lens: 0x7f.. -> 0x7f..`). By default (`AddressCheck.FIRST_REPLAY`) each
graph is checked on its first replay only: a runner that rebinds a tensor does so on every
step, so the first replay of each graph catches it and serving pays nothing afterwards.
Debug mode (`EVERY_REPLAY`) checks every replay; the walk caches a plan per type and never
calls user code it does not need, so that stays cheap enough for tests.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Mapping

import torch

_LEAF, _TENSOR, _MAPPING, _SEQUENCE, _NAMEDTUPLE, _OBJECT = range(6)
# Tensor-free values and things never descended into: nn.Module (fixed parameters, large
# trees), classes, functions, methods and modules.
_SKIPPED = (type(None), bool, int, float, complex, str, bytes, bytearray, range, slice, enum.Enum,
            torch.dtype, torch.device, torch.Size, torch.nn.Module, type, types.FunctionType,
            types.BuiltinFunctionType, types.MethodType, types.ModuleType, functools.partial)
_plans: dict[type, tuple[int, tuple]] = {}


def _make_plan(tp: type) -> tuple[int, tuple]:
    """How to walk instances of `tp`: decided once per type, so the walk is a dict lookup."""
    if issubclass(tp, _SKIPPED):
        return _LEAF, ()
    if issubclass(tp, torch.Tensor):
        return _TENSOR, ()
    if issubclass(tp, Mapping):
        return _MAPPING, ()
    if issubclass(tp, tuple) and hasattr(tp, "_fields"):
        return _NAMEDTUPLE, tuple(tp._fields)
    if issubclass(tp, (list, tuple)):
        return _SEQUENCE, ()
    # Instance state only, read through the type's own descriptors: never getattr, so
    # properties, __getattr__ and class attributes are not touched.
    readers = []
    for cls in reversed(tp.__mro__):
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # private names are mangled
            desc = cls.__dict__.get(name)
            if isinstance(desc, types.MemberDescriptorType):
                readers.append((name, desc))
    dict_desc = next((c.__dict__["__dict__"] for c in tp.__mro__ if "__dict__" in c.__dict__), None)
    has_dict = isinstance(dict_desc, types.GetSetDescriptorType)
    if not readers and not has_dict:
        return _LEAF, ()
    return _OBJECT, (tuple(readers), dict_desc if has_dict else None)


def _attributes(obj, readers, dict_desc):
    for name, desc in readers:
        try:
            yield name, desc.__get__(obj)
        except AttributeError:  # slot never assigned
            pass
    if dict_desc is not None:
        yield from dict_desc.__get__(obj).items()


def _walk(obj, path: str, out: dict[str, int], on_path: set[int]) -> None:
    tp = type(obj)
    kind, info = _plans.get(tp) or _plans.setdefault(tp, _make_plan(tp))
    if kind == _LEAF:
        return
    if kind == _TENSOR:
        out[path] = obj.data_ptr()
        return
    oid = id(obj)
    if oid in on_path:  # a reference cycle: this container is already being walked
        return
    on_path.add(oid)
    dot = path + "." if path else ""
    if kind == _MAPPING:
        for key, value in obj.items():
            _walk(value, f"{path}[{key}]", out, on_path)
    elif kind == _SEQUENCE:
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", out, on_path)
    elif kind == _NAMEDTUPLE:
        for name, value in zip(info, obj):
            _walk(value, dot + name, out, on_path)
    else:
        for name, value in _attributes(obj, *info):
            _walk(value, dot + name, out, on_path)
    on_path.discard(oid)


def tensor_addresses(obj, prefix: str = "") -> dict[str, int]:
    """`path -> tensor.data_ptr()` for every tensor reachable from `obj`.

    Descends mappings (`prefix[key]`, key via str()), lists and tuples (`prefix[3]`),
    NamedTuples (`prefix.field`) and objects with `__dict__` and/or `__slots__` (inherited
    slots too; unset slots skipped; dataclasses are such objects: `prefix.field`). Instance
    state is read through descriptors, so properties are never evaluated and class
    attributes are not visited. Does not descend into torch.nn.Module (its parameters never
    move and are many), classes, functions, methods or modules; sets are not walked.
    A container already on the current path is skipped (cycles); a tensor or container
    reachable by two paths is listed under both. Without a prefix, paths start without a dot.
    """
    out: dict[str, int] = {}
    _walk(obj, prefix, out, set())
    return out


class AddressMismatchError(RuntimeError):
    """A replay saw tensors at other addresses than its capture: the graph would read stale memory."""


def check_addresses(expected: dict[str, int], actual: dict[str, int], what: str = "graph replay") -> None:
    """Raise AddressMismatchError naming every missing, added and changed path; None if equal."""
    if expected == actual:
        return
    missing = sorted(expected.keys() - actual.keys())
    added = sorted(actual.keys() - expected.keys())
    changed = sorted(p for p in expected.keys() & actual.keys() if expected[p] != actual[p])
    lines = [f"{what}: tensor addresses differ from capture: {len(missing)} missing, {len(added)} added, "
             f"{len(changed)} changed (copy new values into the captured tensors instead of rebinding)"]
    for title, paths in (("missing", missing), ("added", added), ("changed", changed)):
        if paths:
            lines.append(f"{title}:")
        for p in paths:
            old = f"0x{expected[p]:x}" if p in expected else "(absent)"
            new = f"0x{actual[p]:x}" if p in actual else "(absent)"
            lines.append(f"  {p}: {old} -> {new}")
    raise AddressMismatchError("\n".join(lines))


class AddressRecorder:
    """Records addresses at capture (`record(args=..., kwargs=..., attn_metadata=...)`) and
    compares each replay's (`check` with the same names) against them."""

    def __init__(self, what: str = "graph replay") -> None:
        self.what = what
        self.expected: dict[str, int] | None = None

    def record(self, **named_objects) -> None:
        self.expected = self._addresses(named_objects)

    def check(self, **named_objects) -> None:
        if self.expected is None:
            raise RuntimeError(f"{self.what}: AddressRecorder.check() called before record()")
        check_addresses(self.expected, self._addresses(named_objects), self.what)

    @staticmethod
    def _addresses(named_objects: dict) -> dict[str, int]:
        return {path: ptr for name, obj in named_objects.items()
                for path, ptr in tensor_addresses(obj, name).items()}


class AddressCheck(enum.Enum):
    """When a graph's replay addresses are compared with its capture's."""
    OFF = "off"
    FIRST_REPLAY = "first_replay"
    """Once per graph, on its first replay (the default)."""
    EVERY_REPLAY = "every_replay"
    """On every replay (debug)."""

    @classmethod
    def of(cls, value: "AddressCheck | bool") -> "AddressCheck":
        """An AddressCheck as given, or a bool meaning the debug flag: True checks every replay,
        False none. (GRAPHRUNNER_DEBUG_CUDAGRAPH=1 sets CompilationConfig.debug_cudagraph_addresses'
        default, where the config is built.)"""
        if isinstance(value, bool):
            value = cls.EVERY_REPLAY if value else cls.OFF
        return value

    @classmethod
    def from_config(cls, check: bool, debug: bool) -> "AddressCheck":
        """CompilationConfig's check_cudagraph_addresses / debug_cudagraph_addresses."""
        return cls.of(cls.EVERY_REPLAY if debug else cls.FIRST_REPLAY if check else cls.OFF)
