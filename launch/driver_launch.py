"""A Triton kernel launch in driver form: what `cuLaunchKernelEx` takes, for launching from C.

Why: the PIECEWISE step graph (runner/cudagraph/step_graph.py) holds the step's attention launch
as one kernel node per layer, three pointers changed between them. It needs the launch the way
Triton's own launcher makes it: the CUfunction; grid, 32 * num_warps threads, shared bytes; and the
kernel-parameter buffer, every non-constexpr argument in signature order
(pointers as 64-bit addresses, integers at their width, floats as their bit patterns), then the
global and profile scratch pointers (0: a kernel that needs scratch is refused). Anything this
module does not know to lay out the same way (clusters, cooperative launches, tensor descriptors,
bf16 scalars, tuples) gets None, and the caller keeps Triton's launcher. Pure Python: tested on a CPU with fake kernels;
a GPU test checks it against Triton's launch bit for bit.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any, Sequence

logger = logging.getLogger(__name__)

PATCHED_ARGS = 3
"""The launch's first three arguments are what changes between layers (q, KV cache, out)."""

_SLOT = 8
"""Each kernel parameter gets an 8-byte slot of the parameter buffer (the driver copies only the
parameter's own size from the address it is given, so wider slots are harmless)."""

_FORMATS = {"i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
            "i64": "q", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
"""struct codes of the scalar types Triton passes by value (pointers, '*...', are 'Q'); bf16 is
missing on purpose (struct has no bf16: such a kernel keeps Triton's launcher)."""


class KernelLaunch:
    """One Triton kernel in driver form, reused for every launch of it: `blob` holds the parameters
    (8-byte slots), `params` the address of each slot, `config` the grid x, y, z, threads per block,
    shared bytes. `bind(grid, args)` sets one launch's grid and parameters; the first PATCHED_ARGS
    slots are what the step graph overwrites per layer. Reusing one buffer is
    safe because the driver copies the parameters when the launch is issued."""

    def __init__(self, function: int, threads: int, shared: int, formats: str, indices: Sequence[int]) -> None:
        self.function = function
        self.config = (ctypes.c_uint32 * 5)(1, 1, 1, threads, shared)
        self.format = "<" + formats
        self.indices = tuple(indices)
        """Positions of the non-constexpr arguments (what the kernel takes, in order)."""
        num_params = len(self.indices) + 2                  # + global and profile scratch: 0
        self.blob = (ctypes.c_uint64 * num_params)()
        base = ctypes.addressof(self.blob)
        self.params = (ctypes.c_void_p * num_params)(*(base + _SLOT * i for i in range(num_params)))

    def bind(self, grid: Sequence[int], args: Sequence[Any]) -> None:
        config = self.config
        config[0] = grid[0]
        config[1] = grid[1] if len(grid) > 1 else 1
        config[2] = grid[2] if len(grid) > 2 else 1
        struct.pack_into(self.format, self.blob, 0, *[args[i] for i in self.indices])


def _slot_format(kind: str) -> str | None:
    if kind.startswith("*"):
        return "Q"
    code = _FORMATS.get(kind)
    if code is None:
        return None
    return code + f"{_SLOT - struct.calcsize('<' + code)}x"


_launches: dict[int, tuple[Any, KernelLaunch | None]] = {}


def kernel_launch(kernel: Any, grid: Sequence[int], args: Sequence[Any]) -> KernelLaunch | None:
    """`kernel` (a Triton CompiledKernel) on `grid` with `args` (every parameter in signature order,
    constexprs included, pointers as ints) in driver form, or None where that form is not known to
    be right (the reason logged at debug level). The form is worked out once per kernel (held, so
    its id is never reused); the caller vouches that later calls pass arguments of the same types."""
    held = _launches.get(id(kernel))
    if held is None:
        held = _launches[id(kernel)] = (kernel, _driver_form(kernel, args))
    launch = held[1]
    if launch is not None:
        launch.bind(grid, args)
    return launch


def _driver_form(kernel: Any, args: Sequence[Any]) -> KernelLaunch | None:
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    metadata = getattr(kernel, "metadata", None)
    if not isinstance(signature, dict) or metadata is None or len(signature) != len(args):
        return _refused("no signature matching the arguments")
    if getattr(metadata, "num_ctas", 1) != 1:
        return _refused("a cluster launch (num_ctas != 1)")
    if getattr(metadata, "launch_cooperative_grid", False):
        return _refused("a cooperative launch")
    if getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
        return _refused("the kernel needs per-launch scratch")
    if getattr(metadata, "tensordesc_meta", None):
        return _refused("tensor descriptors")
    kinds = list(signature.values())
    formats, indices = [], []
    for i, (kind, value) in enumerate(zip(kinds, args)):
        if kind == "constexpr":
            continue
        code = _slot_format(kind) if isinstance(kind, str) else None
        if code is None or (kind.startswith("*") and type(value) is not int):
            return _refused(f"parameter {i}: type {kind!r} with a {type(value).__name__}")
        formats.append(code)
        indices.append(i)
    if indices[:PATCHED_ARGS] != list(range(PATCHED_ARGS)) or any(not k.startswith("*") for k in kinds[:PATCHED_ARGS]):
        return _refused("the first three parameters are not pointers")
    return KernelLaunch(int(kernel.function), 32 * metadata.num_warps, metadata.shared, "".join(formats), indices)


def _refused(why: str) -> None:
    logger.debug("PIECEWISE step graph: launch not in driver form: %s", why)
    return None
