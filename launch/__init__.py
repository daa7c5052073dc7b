"""Kernel launch machinery, below every package that launches kernels (attention, models, runner).

What is here is about HOW a kernel gets onto the device, never what it computes (kernels live beside
what they compute: attention kernels in attention/kernels, the layers' kernels in models/):
- `fast_launch`: relaunch a compiled Triton kernel without `JITFunction.run`'s per-call work;
- `compile_ahead`: compile Triton kernels on worker threads ahead of their first launch;
- `specialisation`: the key Triton specialises a compiled kernel on (shared by the two above);
- `pdl`: programmatic dependent launch (the kernels' wait/launch-dependents contract);
- `driver_launch`: a Triton launch in driver form (`cuLaunchKernelEx`'s arguments), for the step graph;
- `native_build`: compile a small C source into a cached shared library (step graph, CPU kernels);
- `break_point`: the hook a PIECEWISE capture breaks the graph at (the attention op is one), and the
  typed protocol between a break's prepared replay and the runner's step graph.

Imports: configs only (tests/test_layering.py checks it).
"""
