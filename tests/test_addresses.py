"""CPU tests for the debug address check (runner/cudagraph/addresses.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest
import torch

from runner.cudagraph.addresses import AddressMismatchError, AddressRecorder, check_addresses, tensor_addresses


def t(n: int = 4) -> torch.Tensor:
    return torch.zeros(n)


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclass
class Meta:
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int = 1
    per_layer: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        raise AssertionError("property getter must not be called")


@dataclass(frozen=True)
class Frozen:
    a: torch.Tensor


@dataclass(slots=True)
class Slotted:
    a: torch.Tensor
    b: Any = None


@dataclass(slots=True)
class SlottedChild(Slotted):
    c: torch.Tensor | None = None


class Plain:
    def __init__(self, x):
        self.x = x

    @property
    def boom(self):
        raise AssertionError("property getter must not be called")

    def __getattr__(self, name):
        raise AssertionError(f"__getattr__({name!r}) must not be called")


class Base:
    __slots__ = ("base_t", "unset", "__private")

    def __init__(self, base_t, private):
        self.base_t = base_t
        self.__private = private


class Child(Base):
    __slots__ = "child_t"  # a lone string is a single slot

    def __init__(self, base_t, private, child_t):
        super().__init__(base_t, private)
        self.child_t = child_t


class ClassAttr:
    shared = torch.zeros(2)  # a class attribute: not instance state, not visited

    def __init__(self):
        self.own = torch.zeros(2)


class Color(enum.Enum):
    RED = 1


def test_dict_list_tuple_paths():
    a, b, c, d = t(), t(), t(), t()
    obj = {"x": a, "layers.0": [b, (1, c)], 3: None, (0, 1): d}
    assert tensor_addresses(obj, "kwargs") == {
        "kwargs[x]": a.data_ptr(),
        "kwargs[(0, 1)]": d.data_ptr(),
        "kwargs[layers.0][0]": b.data_ptr(),
        "kwargs[layers.0][1][1]": c.data_ptr(),
    }


def test_top_level_without_prefix_has_no_leading_dot():
    a, b = t(), t()
    assert tensor_addresses(Plain(a)) == {"x": a.data_ptr()}
    assert tensor_addresses([a]) == {"[0]": a.data_ptr()}
    assert tensor_addresses(b) == {"": b.data_ptr()}
    assert tensor_addresses(b, "input_ids") == {"input_ids": b.data_ptr()}


def test_namedtuple_by_field_name():
    a, b = t(), t()
    assert tensor_addresses(Pair(a, [b]), "p") == {"p.first": a.data_ptr(), "p.second[0]": b.data_ptr()}


def test_dataclass_nested_per_layer_and_property_not_called():
    s, m, k = t(), t(), t()
    meta = Meta(s, m, per_layer={"layers.0": (None, k)})
    assert tensor_addresses(meta, "attn_metadata") == {
        "attn_metadata.seq_lens": s.data_ptr(),
        "attn_metadata.slot_mapping": m.data_ptr(),
        "attn_metadata.per_layer[layers.0][1]": k.data_ptr(),
    }


def test_frozen_and_slots_dataclasses():
    a, b, c = t(), t(), t()
    assert tensor_addresses(Frozen(a), "f") == {"f.a": a.data_ptr()}
    assert tensor_addresses(Slotted(a, [b]), "s") == {"s.a": a.data_ptr(), "s.b[0]": b.data_ptr()}
    assert tensor_addresses(SlottedChild(a, None, c), "s") == {"s.a": a.data_ptr(), "s.c": c.data_ptr()}


def test_object_with_dict_ignores_properties_getattr_and_class_attributes():
    a = t()
    assert tensor_addresses(Plain({"k": a}), "o") == {"o.x[k]": a.data_ptr()}
    obj = ClassAttr()
    assert tensor_addresses(obj, "o") == {"o.own": obj.own.data_ptr()}


def test_slots_inherited_private_and_unset():
    a, b, c = t(), t(), t()
    obj = Child(a, b, c)
    assert tensor_addresses(obj, "o") == {
        "o.base_t": a.data_ptr(),
        "o._Base__private": b.data_ptr(),
        "o.child_t": c.data_ptr(),
    }  # "unset" was never assigned: skipped, no error


def test_other_mappings_and_leaves():
    a = t()
    obj = [MappingProxyType({"a": a}), 1, 2.0, "s", b"b", None, True, Color.RED, torch.float16,
           torch.device("cpu"), torch.Size([2, 3]), len, test_other_mappings_and_leaves, torch, Plain]
    assert tensor_addresses(obj) == {"[0][a]": a.data_ptr()}


def test_module_not_descended():
    lin = torch.nn.Linear(2, 2)
    a = t()
    assert tensor_addresses({"model": lin, "x": a}) == {"[x]": a.data_ptr()}


def test_cycles():
    a, b = t(), t()
    loop = [a]
    loop.append(loop)
    assert tensor_addresses(loop, "l") == {"l[0]": a.data_ptr()}
    obj = Plain(b)
    obj.me = obj
    assert tensor_addresses(obj, "o") == {"o.x": b.data_ptr()}
    d: dict = {"a": a}
    d["d"] = d
    assert tensor_addresses(d) == {"[a]": a.data_ptr()}


def test_shared_tensor_and_container_listed_under_every_path():
    a = t()
    inner = [a]
    assert tensor_addresses({"x": inner, "y": inner, "z": a}) == {
        "[x][0]": a.data_ptr(), "[y][0]": a.data_ptr(), "[z]": a.data_ptr()}


def test_views_share_storage_but_keep_their_own_address():
    base = torch.zeros(8)
    view = base[4:]
    out = tensor_addresses({"base": base, "view": view})
    assert out["[view]"] == out["[base]"] + 4 * base.element_size()


def test_check_addresses_equal_is_silent():
    check_addresses({"a": 1, "b": 2}, {"b": 2, "a": 1})
    check_addresses({}, {})


def test_moved_tensor_named_with_old_and_new_address():
    s, k = t(), t()
    args = (t(),)
    meta = Meta(s, t(), per_layer={"layers.0": (None, k)})
    rec = AddressRecorder()
    rec.record(args=args, kwargs={}, attn_metadata=meta)
    moved = k.clone()  # k stays alive, so the clone cannot reuse its address
    meta.per_layer["layers.0"] = (None, moved)
    with pytest.raises(AddressMismatchError) as info:
        rec.check(args=args, kwargs={}, attn_metadata=meta)
    msg = str(info.value)
    assert msg.startswith("graph replay: tensor addresses differ from capture: 0 missing, 0 added, 1 changed")
    assert msg.endswith(f"\n  attn_metadata.per_layer[layers.0][1]: 0x{k.data_ptr():x} -> 0x{moved.data_ptr():x}")


def test_recorder_unchanged_replay_passes():
    args = (t(), t())
    meta = Meta(t(), t(), per_layer={f"layers.{i}": (t(), t()) for i in range(3)})
    rec = AddressRecorder("FULL replay bs=4")
    positions = t()
    rec.record(args=args, kwargs={"positions": positions}, attn_metadata=meta)
    meta.seq_lens.fill_(7)  # in-place copies keep the address
    meta.num_reqs = 3  # ints may change freely
    rec.check(args=args, kwargs={"positions": positions}, attn_metadata=meta)


def test_missing_added_and_changed_sorted_in_message():
    expected = {"b": 0x10, "a": 0x20, "gone": 0x30, "z": 0x40}
    actual = {"b": 0x11, "a": 0x21, "new": 0x50, "z": 0x40}
    with pytest.raises(AddressMismatchError) as info:
        check_addresses(expected, actual, what="FULL replay bs=8")
    assert str(info.value).splitlines() == [
        "FULL replay bs=8: tensor addresses differ from capture: 1 missing, 1 added, 2 changed "
        "(copy new values into the captured tensors instead of rebinding)",
        "missing:",
        "  gone: 0x30 -> (absent)",
        "added:",
        "  new: (absent) -> 0x50",
        "changed:",
        "  a: 0x20 -> 0x21",
        "  b: 0x10 -> 0x11",
    ]
    assert isinstance(info.value, RuntimeError)


def test_recorder_missing_and_added_paths():
    a, b = t(), t()
    rec = AddressRecorder()
    rec.record(kwargs={"a": a})
    with pytest.raises(AddressMismatchError, match=r"1 missing, 1 added, 0 changed") as info:
        rec.check(kwargs={"b": b})
    assert "kwargs[a]: 0x" in str(info.value) and "kwargs[b]: (absent) -> 0x" in str(info.value)


def test_recorder_check_before_record():
    with pytest.raises(RuntimeError, match="before record"):
        AddressRecorder().check(args=())


def test_realistic_structure_completes():
    """The shape `graphrunner bench addresses` times; here only that it runs and finds all tensors."""
    args = tuple(t() for _ in range(5))
    kwargs = {f"k{i}": t() for i in range(5)}
    meta = Meta(t(), t(), per_layer={f"layers.{i}": (t(), t()) for i in range(30)})
    out = tensor_addresses({"args": args, "kwargs": kwargs, "attn_metadata": meta})
    assert len(out) == 5 + 5 + 2 + 60
