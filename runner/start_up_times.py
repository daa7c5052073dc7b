"""Where an engine's start-up time went: load, profile, KV cache, compile, capture (seconds each).

The engine logs them in one INFO line when it is ready (`LLMEngine.start_up_line`) and exposes them
as `LLMEngine.start_up_seconds` (`graphrunner bench startup` prints them). `compile` gathers what was
spent compiling kernels wherever it happened: Triton's compile-ahead (queuing the start-up's compiles,
then waiting for the last of them) and the C libraries built by launch/native_build.py (on a CPU the
first forward builds them, unless the cache already holds them); the phase that triggered a native
build is counted without it, so the phases add up to the wall time they cover.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from launch.native_build import build_seconds

PHASES = ("load", "profile", "kv_cache", "compile", "capture")


class StartUpTimes:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name`, less the native builds inside it (counted as compile)."""
        started, built = time.perf_counter(), build_seconds()
        try:
            yield
        finally:
            native = build_seconds() - built
            self.seconds[name] += time.perf_counter() - started - native
            self.seconds["compile"] += native

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def line(self, total: float) -> str:
        """'load 1.20 s, profile 0.10 s, ..., other 0.50 s': each phase, then what the rest of the
        engine's start (config, tokenizer, scheduler) took of `total`."""
        parts = [f"{name.replace('_', ' ')} {self.seconds[name]:.2f} s" for name in PHASES]
        parts.append(f"other {max(0.0, total - sum(self.seconds.values())):.2f} s")
        return ", ".join(parts)
