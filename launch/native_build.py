"""Compiling a small C source into a shared library with the system C compiler, cached by hash.

Used where a few lines of C beat what Python can reach: the CUDA step graph's driver calls
(runner/cudagraph/step_graph.py) and the CPU decode kernels (models/cpu_kernels.py). Without a
compiler, callers keep their Python path."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def cache_dir() -> Path:
    return Path(os.environ.get("GRAPHRUNNER_CACHE_DIR") or Path.home() / ".cache" / "graphrunner") / "native"


def compile_shared(name: str, source: str, cc: str, flags: list[str], libs: tuple[str, ...] = (),
                   key: bytes = b"", out_dir: Path | None = None) -> Path:
    """`out_dir/{name}_{hash}.so` built from `source` with `cc flags`; built once per source, flags and
    `key` (what else the build depends on: a header, the CPU's instruction set), then found by the hash."""
    digest = hashlib.sha256(source.encode() + " ".join([cc, *flags, *libs]).encode() + key).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{name}_{digest}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        path = Path(tmp) / f"{name}.c"
        path.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run([cc, *flags, "-shared", "-fPIC", str(path), "-o", str(built), *libs],
                       check=True, capture_output=True, text=True)
        os.replace(built, target)     # atomic: a concurrent build leaves one whole file
    return target
