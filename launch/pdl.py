"""Programmatic dependent launch (PDL): let a decode kernel start while the one before it ends.

Why: a small model's decode step replayed from a CUDA graph is a chain of ~100-170 short kernels
(SmolLM2-135M on an H100: 3-6 us each, `graphrunner bench profile_step --mode FULL --batch-size 1`),
and each one pays a launch gap and then the DRAM latency of its
first weight loads before any math happens. With PDL (Hopper and newer) a kernel launched with
the programmatic-stream-serialization attribute may be scheduled once every program of the kernel
before it has signalled `gdc_launch_dependents` (or exited). It then issues the loads that do not
depend on earlier kernels (its weights) and blocks in `gdc_wait` until the earlier kernel has
finished and its memory is visible. CUDA graph capture records the same programmatic edges.

The contract every kernel launched with `launch_pdl=True` keeps (`wait_for_producers`):
- before the wait it reads only memory no kernel of the step writes, and writes nothing: weights,
  constant tables (RoPE's cos/sin), and the step's metadata (positions, slots, query_start_loc,
  seq_lens, block table), which the host uploads before the step's first kernel. Why that is safe
  even though only the kernel right before is overlapped: a kernel is scheduled only after its
  predecessor passed its own wait, i.e. after every kernel before that one (and every copy, which
  never overlaps) has finished;
- everything else (activations, metadata, KV cache, scratch, its outputs: a buffer it writes may
  still be read by the kernel before it) comes after the wait;
- it signals its dependents only after its own wait, so at most two kernels overlap and the
  chain of waits orders every kernel after all earlier ones.
A kernel launched without the attribute (torch's, cuBLAS's) waits for full completion as usual.
The PDL flag is a constexpr: with it off (older GPUs, Triton's interpreter on a CPU, or
KernelConfig.pdl=False) the kernels compile exactly as before.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from configs.kernel_config import active_kernel_config

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never launch with PDL
    gdc_launch_dependents = gdc_wait = None



@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(device_index)


def use_pdl(device) -> bool:
    """Whether kernels on `device` (a torch.device) launch with PDL: CUDA, compute capability 9.0
    or newer (griddepcontrol is sm_90+ PTX), a Triton with grid dependency control, and not switched
    off (KernelConfig.pdl)."""
    if device.type != "cuda" or gdc_wait is None or not active_kernel_config().pdl:
        return False
    import torch
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_options(device) -> dict:
    """Keyword arguments for `kernel[grid](...)` of a kernel with a `PDL` constexpr that calls
    `wait_for_producers(PDL)`: the constexpr and the launch option together."""
    pdl = use_pdl(device)
    return dict(PDL=pdl, launch_pdl=pdl)


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one has finished (its writes visible), then let
    the next kernel be scheduled. Call it after the loads of weights and before anything else."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
