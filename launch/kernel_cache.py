"""Where compiled kernels are kept: every cache under one folder, KernelConfig.cache_dir.

    <cache_dir>/native   C libraries built by launch/native_build.py (CPU kernels, the step graph's driver calls)
    <cache_dir>/triton   Triton's compiled kernels (what compile-ahead fills at start-up) and its driver stubs

cache_dir defaults to $GRAPHRUNNER_HOME (else ~/.cache/graphrunner), where the embedded checkpoint is
built too, so one variable moves, or empties, everything graphrunner writes; GRAPHRUNNER_CACHE_DIR
moves the caches alone.

Two processes may fill one folder at once (two engines starting on one machine, a test suite run in
parallel): every file appears whole or not at all. A native build compiles in a private temporary
folder and renames the finished library into place (`compile_shared`; os.replace is atomic, and a
process that already loaded the other copy keeps its mapping); Triton's FileCacheManager writes each
file the same way. tests/test_kernel_cache.py starts two processes on one empty folder at once.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_triton_key_thread: threading.Thread | None = None


def triton_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "triton"


def use_triton_cache(cache_dir: str | Path) -> Path | None:
    """Point Triton's kernel cache of this process at <cache_dir>/triton (through triton.knobs, which
    takes precedence over Triton's own TRITON_CACHE_DIR); None where Triton is not installed or has
    no knobs (then its default, ~/.triton/cache, stays)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    path = triton_dir(cache_dir)
    if knobs.cache.dir != str(path):
        knobs.cache.dir = str(path)
        logger.info("Triton's kernel cache: %s", path)
    return path


def hash_triton_ahead() -> None:
    """Start Triton's two first-kernel costs on a daemon thread (once per process): its own cache
    key, `triton.runtime.cache.triton_key()` (a hash of its sources and of libtriton, hundreds of
    MB), and its GPU driver object, whose creation builds Triton's C helper module with the host's
    C compiler when the cache folder is empty (about half a second: docs/PERFORMANCE.md, "GPU: LLM
    to ready"). Triton meets both at the first kernel it launches or looks up, which in a start-up
    is inside the profile run, on the main thread; begun here, when the engine is set up, they
    overlap the set-up and the weight load (file reads, hashing and the compiler release the GIL).
    `wait_triton_key` joins the thread before the first lookup; both are memoised by Triton, so a
    failure here only means the first kernel pays for them as before."""
    global _triton_key_thread
    if _triton_key_thread is not None:
        return
    try:
        from triton.runtime import driver
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def compute() -> None:
        try:
            triton_key()
            driver.active   # noqa: B018 - the property creates (and keeps) the driver
        except Exception as error:  # noqa: BLE001 - the first kernel computes them and reports
            logger.debug("preparing Triton ahead failed: %s", error)

    _triton_key_thread = threading.Thread(target=compute, name="triton-key", daemon=True)
    _triton_key_thread.start()


def wait_triton_key() -> None:
    """Wait for `hash_triton_ahead`'s thread, if one runs (rather than hash Triton, or build its
    driver, a second time)."""
    if _triton_key_thread is not None:
        _triton_key_thread.join()
