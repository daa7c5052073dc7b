"""A stand-in for a kernel's launcher that records what Triton would specialise each launch on
(launch/specialisation.py) instead of launching: the set of keys is the set of variants the
calls compile. Works on a compiled JITFunction and on the interpreter's (CPU CI), whose
parameter kinds it reads from the kernel's signature and `do_not_specialize`.

Usage from a test (tests/ is on sys.path): `from launch_keys import RecordingLaunch`."""

from __future__ import annotations

import inspect

from launch.specialisation import CONSTEXPR, PLAIN, SPECIALISED, param_kinds, specialisation


class RecordingLaunch:
    def __init__(self, fn, name: str, keys: dict[str, set]) -> None:
        self.name, self.keys = name, keys
        self.kinds = param_kinds(fn) or tuple(
            CONSTEXPR if "constexpr" in str(p.annotation)
            else PLAIN if p.name in (fn.kwargs.get("do_not_specialize") or ()) else SPECIALISED
            for p in inspect.signature(fn.fn).parameters.values())

    def __call__(self, grid, *args, **options) -> None:
        self.keys.setdefault(self.name, set()).add(tuple(specialisation(args, self.kinds)))
