"""Where a benchmark's device time goes: the kernels of a torch.profiler recording, per name.

A helper of the benchmarks (no `main`): `bench throughput --profile-kernels N` records one more run
of its workload under torch.profiler (CUDA activity only) and prints the N kernels that took the
most time, the union of the kernel intervals (the time the device was busy) against the span from
the first kernel to the last, and attention's time against the KV reads of the bandwidth bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KernelTotals:
    per_name: dict[str, list[float]] = field(default_factory=dict)
    """name -> [total microseconds, launches]."""
    busy_us: float = 0.0
    """The union of every kernel's interval: time with at least one kernel running."""
    span_us: float = 0.0
    """From the first kernel's start to the last kernel's end."""

    @property
    def total_us(self) -> float:
        return sum(us for us, _ in self.per_name.values())

    def matching_us(self, *words: str, excluding: tuple[str, ...] = ()) -> float:
        """Total time of the kernels whose name holds every word and none of `excluding`."""
        return sum(us for name, (us, _) in self.per_name.items()
                   if all(w in name for w in words) and not any(x in name for x in excluding))


def kernel_totals(intervals: list[tuple[str, float, float]]) -> KernelTotals:
    """Totals of (name, start us, end us) kernel intervals."""
    totals = KernelTotals()
    for name, start, end in intervals:
        entry = totals.per_name.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    ordered = sorted((start, end) for _, start, end in intervals)
    run_start = run_end = None
    for start, end in ordered:
        if run_end is None or start > run_end:
            if run_end is not None:
                totals.busy_us += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    if run_end is not None:
        totals.busy_us += run_end - run_start
        totals.span_us = max(end for _, end in ordered) - ordered[0][0]
    return totals


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device kernel (and copy) a torch.profiler recorded."""
    import torch
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def table(totals: KernelTotals, top: int) -> list[str]:
    """The report's lines: totals, then the `top` kernels by time."""
    total = totals.total_us or 1.0
    lines = [f"kernels: {sum(n for _, n in totals.per_name.values())} launches, {totals.total_us / 1e6:.3f} s in all, "
             f"device busy {totals.busy_us / 1e6:.3f} s of a {totals.span_us / 1e6:.3f} s span"]
    ranked = sorted(totals.per_name.items(), key=lambda item: -item[1][0])[:top]
    for name, (us, n) in ranked:
        lines.append(f"  {us / 1e6:7.3f} s {100 * us / total:5.1f}% {n:7d} x {us / max(n, 1):8.1f} us  {name[:100]}")
    return lines
