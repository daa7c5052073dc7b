"""What an earlier start-up of the same configuration left behind: a record file per start-up
configuration, written when a start-up with graphs ends, read by the next start-up. Its presence
says Triton's kernel cache holds every kernel the start-up compiles; it also holds the graph reserve
that start-up measured.

Why: compile-ahead's queue pass (GraphStartUp.kernels_compiled_ahead) runs every capture key's batch
through the model with launches only queued, to find every kernel variant the start-up will launch
and compile them in parallel. With every variant already in the cache the pass costs more than it
saves: its forwards take ~2.6 s for the Llama-3.2-1B shape on an H100, loading the cached variants
at their first launch, one at a time, ~1 s (`graphrunner bench startup --no-cpu`, warm rows;
docs/PERFORMANCE.md, "GPU: LLM to ready"). A start-up that finds its record skips the pass.
The graph reserve (GraphStartUp.measure_graph_reserve: two throwaway captures) depends on the same
things, so the record keeps it and the next start-up sizes its KV cache with it instead of capturing
twice more.

The record's name is a digest of everything that decides which variants are compiled and where
they are found: this package's Python sources (the kernels, their launch rules, the model code),
the torch, Triton and Python versions, the GPU, the engine config, the checkpoint's config.json and
this rank's place in the parallel layout. A stale record costs only time: a variant missing
from the cache compiles at its first launch, as with compiling ahead off. A record that cannot be
read (another format, a broken file) counts as none. The records live in
Triton's cache folder (launch/kernel_cache.py), so emptying that folder drops them too; each is
written to a temporary file and renamed into place (two processes may write one at once).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from importlib import metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from configs import EngineConfig
from launch.kernel_cache import triton_dir

ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("configs", "models", "attention", "runner", "launch")
RECORDS = "graphrunner-start-ups"


@functools.cache
def source_digest() -> str:
    """sha256 of this package's Python sources (relative paths and contents, in path order)."""
    digest = hashlib.sha256()
    for path in sorted(p for package in SOURCE_PACKAGES for p in (ROOT / package).rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def device_identity(device: torch.device) -> str:
    """The GPU's name and compute capability (the device type elsewhere)."""
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)} sm{torch.cuda.get_device_capability(device)}"


def start_up_key(config: EngineConfig, model_path: str, device: torch.device, place: tuple) -> str:
    """The record's name for this start-up; `place`: this rank's tensor-parallel rank and layers."""
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "-"
    config_json = Path(model_path) / "config.json"
    parts = [source_digest(), torch.__version__, triton_version, platform.python_version(), device_identity(device),
             config.model_dump_json(), config_json.read_bytes().hex() if config_json.is_file() else "", repr(place)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def record_path(cache_dir: str | Path, key: str) -> Path:
    return triton_dir(cache_dir) / RECORDS / key


@dataclass(frozen=True)
class StartUpRecord:
    graph_reserve_bytes: int
    """The graph reserve that start-up measured (GraphStartUp.measure_graph_reserve)."""


def read(cache_dir: str | Path, key: str) -> StartUpRecord | None:
    """The record of the start-up `key`, or None where there is none or it cannot be read."""
    try:
        data = json.loads(record_path(cache_dir, key).read_text())
        reserve = data["graph_reserve_bytes"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
        return None
    return StartUpRecord(reserve)


def record(cache_dir: str | Path, key: str, graph_reserve_bytes: int) -> None:
    """Write the record (atomically: a temporary file renamed into place)."""
    path = record_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump({"source": source_digest(), "graph_reserve_bytes": int(graph_reserve_bytes)}, out)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
