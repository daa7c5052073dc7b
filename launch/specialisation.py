"""What Triton specialises a compiled kernel on, for one call's positional arguments: the key
both `FastLaunch` (which kernel to relaunch) and `compile_ahead` (which compile is already
queued) compute.

Per parameter kind: a constexpr by value; an int by (== 1, % 16 == 0, fits in 32 bits), or for a
`do_not_specialize` parameter only by whether it fits in 32 bits; a float, bool or None not at all
(None); anything else is a tensor, by dtype and 16-byte alignment.
"""

from __future__ import annotations

from typing import Any

CONSTEXPR, SPECIALISED, PLAIN = 0, 1, 2
I32_MIN, I32_MAX = -(2 ** 31), 2 ** 31 - 1


def param_kinds(fn: Any) -> tuple[int, ...] | None:
    """How each parameter of `fn` enters the key, or None when `fn` is not a compiled
    JITFunction (Triton's interpreter, a missing `params` list)."""
    params = getattr(fn, "params", None)
    if params is None or not hasattr(fn, "device_caches"):
        return None
    return tuple(CONSTEXPR if p.is_constexpr else PLAIN if p.do_not_specialize else SPECIALISED for p in params)


def specialisation(args: tuple, kinds: tuple[int, ...]) -> list:
    """The key's part for each argument (see the module docstring)."""
    key = []
    for arg, kind in zip(args, kinds):
        if kind == CONSTEXPR:
            key.append(arg)
        elif type(arg) is int:
            fits = I32_MIN <= arg <= I32_MAX
            key.append((arg == 1, arg % 16 == 0, fits) if kind == SPECIALISED else fits)
        elif type(arg) is float or type(arg) is bool or arg is None:
            key.append(None)
        else:
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
    return key
